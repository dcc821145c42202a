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

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks._gpt import build_gpt, launch, param_count, random_batch  # noqa: E402
from benchmarks._measure import live_malloc, median_of_max, reset_peak, slowest, status_kb, window_seconds  # noqa: E402
from benchmarks._optim import ADAMW  # noqa: E402
from benchmarks._report import FSDP2_ON_CPU, environment, host_line, require_finite, save_json, table  # noqa: E402

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
PHASES = ["fwd", "bwd", "step", "zero_grad"]


# ---------------------------------------------------------------- configs


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _state_bytes(states) -> int:
    return sum(
        _local(v).numel() * _local(v).element_size()
        for s in states
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )


def _setup(config: str, model: torch.nn.Module):
    """Return (module to call, optimizer, state-bytes function)."""
    if config == "ours":
        import vescale_optim as vo

        opt = vo.AdamW(model.parameters(), **HYPER)

        def state_bytes() -> int:
            held, stats = opt.local_state_bytes(), opt.memory_stats()["state"]
            if held != stats:  # two public counts of the same tensors
                raise RuntimeError(f"local_state_bytes() {held} != memory_stats()['state'] {stats}")
            return held

        return model, opt, state_bytes
    if config.startswith("FSDP2"):
        from torch.distributed.fsdp import fully_shard

        reshard = config.endswith("True")
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        opt = torch.optim.AdamW(model.parameters(), foreach=True, **HYPER)
        return model, opt, lambda: _state_bytes(opt.state.values())
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    if config == "DDP":
        opt = torch.optim.AdamW(ddp.parameters(), foreach=True, **HYPER)
        return ddp, opt, lambda: _state_bytes(opt.state.values())
    from torch.distributed.optim import ZeroRedundancyOptimizer

    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, foreach=True, **HYPER)
    return ddp, opt, lambda: _state_bytes(opt.optim.state.values())


def _loss(module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = module(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _batches(shape: dict, rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's pool of training batches (cycled through; the same for every config)."""
    return [
        random_batch(shape["batch"], shape["seq"], shape["vocab"], seed=1000 + i * world + rank)
        for i in range(shape["pool"])
    ]


class _Trainer:
    """One configuration: its own model copy, optimizer and per-step measurements."""

    def __init__(self, config: str, shape: dict):
        self.config = config
        model = build_gpt(
            shape["vocab"], shape["d_model"], shape["n_layers"], shape["n_heads"], shape["seq_len"], seed=0
        )
        self.params = param_count(model)
        self.module, self.opt, self.state_bytes = _setup(config, model)
        self.windows = WINDOWS.get(config.split()[0], {})
        self.times: dict[str, list[float]] = {k: [] for k in PHASES}
        self.phases: dict[str, list[float]] = {k: [] for k in self.windows}  # per profiled step
        self.losses: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor, record: bool) -> None:
        dist.barrier()
        t0 = time.perf_counter()
        loss = _loss(self.module, x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        t3 = time.perf_counter()
        self.opt.zero_grad()
        t4 = time.perf_counter()
        self.losses.append(loss.item())
        if not record:
            return
        for k, v in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            self.times[k].append(v)

    def profiled_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One unrecorded step under the profiler: the seconds inside each phase's windows."""
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            self.step(x, y, record=False)
        for k, prefixes in self.windows.items():
            seconds = [window_seconds(prof, w) for w in prefixes]
            if None in seconds:
                raise RuntimeError(f"{self.config}: no profiler window {prefixes} in a step (did it move?)")
            self.phases[k].append(sum(seconds))

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return _loss(self.module, x, y).item()


def _time_all(rank: int, world: int, configs: list[str], shape: dict, warmup: int, steps: int,
              profiled: int) -> dict:  # fmt: skip
    """Every config in one world, interleaved step by step (the order rotating), so that
    background load on the machine hits them alike; then `profiled` steps of each, interleaved."""
    batches = _batches(shape, rank, world)
    trainers = [_Trainer(c, shape) for c in configs]
    for s in range(warmup + steps):
        x, y = batches[s % len(batches)]
        k = s % len(trainers)
        for tr in trainers[k:] + trainers[:k]:
            tr.step(x, y, record=s >= warmup)
    for s in range(profiled):
        for tr in trainers:
            tr.profiled_step(*batches[s % len(batches)])
    return {
        tr.config: {
            "params": tr.params,
            "threads": torch.get_num_threads(),
            "times_s": tr.times,
            "phases_s": tr.phases,
            "losses": tr.losses,
            "loss_after": tr.eval_loss(*batches[0]),
            "state_bytes": tr.state_bytes(),
        }
        for tr in trainers
    }


def _memory(rank: int, world: int, config: str, shape: dict, steps: int, live: bool) -> dict:
    """Peak RSS of one config in a fresh world over `steps` training steps."""
    tuned = live_malloc() if live else False
    gc.collect()
    base_kb = status_kb("VmRSS")
    batches = _batches(shape, rank, world)
    tr = _Trainer(config, shape)
    gc.collect()
    setup_kb = status_kb("VmRSS")
    reset = reset_peak()
    for s in range(steps):
        tr.step(*batches[s % len(batches)], record=True)
    return {
        "rss_base_kb": base_kb,
        "rss_setup_kb": setup_kb,
        "rss_peak_kb": status_kb("VmHWM"),
        "peak_reset": reset,
        "live_malloc": tuned,
        "state_bytes": tr.state_bytes(),
    }


# ---------------------------------------------------------------- summary


def summarize(config: str, timed: list[dict], memory: list[dict] | None) -> dict:
    """One table row from every rank's timing results (and memory results) of `config`."""
    keys = timed[0]["times_s"].keys()
    ms = {k: 1e3 * median_of_max([r["times_s"][k] for r in timed]) for k in keys}
    train = [[sum(step) for step in zip(*(r["times_s"][p] for p in PHASES))] for r in timed]
    row = {
        "config": config,
        "opt.step() contains": STEP_CONTAINS[config],
        "step ms": ms["step"],
        "train ms": 1e3 * median_of_max(train),
        "step s per step": slowest([r["times_s"]["step"] for r in timed]),
        "train s per step": slowest(train),
        "fwd ms": ms["fwd"],
        "bwd ms": ms["bwd"],
        "zero_grad ms": ms["zero_grad"],
        "opt state MB": max(r["state_bytes"] for r in timed) / 2**20,
        "loss first": statistics.mean(r["losses"][0] for r in timed),
        "loss last": statistics.mean(r["losses"][-1] for r in timed),
        "loss after": statistics.mean(r["loss_after"] for r in timed),
    }
    for k in timed[0]["phases_s"]:
        row[f"{k} ms"] = 1e3 * median_of_max([r["phases_s"][k] for r in timed])
    if memory:
        row["peak RSS MB"] = max(r["rss_peak_kb"] for r in memory) / 1024
        row["peak-base MB"] = max(r["rss_peak_kb"] - r["rss_base_kb"] for r in memory) / 1024
    row["per_rank"] = [
        {
            "rank": rank,
            **{f"{k} ms (median)": 1e3 * statistics.median(v) for k, v in r["times_s"].items()},
            "opt state bytes": r["state_bytes"],
            **(
                {
                    "peak RSS MB": memory[rank]["rss_peak_kb"] / 1024,
                    "base RSS MB": memory[rank]["rss_base_kb"] / 1024,
                    "setup RSS MB": memory[rank]["rss_setup_kb"] / 1024,
                }
                if memory
                else {}
            ),
        }
        for rank, r in enumerate(timed)
    ]
    row["raw"] = {"timing": timed, "memory": memory}
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12, help="measured steps (median over these)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--memory-steps", type=int, default=3, help="steps of each memory run (0: none)")
    ap.add_argument("--profiled-steps", type=int, default=2, help="profiled steps for the phase columns")
    ap.add_argument(
        "--malloc",
        choices=["live", "default"],
        default="live",
        help="memory runs: glibc returns every block >= 128 KiB at once (live) or as is (default)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps")
    ap.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    args = ap.parse_args(argv)
    shape = dict(QUICK if args.quick else FULL)
    if args.quick:
        args.steps, args.warmup = min(args.steps, 4), min(args.warmup, 1)
        args.memory_steps, args.profiled_steps = min(args.memory_steps, 2), min(args.profiled_steps, 1)
    if args.profiled_steps < 1:
        ap.error("--profiled-steps: at least 1 (the RS / update / AG columns come from them)")

    t_start = time.perf_counter()
    per_rank = launch(_time_all, args.world_size, args.configs, shape, args.warmup, args.steps,
                      args.profiled_steps, preload=PRELOAD)  # fmt: skip
    print(f"# timing (all configs interleaved): {time.perf_counter() - t_start:.1f} s", file=sys.stderr)
    rows = []
    for config in args.configs:
        memory = None
        if args.memory_steps > 0:
            t0 = time.perf_counter()
            memory = launch(
                _memory,
                args.world_size,
                config,
                shape,
                args.memory_steps,
                args.malloc == "live",
                preload=PRELOAD,
            )
            print(f"# memory {config}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        rows.append(summarize(config, [r[config] for r in per_rank], memory))

    base = next((r for r in rows if r["config"] == BASE), None)
    for r in rows:
        # Times: the median over steps of the per-step ratio (the configs ran interleaved, so
        # step i of each saw the same load); memory: the plain ratio.
        for k in ("step", "train"):
            if base:
                pairs = zip(r[f"{k} s per step"], base[f"{k} s per step"])
                r[f"{k} x"] = statistics.median(a / b for a, b in pairs if b > 0)
        for k in ("peak RSS MB", "peak-base MB"):
            if base and base.get(k) and r.get(k) is not None:
                r[f"{k.split()[0]} x"] = r[k] / base[k]
    ref = next((r for r in rows if r["config"] == "DDP"), rows[0])
    for r in rows:
        r["|Δ loss|"] = abs(r["loss after"] - ref["loss after"])

    require_finite(rows, [*TIME_COLUMNS, *MEMORY_COLUMNS])
    params = per_rank[0][args.configs[0]]["params"]
    print(
        f"\nAdamW on a GPT-like model: {params / 1e6:.1f} M params, world {args.world_size} (gloo), "
        f"{shape['batch']}x{shape['seq']} tokens/rank/step. "
        f"Times: {args.warmup} warm-up + {args.steps} measured steps, configs interleaved in one world, "
        f"median over steps of the slowest rank; RS / update / AG from {args.profiled_steps} profiled "
        f"step(s). Memory: each config alone in a fresh world, "
        f"{args.memory_steps} steps, malloc={args.malloc}. x = ratio vs {BASE}.\n"
        f"\n{host_line(per_rank.threads)}\n"
    )
    print(table(rows, TIME_COLUMNS))
    print(f"\n{FSDP2_ON_CPU}\n")
    print(
        table(
            rows,
            MEMORY_COLUMNS,
            floatfmt=".4g",
        )
    )
    print()
    print(table(rows, ["config", "opt.step() contains"]))

    goals = {}
    ours = next((r for r in rows if r["config"] == "ours"), None)
    if ours and base:
        goals = {
            "optimizer step <= 0.5x FSDP2 (opt.step() as called)": ours["step x"] <= 0.5,
            "train step <= 1.0x FSDP2": ours["train x"] <= 1.0,
        }
        goals["optimizer step <= 0.5x FSDP2 (local update only)"] = ours["update ms"] <= 0.5 * base["step ms"]
        if "peak RSS MB" in ours and "peak RSS MB" in base:
            goals["peak RSS <= FSDP2"] = ours["peak RSS MB"] <= base["peak RSS MB"]
        print(f"\nGoals (ours vs {BASE}):")
        for k, v in goals.items():
            print(f"  {'met    ' if v else 'NOT met'}  {k}")
        print(
            f"  ours: opt.step() {ours['step ms']:.1f} ms, of which (profiled) RS {ours['RS ms']:.1f}, "
            f"update {ours['update ms']:.1f}, AG {ours['AG ms']:.1f}; FSDP2 opt.step() {base['step ms']:.1f} "
            "ms"
        )
    spread = max(r["|Δ loss|"] for r in rows)
    learned = all(r["loss after"] < r["loss first"] - 0.1 for r in rows)
    sane = spread < 1e-3 * max(1.0, abs(ref["loss after"])) and learned
    print(
        f"\nLoss check: max |Δ loss after| vs {ref['config']} = {spread:.2e}; every config lowered the "
        f"loss: {'yes' if learned else 'NO'} -> {'OK' if sane else 'MISMATCH'}"
    )
    print(f"total {time.perf_counter() - t_start:.0f} s", file=sys.stderr)

    payload = {
        "env": environment(per_rank.threads),
        "world_size": args.world_size,
        "threads_per_rank": per_rank.threads,
        "shape": shape,
        "hyper": HYPER,
        "warmup": args.warmup,
        "steps": args.steps,
        "memory_steps": args.memory_steps,
        "profiled_steps": args.profiled_steps,
        "malloc": args.malloc,
        "params": params,
        "loss_check_ok": sane,
        "goals": goals,
        "rows": rows,
    }
    path = save_json("adamw_quick" if args.quick else "adamw", payload)
    print(f"wrote {path}", file=sys.stderr)
    return payload


if __name__ == "__main__":
    main()
