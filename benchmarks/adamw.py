"""AdamW training steps on a GPT-like model: `vo.AdamW` against FSDP2, ZeRO and DDP, on gloo.

Configurations, each training its own copy of the same seeded GPT (~21 M fp32 parameters) on the
same per-rank batches with the same AdamW hyperparameters: `ours` (`vo.AdamW(model.parameters())`,
no wrapper: backward starts the gradients' reduce-scatter, `opt.step()` finishes it, updates the
local shard and all-gathers the parameters), `FSDP2 reshard=True|False` (`fully_shard` per block
and root, `torch.optim.AdamW(foreach=True)` on the DTensor shards), `ZeRO (DDP)` (DDP +
`ZeroRedundancyOptimizer`) and `DDP`. What one `opt.step()` contains differs (the last table says
what), so the whole train step is the fair end-to-end number.

Time: all configurations in one world, one step each in turn (the order rotating): `fwd`, `bwd`,
`step` (`opt.step()`), `zero_grad` after a barrier; `train` their sum on each rank. A number is the
median over `--steps` of the slowest rank's; `x` the median of per-step ratios to FSDP2
reshard=True. `RS ms`, `update ms`, `AG ms`: `--profiled-steps` more steps under the profiler,
from the libraries' windows: ours `vescale_optim.sync_grads` (what is left of the reduce-scatter
begun in backward), `vescale_optim.update`, `vescale_optim.gather_params`; FSDP2's
`FSDP::post_backward_reduce` and `FSDP::all_gather*` (ZeRO and DDP have none).

Memory, each configuration alone in a fresh world for `--memory-steps`: peak RSS per rank
(`VmHWM`, reset just before the first step) and that less the bare process's; with `--malloc live`
glibc returns every block of 128 KiB or more at once, so RSS follows the live tensors. `opt state`:
ours `local_state_bytes()` (checked against `memory_stats()`), the peers' local state tensors.
Sanity: every configuration lowers the loss and ends within float tolerance of DDP's.

    python benchmarks/adamw.py                  # 4 ranks, ~21 M parameters, 12 measured steps
    python benchmarks/adamw.py --quick          # tiny model, a few steps
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks import _measure, _train  # noqa: E402
from benchmarks._gpt import launch  # noqa: E402
from benchmarks._main import finish, parse, print_goals  # noqa: E402
from benchmarks._measure import live_malloc, median_of_max, median_ratio, slowest, status_kb  # noqa: E402
from benchmarks._optim import ADAMW, ours, peer, state_bytes  # noqa: E402
from benchmarks._report import FSDP2_ON_CPU, require_finite, table  # noqa: E402
from benchmarks._train import PHASES, batches, interleave  # noqa: E402

CONFIGS = ["ours", "FSDP2 reshard=True", "FSDP2 reshard=False", "ZeRO (DDP)", "DDP"]
BASE = "FSDP2 reshard=True"
STEP_CONTAINS = ["rest of RS (begun in bwd) + update + AG", "update (RS in bwd, AG in fwd+bwd)"]
STEP_CONTAINS += [
    "update (RS in bwd, AG in fwd)",
    "update + param broadcast (AR in bwd)",
    "full update (AR in bwd)",
]
STEP_CONTAINS = dict(zip(CONFIGS, STEP_CONTAINS))
FULL = dict(vocab=8192, d_model=384, n_layers=8, n_heads=6, seq_len=256, batch=2, seq=32, pool=2)
QUICK = dict(vocab=512, d_model=64, n_layers=2, n_heads=4, seq_len=32, batch=2, seq=32, pool=2)
PRELOAD = ["benchmarks.adamw"]  # besides benchmarks._gpt.PEERS
# Phase column -> the profiler windows (name prefixes) it adds up, by library (config's first word).
WINDOWS = {"ours": {"RS": ["vescale_optim.sync_grads"], "update": ["vescale_optim.update"]}}
WINDOWS["ours"]["AG"] = ["vescale_optim.gather_params"]
WINDOWS["FSDP2"] = {"RS": ["FSDP::post_backward_reduce"], "AG": ["FSDP::all_gather"]}
TIME_COLUMNS = "config|step ms|step x|train ms|train x|fwd ms|bwd ms|zero_grad ms|RS ms|update ms|AG ms"
TIME_COLUMNS = TIME_COLUMNS.split("|")
MEMORY_COLUMNS = "config|peak RSS MB|peak x|peak-base MB|peak-base x|opt state MB|loss first|loss last"
MEMORY_COLUMNS = [*MEMORY_COLUMNS.split("|"), "loss after", "|Δ loss|"]


class Trainer(_train.Trainer):
    """One configuration (see the module's docstring), with the seconds inside its library's
    profiler windows (`WINDOWS`) in each profiled step."""

    def optimizer(self, model: torch.nn.Module):
        self.windows = WINDOWS.get(self.config.split()[0], {})
        self.phases: dict[str, list[float]] = {k: [] for k in self.windows}  # per profiled step
        if self.config == "ours":
            return ours(model, "AdamW")
        setup = {"ZeRO (DDP)": "ZeRO", "DDP": "DDP"}.get(self.config, "FSDP2")
        self.module, opt = peer(model, setup, reshard_after_forward=self.config != "FSDP2 reshard=False")
        return opt

    def profiled_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One unrecorded step under the profiler: the seconds inside each phase's windows."""
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            self.step(x, y, record=False)
        for k, prefixes in self.windows.items():
            seconds = [_measure.window_seconds(prof, w) for w in prefixes]
            if None in seconds:
                raise RuntimeError(f"{self.config}: no profiler window {prefixes} in a step (did it move?)")
            self.phases[k].append(sum(seconds))


def _time_all(rank: int, world: int, configs: list[str], shape: dict, steps: tuple[int, int, int]) -> dict:
    """Every config in one world, interleaved step by step (the order rotating), so that background
    load hits them alike; then `profiled` steps of each, interleaved (`steps`: warm-up, measured,
    profiled)."""
    pool, (warmup, measured, profiled) = batches(shape, rank, world), steps
    trainers = [Trainer(c, shape) for c in configs]
    interleave(trainers, pool, warmup, measured)
    for s in range(profiled):
        for tr in trainers:
            tr.profiled_step(*pool[s % len(pool)])
    more = lambda tr: dict(
        threads=torch.get_num_threads(), phases_s=tr.phases, state_bytes=state_bytes(tr.opt)
    )  # noqa: E731
    return {tr.config: tr.result(*pool[0], **more(tr)) for tr in trainers}


def _memory(rank: int, world: int, config: str, shape: dict, steps: int, live: bool) -> dict:
    """Peak RSS of one config in a fresh world over `steps` training steps."""
    tuned = live_malloc() if live else False
    gc.collect()
    base_kb = status_kb("VmRSS")
    pool = batches(shape, rank, world)
    tr = Trainer(config, shape)
    gc.collect()
    setup_kb = status_kb("VmRSS")
    reset = _measure.reset_peak()
    for s in range(steps):
        tr.step(*pool[s % len(pool)])
    out = dict(rss_base_kb=base_kb, rss_setup_kb=setup_kb, rss_peak_kb=status_kb("VmHWM"), peak_reset=reset)
    return {**out, "live_malloc": tuned, "state_bytes": state_bytes(tr.opt)}


def summarize(config: str, timed: list[dict], memory: list[dict] | None) -> dict:
    """One table row from every rank's timing results (and memory results) of `config`."""
    ms = {k: 1e3 * median_of_max([r["times_s"][k] for r in timed]) for k in PHASES}
    train = [[sum(step) for step in zip(*(r["times_s"][p] for p in PHASES))] for r in timed]
    step = [r["times_s"]["step"] for r in timed]
    row = {"config": config, "opt.step() contains": STEP_CONTAINS[config], "step ms": ms["step"]}
    row.update({"train ms": 1e3 * median_of_max(train), "step s per step": slowest(step)})
    row.update(
        {"train s per step": slowest(train), **{f"{k} ms": ms[k] for k in ("fwd", "bwd", "zero_grad")}}
    )
    row["opt state MB"] = max(r["state_bytes"] for r in timed) / 2**20
    for k, key in (("loss first", lambda r: r["losses"][0]), ("loss last", lambda r: r["losses"][-1])):
        row[k] = statistics.mean(key(r) for r in timed)
    row["loss after"] = statistics.mean(r["loss_after"] for r in timed)
    for k in timed[0]["phases_s"]:
        row[f"{k} ms"] = 1e3 * median_of_max([r["phases_s"][k] for r in timed])
    if memory:
        row["peak RSS MB"] = max(r["rss_peak_kb"] for r in memory) / 1024
        row["peak-base MB"] = max(r["rss_peak_kb"] - r["rss_base_kb"] for r in memory) / 1024
    rss = lambda rank: {f"{k} RSS MB": memory[rank][f"rss_{k}_kb"] / 1024 for k in ("peak", "base", "setup")}  # noqa: E731
    median = lambda r: {f"{k} ms (median)": 1e3 * statistics.median(v) for k, v in r["times_s"].items()}  # noqa: E731
    row["per_rank"] = [
        {"rank": rank, **median(r), "opt state bytes": r["state_bytes"]} for rank, r in enumerate(timed)
    ]
    if memory:
        for rank, r in enumerate(row["per_rank"]):
            r.update(rss(rank))
    row["raw"] = {"timing": timed, "memory": memory}
    return row


def _ratios(rows: list[dict]) -> tuple[dict | None, dict]:
    """Each row's `x` columns against `BASE` (times: the median of the per-step ratios; memory: the
    plain ratio) and `|Δ loss|` against DDP's loss after training; `BASE`'s row and DDP's."""
    base = next((r for r in rows if r["config"] == BASE), None)
    for r in rows:
        for k in ("step", "train"):
            if base:
                r[f"{k} x"] = median_ratio(r[f"{k} s per step"], base[f"{k} s per step"])
        for k in ("peak RSS MB", "peak-base MB"):
            if base and base.get(k) and r.get(k) is not None:
                r[f"{k.split()[0]} x"] = r[k] / base[k]
    ref = next((r for r in rows if r["config"] == "DDP"), rows[0])
    for r in rows:
        r["|Δ loss|"] = abs(r["loss after"] - ref["loss after"])
    return base, ref


def _goals(rows: list[dict], base: dict | None) -> dict[str, bool]:
    o = next((r for r in rows if r["config"] == "ours"), None)
    if not (o and base):
        return {}
    goals = {"optimizer step <= 0.5x FSDP2 (opt.step() as called)": o["step x"] <= 0.5}
    goals["train step <= 1.0x FSDP2"] = o["train x"] <= 1.0
    goals["optimizer step <= 0.5x FSDP2 (local update only)"] = o["update ms"] <= 0.5 * base["step ms"]
    if "peak RSS MB" in o and "peak RSS MB" in base:
        goals["peak RSS <= FSDP2"] = o["peak RSS MB"] <= base["peak RSS MB"]
    print_goals(f"Goals (ours vs {BASE}):", goals)
    parts = f"RS {o['RS ms']:.1f}, update {o['update ms']:.1f}, AG {o['AG ms']:.1f}"
    print(
        f"  ours: opt.step() {o['step ms']:.1f} ms, of which (profiled) {parts}; FSDP2 {base['step ms']:.1f}"
    )
    return goals


def main(argv: list[str] | None = None) -> dict:
    args = parse(
        __doc__,
        argv,
        "tiny model, few steps",
        world_size=4,
        steps=(12, "measured steps (median over these)"),
        warmup=2,
        memory_steps=(3, "steps of each memory run (0: none)"),
        profiled_steps=(2, "profiled steps for the phase columns"),
        malloc=dict(choices=["live", "default"], default="live", help="memory runs: glibc's large blocks"),
        configs=dict(nargs="+", default=CONFIGS, choices=CONFIGS),
    )
    shape = dict(QUICK if args.quick else FULL)
    if args.quick:
        args.steps, args.warmup = min(args.steps, 4), min(args.warmup, 1)
        args.memory_steps, args.profiled_steps = min(args.memory_steps, 2), min(args.profiled_steps, 1)
    if args.profiled_steps < 1:
        args.error("--profiled-steps: at least 1 (the RS / update / AG columns come from them)")
    t_start = time.perf_counter()
    steps = (args.warmup, args.steps, args.profiled_steps)
    per_rank = launch(_time_all, args.world_size, args.configs, shape, steps, preload=PRELOAD)
    print(f"# timing (all configs interleaved): {time.perf_counter() - t_start:.1f} s", file=sys.stderr)
    rows = []
    for config in args.configs:
        memory, t0 = None, time.perf_counter()
        if args.memory_steps > 0:
            live = args.malloc == "live"
            memory = launch(_memory, args.world_size, config, shape, args.memory_steps, live, preload=PRELOAD)
            print(f"# memory {config}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        rows.append(summarize(config, [r[config] for r in per_rank], memory))
    base, ref = _ratios(rows)
    require_finite(rows, [*TIME_COLUMNS, *MEMORY_COLUMNS])
    params = per_rank[0][args.configs[0]]["params"]
    print(f"\nAdamW on a GPT-like model: {params / 1e6:.1f} M params, world {args.world_size} (gloo),")
    print(f"{shape['batch']}x{shape['seq']} tokens/rank/step. Times: {args.warmup} warm-up + {args.steps}")
    print("measured steps, configs interleaved in one world, median over steps of the slowest rank;")
    print(f"RS / update / AG from {args.profiled_steps} profiled step(s). Memory: each config alone in a")
    print(f"fresh world, {args.memory_steps} steps, malloc={args.malloc}. x = ratio vs {BASE}.\n")
    print(table(rows, TIME_COLUMNS))
    print(f"\n{FSDP2_ON_CPU}\n")
    print(table(rows, MEMORY_COLUMNS, floatfmt=".4g"))
    print(f"\n{table(rows, ['config', 'opt.step() contains'])}")
    goals = _goals(rows, base)
    spread = max(r["|Δ loss|"] for r in rows)
    learned = all(r["loss after"] < r["loss first"] - 0.1 for r in rows)
    sane = spread < 1e-3 * max(1.0, abs(ref["loss after"])) and learned
    print(f"\nLoss check: max |Δ loss after| vs {ref['config']} = {spread:.2e}; every config lowered the")
    print(f"loss: {'yes' if learned else 'NO'} -> {'OK' if sane else 'MISMATCH'}")
    print(f"total {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    payload = dict(world_size=args.world_size, threads_per_rank=per_rank.threads, shape=shape, hyper=ADAMW)
    payload.update(warmup=args.warmup, steps=args.steps, memory_steps=args.memory_steps)
    payload.update(profiled_steps=args.profiled_steps, malloc=args.malloc, params=params)
    payload.update(loss_check_ok=sane, goals=goals, rows=rows)
    return finish("adamw", args, payload, per_rank.threads)


if __name__ == "__main__":
    main()
