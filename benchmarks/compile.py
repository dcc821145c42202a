"""Compiled blocks: ZeRO-3 training with every block compiled (`block.compile()`), ours against
FSDP2, on gloo: train-step time, peak live tensor bytes and first-step compile time.

Configurations, each training its own copy of the benchmark GPT of `benchmarks/fsdp.py` on the
same per-rank batches with AdamW: `ours eager` (`vo.AdamW(..., shard_modules=[*model.blocks,
model])`), `ours compiled` (then `block.compile()` per block: the unit hooks run eagerly, outside
the graphs), `FSDP2 eager` (`benchmarks._optim.fsdp2`) and `FSDP2 compiled` (its hooks are
dynamo-disabled: they too run between the graphs). `x FSDP2`: against FSDP2 in the same mode (FSDP2
eager, saying why, where FSDP2 + compile does not run here); `x eager`: against its own eager run.

Time: all configurations in one world, one step each in turn (the order rotating): `--warmup`
rounds (the first compiles), then `--steps` rounds under `set_stance("fail_on_recompile")`; phases
after a barrier, `train` their sum; the median over steps of the slowest rank's, a ratio the
median of per-step ratios. First step and memory, each configuration alone in a fresh world with
an empty inductor cache per rank (after a world that compiled a small function once, so reading
the compiler from disk lands on none of them; `--quick`: all but FSDP2 compiled in one world):
`first step s` the slowest rank's first train step, `compile s` that less its median later step;
then another copy trains `--memory-steps` under the profiler (`benchmarks._live`): `peak live` the
most tensor bytes alive in a step after the first, `peak at` where. Sanity: every configuration
lowers the loss and ends within `LOSS_TOL` (relative) of `ours eager`'s.

    python benchmarks/compile.py            # 4 ranks, the benchmark GPT (~11 min on 2 busy cores)
    python benchmarks/compile.py --quick    # tiny GPT, 2 ranks, aot_eager backend (a smoke test)
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Inductor compiles in the rank's own process (no worker pool: the ranks share the CPUs already). Its
# config reads this when imported, which the ranks' forkserver does (`torch._dynamo`, preloaded) as
# the process's first world starts: after this line.
os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"

import torch  # noqa: E402

from benchmarks import _train  # noqa: E402
from benchmarks._gpt import Ranks, launch  # noqa: E402
from benchmarks._live import live_steps  # noqa: E402
from benchmarks._main import finish, parse, print_goals  # noqa: E402
from benchmarks._measure import load_average, median_ratio, slowest  # noqa: E402
from benchmarks._optim import fsdp2, ours  # noqa: E402
from benchmarks._report import FSDP2_ON_CPU, require_finite, table  # noqa: E402
from benchmarks._train import PHASES, batches, interleave, timed_row  # noqa: E402
from benchmarks._verdict import loss_check, shape_words  # noqa: E402
from benchmarks.fsdp import MODELS, QUICK  # noqa: E402
from vescale_optim.local_world import RankError  # noqa: E402

CONFIGS = ["ours eager", "ours compiled", "FSDP2 eager", "FSDP2 compiled"]
MODEL, QUICK_MODEL = MODELS["gpt"], QUICK["gpt"]
PRELOAD = ["benchmarks.compile", "benchmarks.fsdp"]  # besides benchmarks._gpt.PEERS
LOSS_TOL = 1e-3  # relative, against ours eager: inductor fuses and reorders fp32 arithmetic
TABLE = (
    "config|train ms|x FSDP2|x eager|fwd ms|bwd ms|step ms|peak live MB|peak live x|first step s|compile s"
)
TABLE = [*TABLE.split("|"), "compile x", "loss after", "|Δ loss|"]
RATIOS = ["x FSDP2", "x eager", "peak live x", "compile x"]


def peer(config: str, fsdp2_compiles: bool = True) -> str:
    """FSDP2 in the same mode (FSDP2 eager where FSDP2 + compile did not run)."""
    mode = config.split()[-1]
    return "FSDP2 eager" if mode == "compiled" and not fsdp2_compiles else f"FSDP2 {mode}"


# ---------------------------------------------------------------- one configuration


class Trainer(_train.Trainer):
    """One configuration (see the module's docstring); `backend` is `torch.compile`'s."""

    def __init__(self, config: str, shape: dict, backend: str):
        self.backend = backend
        super().__init__(config, shape)

    def optimizer(self, model: torch.nn.Module):
        if self.config.startswith("ours"):
            opt = ours(model, "AdamW", shard_modules=[*model.blocks, model])
        else:
            opt = fsdp2(model, "AdamW")
        if self.config.endswith("compiled"):
            for block in model.blocks:
                block.compile(backend=self.backend)
        return opt


def _fresh_compiler(folder: str | None) -> None:
    """Nothing compiled in this process, inductor's caches in `folder` (None: left as they are);
    inductor compiles in this process (`TORCHINDUCTOR_COMPILE_THREADS=1`, set above)."""
    torch.compiler.reset()
    if folder is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder


def _train_seconds(tr: Trainer) -> list[float]:
    return [sum(t) for t in zip(*(tr.times[k] for k in PHASES))]


# ---------------------------------------------------------------- the ranks


def _time_all(
    rank: int, world: int, shape: dict, configs: list[str], backend: str, rounds: tuple, cache
) -> dict:
    """Every configuration in this world, interleaved step by step; no recompilation once warm.
    `cache` None (--quick): what this process compiled before is kept."""
    if cache is not None:
        _fresh_compiler(cache)
    pool = batches(shape, rank, world)
    trainers, (warmup, steps) = [Trainer(c, shape, backend) for c in configs], rounds
    interleave(trainers, pool, warmup, 0)
    with torch.compiler.set_stance("fail_on_recompile"):
        interleave(trainers, pool, 0, steps)
    return {tr.config: tr.result(*pool[0]) for tr in trainers}


def _warm(rank: int, world: int, backend: str) -> None:
    """Compile and run a small function once, in an empty cache that is then dropped: the first
    compilation on a machine also reads the compiler, its headers and inductor's modules from
    disk, which would otherwise land on whichever configuration compiles first."""
    folder = tempfile.mkdtemp(prefix=f"compile_bench_warm_r{rank}_")
    try:
        _fresh_compiler(folder)
        fn = torch.compile(lambda a, b: torch.nn.functional.gelu(a @ b).sum(), backend=backend)
        a = torch.randn(16, 16, requires_grad=True)
        fn(a, torch.randn(16, 16)).backward()
    finally:
        torch.compiler.reset()
        shutil.rmtree(folder, ignore_errors=True)


def _alone(
    rank: int, world: int, shape: dict, config: str, backend: str, steps: int, memory_steps: int
) -> dict:
    """One configuration in a fresh process: its first steps from an empty compiler cache, then
    the live bytes of another copy's steps (see the module's docstring)."""
    folder = tempfile.mkdtemp(prefix=f"compile_bench_r{rank}_")
    try:
        _fresh_compiler(folder)
        pool = batches(shape, rank, world)
        tr = Trainer(config, shape, backend)
        for s in range(1 + steps):
            tr.step(*pool[s % 2])
        per_step = _train_seconds(tr)
        del tr
        gc.collect()
        out = {"first_s": per_step[0], "later_s": per_step[1:]}
        if memory_steps:
            tr, trace = live_steps(lambda: Trainer(config, shape, backend), pool, memory_steps)
            out.update(trace.summary())
            del tr, trace
            gc.collect()
        return out
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------- summary


def _calls(rank: int, world: int, calls: list[tuple]) -> list:
    return [fn(rank, world, *args) for fn, args in calls]


def _worlds(world: int, calls: list[tuple], one: bool = False, log=None, t0: float = 0.0) -> list[Ranks]:
    """`[fn(rank, world, *args) for each rank] for (fn, args) in calls`: each call in a fresh world,
    or all in one (`one`)."""
    if one:
        per_rank = launch(_calls, world, calls, preload=PRELOAD)
        out = [Ranks(r[i] for r in per_rank) for i in range(len(calls))]
        for r in out:
            r.threads = per_rank.threads
        return out
    out = []
    for fn, args in calls:
        out.append(launch(fn, world, *args, preload=PRELOAD))
        if log is not None:
            log(f"{fn.__name__} {args[1] if fn is _alone else ''}: {time.perf_counter() - t0:.0f} s")
    return out


def summarize(timed: dict[str, list[dict]], alone: dict[str, list[dict]], fsdp2_compiles: bool) -> list[dict]:
    """One row per configuration from every rank's results, with its ratios."""
    rows = {config: timed_row(config, res) for config, res in timed.items()}
    for config, row in rows.items():
        if mine := alone.get(config):
            first = max(m["first_s"] for m in mine)
            row["first step s"] = first
            if config.endswith("compiled"):
                row["compile s"] = first - statistics.median(slowest([m["later_s"] for m in mine]))
            if "live_peak" in mine[0]:
                top = max(mine, key=lambda m: m["live_peak"])
                row.update(
                    {"peak live MB": top["live_peak"] / 2**20, "peak by": top["live_by"], "memory": mine}
                )
                row["at step start MB"] = max(m["live_start"] for m in mine) / 2**20
                row["peak at"] = " > ".join(top["live_where"][1:])
    for config, row in rows.items():
        base, eager = rows.get(peer(config, fsdp2_compiles)), rows.get(config.replace("compiled", "eager"))
        if config.startswith("ours") and base:
            row["x FSDP2"] = median_ratio(row["_train"], base["_train"])
            if row.get("peak live MB") and base.get("peak live MB"):
                row["peak live x"] = row["peak live MB"] / base["peak live MB"]
            if "compile s" in row and base.get("compile s", 0) > 0:
                row["compile x"] = row["compile s"] / base["compile s"]
        if config.endswith("compiled") and eager:
            row["x eager"] = median_ratio(row["_train"], eager["_train"])
        if "ours eager" in rows:
            row["|Δ loss|"] = abs(row["loss after"] - rows["ours eager"]["loss after"])
    for row in rows.values():
        del row["_train"], row["_step"]
    return list(rows.values())


def _goals(rows: dict[str, dict], fsdp2_compiles: bool) -> dict[str, bool]:
    goals, mine = {}, rows.get("ours compiled", {})
    base = "FSDP2 compiled" if fsdp2_compiles else "FSDP2 eager (FSDP2 + compile did not run here)"
    if "x FSDP2" in mine:
        goals[f"ours compiled: train step <= 0.8x {base} ({mine['x FSDP2']:.3f}x)"] = mine["x FSDP2"] <= 0.8
    if "x eager" in mine:
        faster = mine["x eager"] < 1
        goals[f"ours compiled: train step faster than ours eager ({mine['x eager']:.3f}x)"] = faster
    return goals


def _fsdp2_status(fsdp2_compiles: bool, reason: str | None, backend: str) -> str:
    here = f"on CPU/gloo here (torch {torch.__version__}, backend {backend})"
    if fsdp2_compiles:
        how = "`fully_shard` on every block and the model, then `block.compile()`; FSDP2's hooks are"
        return f"FSDP2 + compile: runs {here}: {how} dynamo-disabled, so they run eagerly between the graphs"
    return f"FSDP2 + compile: does NOT run {here}: {reason}. `ours compiled` is compared with FSDP2 eager."


def report(rows: list[dict], run: dict, args) -> dict:
    by, w = {r["config"]: r for r in rows}, run["world"]
    if run["quick"]:
        print("--quick: a smoke run on a tiny model; its ratios say nothing about the goals")
    params = f"{rows[0]['params'] / 1e6:.1f} M params {shape_words(run['shape'])}"
    print(f"\n## Compiled blocks: {params}, W={w} (gloo), AdamW, torch.compile backend {run['backend']};")
    print(
        f"{run['warmup']} warm-up + {run['steps']} interleaved steps, median of the slowest rank; x FSDP2 ="
    )
    print("vs FSDP2 in the same mode, x eager = vs the same library eager; first step and peak live: each")
    print("config alone in a fresh world, empty compiler caches\n")
    print(table(rows, TABLE, floatfmt=".4g"))
    print(f"\n{FSDP2_ON_CPU}")
    print(f"\n{_fsdp2_status(run['fsdp2_compiles'], run['fsdp2_compile_error'], run['backend'])}")
    print(f"\npeak at (rank with the highest peak); load average {load_average()}\n")
    print(table(rows, ["config", "peak live MB", "at step start MB", "peak at"], floatfmt=".4g"))
    goals = print_goals(f"Goals (W={w}; load average {load_average()}):", _goals(by, run["fsdp2_compiles"]))
    sane, notes = loss_check(rows, LOSS_TOL)
    within = f"ends within {LOSS_TOL:g} relative of ours eager"
    print(f"\nLoss check (every config lowered the loss and {within}):")
    print(f"{'OK' if sane else 'MISMATCH'}" + "".join(f"\n  {n}" for n in notes))
    print(f"\nwall {run['wall_s']:.0f} s")
    payload = {**run, "load_average": load_average(), "goals": goals, "loss_check_ok": sane, "rows": rows}
    return finish("compile", args, payload, run["threads"])


def main(argv: list[str] | None = None) -> dict:
    args = parse(
        __doc__,
        argv,
        "tiny GPT, 2 ranks, aot_eager (a smoke test)",
        world_size=dict(type=int, help="default 4 (--quick: 2)"),
        steps=dict(type=int, help="measured rounds (default 16, --quick 3)"),
        warmup=(2, "rounds before them (the first compiles)"),
        first_steps=(3, "steps after the first in the fresh worlds"),
        memory_steps=(3, "profiled (+1 after); 0: none"),
        backend=dict(help="of torch.compile (default inductor, --quick aot_eager)"),
        configs=dict(nargs="+", default=CONFIGS, choices=CONFIGS),
    )
    if args.memory_steps == 1:
        args.error("--memory-steps: 0, or 2 and more (the peak is taken after the first step)")
    if args.warmup < 2:
        args.error("--warmup: at least 2 (the first step compiles, the second must not recompile)")
    world = args.world_size or (2 if args.quick else 4)
    steps = args.steps or (3 if args.quick else 16)
    first_steps = min(args.first_steps, 2) if args.quick else args.first_steps
    memory_steps = min(args.memory_steps, 2) if args.quick else args.memory_steps
    backend = args.backend or ("aot_eager" if args.quick else "inductor")
    shape = QUICK_MODEL if args.quick else MODEL
    first = (backend, first_steps, memory_steps)
    t0, log = time.perf_counter(), lambda msg: print(f"# {msg}", file=sys.stderr, flush=True)

    if not args.quick:
        _worlds(world, [(_warm, (backend,))])
        log(f"compiler warmed: {time.perf_counter() - t0:.0f} s")
    # FSDP2 compiled first, alone: if it cannot run here, it is left out of the other worlds
    alone, fsdp2_compiles, reason = {}, "FSDP2 compiled" in args.configs, None
    if fsdp2_compiles:
        try:
            alone["FSDP2 compiled"] = _worlds(world, [(_alone, (shape, "FSDP2 compiled", *first))])[0]
        except RankError as e:
            fsdp2_compiles = False
            lines = [ln for ln in e.details.strip().splitlines() if ln.strip()]
            reason = f"rank {e.rank} failed: {lines[-1] if lines else e}"
        log(f"FSDP2 compiled alone: {time.perf_counter() - t0:.0f} s")
    configs = [c for c in args.configs if c != "FSDP2 compiled" or fsdp2_compiles]
    rest = [c for c in configs if c != "FSDP2 compiled"]
    cache = None if args.quick else tempfile.mkdtemp(prefix="compile_bench_timing_")
    calls = [(_alone, (shape, c, *first)) for c in rest]
    calls.append((_time_all, (shape, configs, backend, (args.warmup, steps), cache)))
    try:  # each call in a fresh world (--quick: all in one)
        out = _worlds(world, calls, one=args.quick, log=log, t0=t0)
    finally:
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
    alone.update(zip(rest, out[:-1]))
    timed = out[-1]
    rows = summarize({c: [rk[c] for rk in timed] for c in configs}, alone, fsdp2_compiles)
    require_finite(rows, [c for c in TABLE if c != "config"])
    run = dict(
        world=world, steps=steps, warmup=args.warmup, first_steps=first_steps, memory_steps=memory_steps
    )
    run.update(backend=backend, shape=shape, quick=args.quick, fsdp2_compiles=fsdp2_compiles)
    run.update(fsdp2_compile_error=reason, threads=timed.threads, wall_s=time.perf_counter() - t0)
    return report(rows, run, args)


if __name__ == "__main__":
    main()
