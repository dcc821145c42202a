"""AdamW training steps on a GPT-like model: `vo.AdamW` against FSDP2, ZeRO and DDP, on gloo.

Every configuration trains its own copy of the same model (`benchmarks._gpt.build_gpt`, ~21 M
fp32 parameters by default) from the same initialisation, on the same per-rank batches (a pool
of `pool` batches per rank, cycled, so a working optimizer visibly lowers the loss), with the
same AdamW hyperparameters:

* `ours`                - `vo.AdamW(model.parameters())`, no wrapper. `loss.backward()` fills the
                          gradient buffers and starts their reduce-scatter; `opt.step()` finishes
                          it, updates the local flat shard and all-gathers the parameters back.
* `FSDP2 reshard=True`  - `fully_shard` on every block and on the root, `reshard_after_forward=True`,
                          + `torch.optim.AdamW(foreach=True)` on the DTensor shards.
* `FSDP2 reshard=False` - the same with `reshard_after_forward=False` (no re-gather in backward).
* `ZeRO (DDP)`          - `DistributedDataParallel` + `ZeroRedundancyOptimizer(optimizer_class=
                          torch.optim.AdamW, foreach=True)`.
* `DDP`                 - `DistributedDataParallel` + `torch.optim.AdamW(foreach=True)`.

What one "optimizer step" (`opt.step()`) contains differs, so the whole train step is the
fair end-to-end number:

| config | forward             | backward                             | `opt.step()`                       |
|--------|---------------------|--------------------------------------|------------------------------------|
| ours   | compute             | compute + grad RS (async)            | RS wait + local update + param AG  |
| FSDP2  | compute + param AG  | compute (+ AG if reshard) + grad RS  | local update on the DTensor shards |
| ZeRO   | compute             | compute + grad all-reduce            | update own params + broadcasts     |
| DDP    | compute             | compute + grad all-reduce            | full local update                  |

Timing: all configs live in one launched world and run interleaved, one step each in turn
(the order rotating every step), so background load on the machine hits them alike. Each
step starts after a barrier and is timed per rank (wall clock): `fwd` (model + loss), `bwd`,
`step` (`opt.step()`), `zero_grad`; `train` is their sum. After `--warmup` steps, each number
is the median over `--steps` steps of the slowest rank's time in that step; a time ratio (x) is
the median over steps of the per-step ratio, both configs having run that step side by side.

Phases (`RS ms`, `update ms`, `AG ms`): `--profiled-steps` more steps of each config (configs
interleaved), each under the torch profiler (CPU activities), read from the libraries' own
`record_function` windows: ours `vescale_optim.sync_grads` (what is left of the gradient
reduce-scatter when `opt.step()` starts: it runs during backward), `vescale_optim.update` and
`vescale_optim.gather_params` inside `opt.step()`; FSDP2 its `FSDP::post_backward_reduce`
(RS, in backward) and `FSDP::all_gather*` (AG and copy-out, over forward and backward) windows.
ZeRO and DDP have no such windows (their columns stay empty); a config of ours or FSDP2 whose
profile lacks one fails the run. On CPU, FSDP2 issues its collectives synchronously (its
overlap needs CUDA streams), so its RS and AG are all exposed.

Memory: each config alone in a freshly launched world for `--memory-steps` steps: peak RSS per
rank (`VmHWM`, reset through `/proc/self/clear_refs` just before the first step, so it covers
training and not the model construction every config shares) and the same minus the RSS of the
bare process (torch imported, process group up, no model). With `--malloc live` (default) glibc
serves every block of 128 KiB or more by mmap and frees it at once, so RSS follows the live
tensors instead of the heap's high-water marks, which differ between configs by chance;
`--malloc default` leaves the allocator as a user gets it. Optimizer state bytes are counted
from the tensors held: ours `opt.local_state_bytes()` (checked against `opt.memory_stats()`),
FSDP2 the local shards of the state DTensors, ZeRO its local optimizer's state, DDP the whole state.

Sanity: the mean over ranks of the first step's loss, the last step's and, after training, the
loss on each rank's first batch are printed; all configs do the same math, so they must agree to
float tolerance, and each must have lowered the loss.

    python benchmarks/adamw.py                  # 4 ranks, ~21 M parameters, 12 measured steps
    python benchmarks/adamw.py --quick          # tiny model, a few steps
    python benchmarks/adamw.py --world-size 2 --steps 20
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
from benchmarks._measure import live_malloc, median_of_max, median_ratio, reset_peak, slowest, status_kb  # noqa: E402
from benchmarks._optim import ADAMW, ours, peer  # noqa: E402
from benchmarks._report import FSDP2_ON_CPU, require_finite, table  # noqa: E402
from benchmarks._train import PHASES, batches, interleave  # noqa: E402

CONFIGS = ["ours", "FSDP2 reshard=True", "FSDP2 reshard=False", "ZeRO (DDP)", "DDP"]
BASE = "FSDP2 reshard=True"
STEP_CONTAINS = {
    "ours": "rest of RS (begun in bwd) + update + AG",
    "FSDP2 reshard=True": "update (RS in bwd, AG in fwd+bwd)",
    "FSDP2 reshard=False": "update (RS in bwd, AG in fwd)",
    "ZeRO (DDP)": "update + param broadcast (AR in bwd)",
    "DDP": "full update (AR in bwd)",
}
FULL = dict(vocab=8192, d_model=384, n_layers=8, n_heads=6, seq_len=256, batch=2, seq=32, pool=2)
QUICK = dict(vocab=512, d_model=64, n_layers=2, n_heads=4, seq_len=32, batch=2, seq=32, pool=2)
HYPER = ADAMW
PRELOAD = ["benchmarks.adamw"]  # besides benchmarks._gpt.PEERS
# Phase column -> the profiler windows (name prefixes) it adds up, by library (config's first word).
WINDOWS = {
    "ours": {"RS": ["vescale_optim.sync_grads"], "update": ["vescale_optim.update"],
             "AG": ["vescale_optim.gather_params"]},
    "FSDP2": {"RS": ["FSDP::post_backward_reduce"], "AG": ["FSDP::all_gather"]},
}  # fmt: skip
TIME_COLUMNS = "config|step ms|step x|train ms|train x|fwd ms|bwd ms|zero_grad ms|RS ms|update ms|AG ms"
TIME_COLUMNS = TIME_COLUMNS.split("|")
MEMORY_COLUMNS = "config|peak RSS MB|peak x|peak-base MB|peak-base x|opt state MB|loss first|loss last"
MEMORY_COLUMNS = [*MEMORY_COLUMNS.split("|"), "loss after", "|Δ loss|"]


def _state_bytes(opt) -> int:
    """Bytes of the local state of a torch optimizer (ZeRO's: its local optimizer's; DTensors: the shard)."""
    states = getattr(opt, "optim", opt).state.values()
    local = [v.to_local() if hasattr(v, "to_local") else v
             for s in states for v in s.values() if isinstance(v, torch.Tensor)]  # fmt: skip
    return sum(v.numel() * v.element_size() for v in local)


class Trainer(_train.Trainer):
    """One configuration (see the module's docstring), with the bytes of its optimizer's state and
    the seconds inside its library's profiler windows (`WINDOWS`) in each profiled step."""

    def optimizer(self, model: torch.nn.Module):
        self.windows = WINDOWS.get(self.config.split()[0], {})
        self.phases: dict[str, list[float]] = {k: [] for k in self.windows}  # per profiled step
        if self.config == "ours":
            return ours(model, "AdamW")
        setup = {"ZeRO (DDP)": "ZeRO", "DDP": "DDP"}.get(self.config, "FSDP2")
        self.module, opt = peer(model, setup, reshard_after_forward=self.config != "FSDP2 reshard=False")
        return opt

    def state_bytes(self) -> int:
        if self.config != "ours":
            return _state_bytes(self.opt)
        held, stats = self.opt.local_state_bytes(), self.opt.memory_stats()["state"]
        if held != stats:  # two public counts of the same tensors
            raise RuntimeError(f"local_state_bytes() {held} != memory_stats()['state'] {stats}")
        return held

    def profiled_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One unrecorded step under the profiler: the seconds inside each phase's windows."""
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            self.step(x, y, record=False)
        for k, prefixes in self.windows.items():
            seconds = [_measure.window_seconds(prof, w) for w in prefixes]
            if None in seconds:
                raise RuntimeError(f"{self.config}: no profiler window {prefixes} in a step (did it move?)")
            self.phases[k].append(sum(seconds))


def _time_all(rank: int, world: int, configs: list[str], shape: dict, warmup: int, steps: int,
              profiled: int) -> dict:  # fmt: skip
    """Every config in one world, interleaved step by step (the order rotating), so that
    background load on the machine hits them alike; then `profiled` steps of each, interleaved."""
    pool = batches(shape, rank, world)
    trainers = [Trainer(c, shape) for c in configs]
    interleave(trainers, pool, warmup, steps)
    for s in range(profiled):
        for tr in trainers:
            tr.profiled_step(*pool[s % len(pool)])
    return {tr.config: {"params": tr.params, "threads": torch.get_num_threads(), "times_s": tr.times,
                        "phases_s": tr.phases, "losses": tr.losses, "loss_after": tr.eval_loss(*pool[0]),
                        "state_bytes": tr.state_bytes()} for tr in trainers}  # fmt: skip


def _memory(rank: int, world: int, config: str, shape: dict, steps: int, live: bool) -> dict:
    """Peak RSS of one config in a fresh world over `steps` training steps."""
    tuned = live_malloc() if live else False
    gc.collect()
    base_kb = status_kb("VmRSS")
    pool = batches(shape, rank, world)
    tr = Trainer(config, shape)
    gc.collect()
    setup_kb = status_kb("VmRSS")
    reset = reset_peak()
    for s in range(steps):
        tr.step(*pool[s % len(pool)])
    return {"rss_base_kb": base_kb, "rss_setup_kb": setup_kb, "rss_peak_kb": status_kb("VmHWM"),
            "peak_reset": reset, "live_malloc": tuned, "state_bytes": tr.state_bytes()}  # fmt: skip


# ---------------------------------------------------------------- summary


def summarize(config: str, timed: list[dict], memory: list[dict] | None) -> dict:
    """One table row from every rank's timing results (and memory results) of `config`."""
    ms = {k: 1e3 * median_of_max([r["times_s"][k] for r in timed]) for k in PHASES}
    train = [[sum(step) for step in zip(*(r["times_s"][p] for p in PHASES))] for r in timed]
    step = [r["times_s"]["step"] for r in timed]
    row = {"config": config, "opt.step() contains": STEP_CONTAINS[config], "step ms": ms["step"],
           "train ms": 1e3 * median_of_max(train), "step s per step": slowest(step),
           "train s per step": slowest(train), "fwd ms": ms["fwd"], "bwd ms": ms["bwd"],
           "zero_grad ms": ms["zero_grad"], "opt state MB": max(r["state_bytes"] for r in timed) / 2**20,
           "loss first": statistics.mean(r["losses"][0] for r in timed),
           "loss last": statistics.mean(r["losses"][-1] for r in timed),
           "loss after": statistics.mean(r["loss_after"] for r in timed)}  # fmt: skip
    for k in timed[0]["phases_s"]:
        row[f"{k} ms"] = 1e3 * median_of_max([r["phases_s"][k] for r in timed])
    if memory:
        row["peak RSS MB"] = max(r["rss_peak_kb"] for r in memory) / 1024
        row["peak-base MB"] = max(r["rss_peak_kb"] - r["rss_base_kb"] for r in memory) / 1024
    rss = lambda rank: {f"{k} RSS MB": memory[rank][f"rss_{k}_kb"] / 1024 for k in ("peak", "base", "setup")}
    median = lambda r: {f"{k} ms (median)": 1e3 * statistics.median(v) for k, v in r["times_s"].items()}
    row["per_rank"] = [{"rank": rank, **median(r), "opt state bytes": r["state_bytes"],
                        **(rss(rank) if memory else {})} for rank, r in enumerate(timed)]  # fmt: skip
    row["raw"] = {"timing": timed, "memory": memory}
    return row


def main(argv: list[str] | None = None) -> dict:
    args = parse(__doc__, argv, "tiny model, few steps", world_size=4,
                 steps=(12, "measured steps (median over these)"), warmup=2,
                 memory_steps=(3, "steps of each memory run (0: none)"),
                 profiled_steps=(2, "profiled steps for the phase columns"),
                 malloc=dict(choices=["live", "default"], default="live", help="memory runs: glibc returns "
                             "every block >= 128 KiB at once (live) or as is (default)"),
                 configs=dict(nargs="+", default=CONFIGS, choices=CONFIGS))  # fmt: skip
    shape = dict(QUICK if args.quick else FULL)
    if args.quick:
        args.steps, args.warmup = min(args.steps, 4), min(args.warmup, 1)
        args.memory_steps, args.profiled_steps = min(args.memory_steps, 2), min(args.profiled_steps, 1)
    if args.profiled_steps < 1:
        args.error("--profiled-steps: at least 1 (the RS / update / AG columns come from them)")

    t_start = time.perf_counter()
    per_rank = launch(_time_all, args.world_size, args.configs, shape, args.warmup, args.steps,
                      args.profiled_steps, preload=PRELOAD)  # fmt: skip
    print(f"# timing (all configs interleaved): {time.perf_counter() - t_start:.1f} s", file=sys.stderr)
    rows = []
    for config in args.configs:
        memory = None
        if args.memory_steps > 0:
            t0 = time.perf_counter()
            memory = launch(_memory, args.world_size, config, shape, args.memory_steps, args.malloc == "live",
                            preload=PRELOAD)  # fmt: skip
            print(f"# memory {config}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        rows.append(summarize(config, [r[config] for r in per_rank], memory))

    base = next((r for r in rows if r["config"] == BASE), None)
    for r in rows:
        # Times: the median over steps of the per-step ratio (the configs ran interleaved, so
        # step i of each saw the same load); memory: the plain ratio.
        for k in ("step", "train"):
            if base:
                r[f"{k} x"] = median_ratio(r[f"{k} s per step"], base[f"{k} s per step"])
        for k in ("peak RSS MB", "peak-base MB"):
            if base and base.get(k) and r.get(k) is not None:
                r[f"{k.split()[0]} x"] = r[k] / base[k]
    ref = next((r for r in rows if r["config"] == "DDP"), rows[0])
    for r in rows:
        r["|Δ loss|"] = abs(r["loss after"] - ref["loss after"])

    require_finite(rows, [*TIME_COLUMNS, *MEMORY_COLUMNS])
    params = per_rank[0][args.configs[0]]["params"]
    print(f"\nAdamW on a GPT-like model: {params / 1e6:.1f} M params, world {args.world_size} (gloo), "
          f"{shape['batch']}x{shape['seq']} tokens/rank/step. Times: {args.warmup} warm-up + {args.steps} "
          f"measured steps, configs interleaved in one world, median over steps of the slowest rank; RS / "
          f"update / AG from {args.profiled_steps} profiled step(s). Memory: each config alone in a fresh "
          f"world, {args.memory_steps} steps, malloc={args.malloc}. x = ratio vs {BASE}.\n")  # fmt: skip
    print(table(rows, TIME_COLUMNS))
    print(f"\n{FSDP2_ON_CPU}\n")
    print(table(rows, MEMORY_COLUMNS, floatfmt=".4g"))
    print()
    print(table(rows, ["config", "opt.step() contains"]))

    goals = {}
    o = next((r for r in rows if r["config"] == "ours"), None)
    if o and base:
        goals = {"optimizer step <= 0.5x FSDP2 (opt.step() as called)": o["step x"] <= 0.5,
                 "train step <= 1.0x FSDP2": o["train x"] <= 1.0,
                 "optimizer step <= 0.5x FSDP2 (local update only)":
                     o["update ms"] <= 0.5 * base["step ms"]}  # fmt: skip
        if "peak RSS MB" in o and "peak RSS MB" in base:
            goals["peak RSS <= FSDP2"] = o["peak RSS MB"] <= base["peak RSS MB"]
        print_goals(f"Goals (ours vs {BASE}):", goals)
        print(f"  ours: opt.step() {o['step ms']:.1f} ms, of which (profiled) RS {o['RS ms']:.1f}, update "
              f"{o['update ms']:.1f}, AG {o['AG ms']:.1f}; FSDP2 opt.step() "
              f"{base['step ms']:.1f} ms")  # fmt: skip
    spread = max(r["|Δ loss|"] for r in rows)
    learned = all(r["loss after"] < r["loss first"] - 0.1 for r in rows)
    sane = spread < 1e-3 * max(1.0, abs(ref["loss after"])) and learned
    print(f"\nLoss check: max |Δ loss after| vs {ref['config']} = {spread:.2e}; every config lowered the "
          f"loss: {'yes' if learned else 'NO'} -> {'OK' if sane else 'MISMATCH'}")  # fmt: skip
    print(f"total {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    payload = {"world_size": args.world_size, "threads_per_rank": per_rank.threads, "shape": shape,
               "hyper": HYPER, "warmup": args.warmup, "steps": args.steps, "memory_steps": args.memory_steps,
               "profiled_steps": args.profiled_steps, "malloc": args.malloc, "params": params,
               "loss_check_ok": sane, "goals": goals, "rows": rows}  # fmt: skip
    return finish("adamw", args, payload, per_rank.threads)


if __name__ == "__main__":
    main()
