"""Sharded training against FSDP2 and torch's other set-ups on gloo, in five sections: step time,
exposed communication, bytes moved, copies, peak memory, Newton–Schulz work per rank, compiling, TP.

Each configuration trains its own copy of the same seeded GPT on the same per-rank batches; a
configuration is `WHO [HOW] FAMILY` (`benchmarks._fsdp_run`): ours (`vo.AdamW` / `vo.Muon(
muon_groups(model))`) or a peer of `benchmarks._optim.peer` with torch's optimizers; `x` is the
median of per-step ratios to FSDP2 with the same optimizer (on a mesh: FSDP2's HSDP).

- `zero3`: `ours Z3` (`shard_modules=[*model.blocks, model]`; `no-bwd-prefetch`: at most two
  unit-sized buffers in backward), `ours Z2` (no units: whole parameters, gradients
  reduce-scattered) and `FSDP2` (`fully_shard` per block and the root) on `gpt`, where activations
  weigh about as much as the sharded state, and `wide` (wide layers, short sequences), where
  parameters, gradients and state dominate memory.
- `peers`: `ours Z2` against FSDP2 (`reshard=False` too), ZeRO (DDP + `ZeroRedundancyOptimizer`) and
  DDP, AdamW and Muon (`torch.optim.Muon` on the hidden matrices), and Muon's variants
  (`polar_express`, `normuon`) on a 22 M GPT: what one `opt.step()` contains differs (its table
  says what), so the train step is the fair end-to-end number. Inside torch's wrappers, against
  torch's optimizer under the same one: `ours DDP` (ours reads DDP's averaged `.grad`, updates its
  `1/W` and all-gathers the parameters: ZeRO-1) against `DDP`, and `ours FSDP2 Muon` (each matrix
  whole on one owner, two all-to-alls) against `FSDP2 full_tensor Muon` (torchtitan's: every rank
  keeps each matrix whole, all-gathers its gradient and orthogonalizes every matrix). `opt state x`:
  the optimizer state on the busiest rank over the peer's (`mean`: the mean over ranks'; goal: 1.05/W
  of DDP's, which every rank holds whole; at most the full_tensor peer's, which shards AdamW's state
  too but keeps Muon's whole); `NS goal`:
  the FLOPs of the ceil(n/W) largest of the n matrices, the most a rank carries when whole matrices
  are spread evenly by count and it drew the largest; `max|Δ| 1st` / `max|Δ|`: the largest
  difference of a parameter after the first step and after training against DDP's (ours over FSDP2:
  the full_tensor peer's), `Δ/moved` the latter over the most training moved one of those (the first
  step's fp32 rounding grows in training, so the parameters are held after one step, the loss
  after training).
- `hsdp`: ours on a (replicate, shard) mesh of 2x2 and 1x4 against FSDP2's HSDP on 2x2, 4 ranks.
- `compile`: `ours Z3` and FSDP2 on `gpt`, eager and with every block compiled (`block.compile()`
  after the units or `fully_shard`: the hooks run eagerly, outside the graphs; FSDP2's are
  dynamo-disabled). The measured steps run under `set_stance("fail_on_recompile")` after two or more
  warm-up steps (the first compiles); `x eager` is against the same library eager, `x` against FSDP2
  in the same mode (FSDP2 eager, saying why, where FSDP2 + compile does not run here). Each
  configuration's memory world first trains it from an empty inductor cache (after a world that
  compiled a small function once, so reading the compiler from disk lands on none of them):
  `first step s` the slowest rank's first train step, `compile s` that less its median later step.
- `tp`: data parallelism over torch's TP plan, dp2 x tp2 on 4 ranks: `TPBlock`s (attention, SwiGLU,
  RMSNorm; ColwiseParallel wq/wk/wv/w1/w3, RowwiseParallel wo/w2) and a final norm, the same batches
  per dp rank. `ours AdamW` / `ours Muon` (`mesh=world["dp"]`, a unit per block; Muon orthogonalizes
  each full matrix once in the world) against `FSDP2 AdamW` (FSDP2 2-D) and `FSDP2 full_tensor Muon`
  (FSDP2 2-D, `full_tensor()` of each matrix gradient, `torch.optim.Muon` on full copies on every
  rank). `TP alone AdamW` (each dp rank steps its own gradient) is the floor both AdamW ones stand
  on: forward, backward and the TP all-reduces; what data parallelism adds is the train time above
  it (`the data-parallel part`, printed after the table). `NS GF max`: the busiest rank's.

Time: every configuration of a section in one world, one step each in turn (the order rotating):
`fwd`, `bwd`, `step`, `zero_grad` after a barrier, `train` their sum; the median over steps of the
slowest rank's. `update` is `step` less the communication exposed in it, `update % step` its share.
`exposed comm`: the training thread's time in collectives or waiting for them (`benchmarks._comm`; on
CPU FSDP2's are synchronous, so all exposed). `MB sent`: per rank and step, by kind; `MB inside` /
`across` a shard group (or `mixed`: a group spanning both); `step MB`: inside opt.step(); `stats MB`
ours' own count (`step_stats["bytes_sent"]`).

After them, one profiled step each: `stand-in ms` rank 0's `vescale::stand_ins[unit]` (parameters
turned into their stand-ins and back; `% fwd` against `fwd ms`); `win ms` the slowest rank's seconds
in the libraries' profiler windows: `RS` (ours `sync_grads`, what is left of the reduce-scatter
begun in backward; FSDP2's `post_backward_reduce`), `update`, `AG` (ours `gather_params`, FSDP2's
`all_gather`), `NS`, `moves` (Muon's), `Muon` / `AdamW` (the peers' two optimizers); Newton–Schulz
GFLOP per rank (`measured`: the profiler's count of the matrix products in opt.step(); `stats`:
`step_stats["ns_flops"]`) against the model's total, every matrix once. `zero3` counts copies in
one more step on rank 0 (`benchmarks._copies`), by path: `collective path` (FSDP2's or our
communication code, DTensor's redistribution), `grad accum`, `c10d` (gloo's staging), `own slice`
(ours on gloo: the shard copied into its slice) and `compute`; `copies` = the first two. `Δ/update`
(Muon): `max|Δ| 1st` of the Muon group over the largest change DDP's first step made.

Memory (all but `hsdp`), each configuration alone in a fresh world: `peak live` the most tensor
bytes alive on a rank in a step after the first (`benchmarks._live`), `at step start` what a rank
holds between steps, `peak at` where; then the peak RSS over one more step (`--malloc live`: glibc
returns large blocks at once) and less the bare process's; `opt state MB` the optimizer state a rank
holds. Scaling: the `wide` model's peak live bytes per parameter at W = 1, 2 and the main W. Sanity:
each configuration lowers the loss and ends within `LOSS_TOL` of its peer's (compiled: 1e-3).

Under torchrun (`--torchrun`, `benchmarks._torchrun`) every process is one rank (NCCL on
`cuda:LOCAL_RANK`, else gloo), all configurations in the same processes, `hsdp` on 2x(W/2) and 1xW
(`--configs` takes the 4-rank names), no scaling runs; rank 0 writes `fsdp[_SECTIONS]_torchrun.json`.
On CUDA phases are timed until the device finished them, `peak live` is the allocator's peak after
the first step, less what the rank held before; `exposed comm`, `update`, the windows, the copies
and the measured FLOPs are left out (the host only issues work; backward runs on autograd's device
thread, which the copy classifier would take for c10d's; ours orthogonalize in Triton kernels).

    python benchmarks/fsdp.py                        # every section, 4 ranks (~20 min on 2 cores)
    python benchmarks/fsdp.py --quick                # tiny models, a few steps (a smoke test)
    python benchmarks/fsdp.py --sections hsdp        # one section
    torchrun --nproc-per-node 8 benchmarks/fsdp.py --torchrun --sections zero3 --steps 4
"""

from __future__ import annotations

import os
import shutil
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

from benchmarks import _torchrun  # noqa: E402
from benchmarks._fsdp_rows import summarize  # noqa: E402
from benchmarks._fsdp_run import memory, time_all, warm_compiler  # noqa: E402
from benchmarks._main import parse  # noqa: E402

ZERO3 = ["ours Z3 AdamW", "ours Z3 no-bwd-prefetch AdamW", "FSDP2 AdamW", "ours Z2 AdamW"]
ZERO3 += [c.replace("AdamW", "Muon") for c in ZERO3]
PEERS = [f"{who} {family}" for family in ("AdamW", "Muon") for who in ("ours Z2", "FSDP2", "ZeRO", "DDP")]
PEERS += ["FSDP2 reshard=False AdamW", "ours Z2 polar_express Muon", "ours Z2 normuon Muon"]
PEERS += ["ours DDP AdamW", "ours DDP Muon", "ours FSDP2 Muon", "FSDP2 full_tensor Muon"]
HSDP = [f"{who} {family}" for family in ("AdamW", "Muon") for who in ("ours 2x2", "ours 1x4", "FSDP2 2x2")]
COMPILE = ["ours Z3 AdamW", "ours Z3 compiled AdamW", "FSDP2 AdamW", "FSDP2 compiled AdamW"]
TP = ["ours AdamW", "FSDP2 AdamW", "ours Muon", "FSDP2 full_tensor Muon", "TP alone AdamW"]
CONFIGS = list(dict.fromkeys(ZERO3 + PEERS + HSDP + COMPILE + TP))
SCALING = ["ours Z3 AdamW", "FSDP2 AdamW"]
MODELS = {  # zero3's (gpt: compile's too; benchmarks/qcomm.py trains both)
    "gpt": dict(vocab=8192, d_model=256, n_layers=6, n_heads=8, seq_len=128, batch=2, seq=128),
    "wide": dict(vocab=2048, d_model=768, n_layers=4, n_heads=12, seq_len=16, batch=1, seq=16),
}
QUICK = {
    "gpt": dict(vocab=512, d_model=64, n_layers=2, n_heads=4, seq_len=32, batch=2, seq=32),
    "wide": dict(vocab=256, d_model=128, n_layers=2, n_heads=4, seq_len=8, batch=1, seq=8),
}
# peers: bf16 matmuls run at ~3 GFLOP/s per core on CPUs without AVX512-BF16; the small hidden size
# keeps DDP's replicated Newton-Schulz (12 GFLOP per rank and step) within minutes
SHAPES = {
    **MODELS,
    "peers": dict(vocab=50304, d_model=192, n_layers=6, n_heads=6, seq_len=128, batch=2, seq=64),
}
SHAPES["compile"] = MODELS["gpt"]
SHAPES["tp"] = dict(dim=256, layers=4, head=32, batch=4, seq=64, tp=2)
SHAPES["hsdp"] = dict(vocab=4096, d_model=256, n_layers=6, n_heads=8, seq_len=64, batch=2, seq=64)
QUICK_SHAPES = {
    **QUICK,
    "peers": dict(vocab=2048, d_model=64, n_layers=2, n_heads=4, seq_len=32, batch=2, seq=32),
}
QUICK_SHAPES["compile"] = QUICK["gpt"]
QUICK_SHAPES["tp"] = dict(dim=32, layers=2, head=8, batch=2, seq=8, tp=2)
QUICK_SHAPES["hsdp"] = dict(vocab=320, d_model=64, n_layers=2, n_heads=4, seq_len=16, batch=1, seq=16)
SECTIONS = {  # models (--quick: the last only), configurations, copies counted, first step held to DDP's
    "zero3": dict(models=["gpt", "wide"], configs=ZERO3, copies=True, first=False),
    "peers": dict(models=["peers"], configs=PEERS, copies=False, first=True),
    "hsdp": dict(models=["hsdp"], configs=HSDP, copies=False, first=False),
    "compile": dict(models=["compile"], configs=COMPILE, copies=False, first=False),
    "tp": dict(models=["tp"], configs=TP, copies=False, first=False),
}
FIXED_WORLD = {"hsdp": 4, "tp": 4}  # 2x2 and 1x4; dp2 x tp2
PRELOAD = ["benchmarks.fsdp", "benchmarks._fsdp_run"]  # besides benchmarks._gpt.PEERS


def named(config: str, world: int) -> str:
    """An hsdp configuration (named at 4 ranks) as named on the meshes of `world`: 2x2 is 2 x W/2."""
    mesh = {"2x2": f"2x{world // 2}", "1x4": f"1x{world}"}
    return " ".join(mesh.get(w, w) for w in config.split())


def _runs(args, sections: list[str], worlds: dict[str, int], cache: str | None) -> dict[int, list[dict]]:
    """The runs of `sections` by world size: each a model and the section's configurations."""
    runs: dict[int, list[dict]] = {}
    for name in sections:
        section, w = SECTIONS[name], worlds[name]
        models = section["models"][-1:] if args.quick else section["models"]
        models = [m for m in models if name != "zero3" or not args.models or m in args.models]
        configs = [named(c, w) for c in section["configs"] if c in (args.configs or CONFIGS)]
        shapes = QUICK_SHAPES if args.quick else SHAPES
        for m in models:
            run = dict(name=m, section=name, shape=shapes[m], configs=configs)
            runs.setdefault(w, []).append({**run, "copies": section["copies"], "first": section["first"]})
            if name == "compile":
                runs[w][-1].update(backend=args.backend, cache=cache, first_steps=args.first_steps)
    return runs


def _compile_runs(args, runs: list[dict], measure) -> dict:
    """Before the compile run's timing: the compiler warmed (but with --quick), then FSDP2 compiled
    alone: if it cannot run here, it is left out (and `ours compiled` held to FSDP2 eager)."""
    from vescale_optim.local_world import RankError

    run = next(r for r in runs if r["section"] == "compile")
    if not args.quick:
        measure.ranks(warm_compiler, measure.world, run["backend"], preload=PRELOAD)
    status, config = {"fsdp2_compiles": False, "fsdp2_compile_error": None}, "FSDP2 compiled AdamW"
    if config in run["configs"] and measure.steps:
        try:
            measure.mem[(run["name"], config)] = measure(measure.world, [measure.job(run, config)])[0]
            status["fsdp2_compiles"] = True
        except RankError as e:
            lines = [ln for ln in e.details.strip().splitlines() if ln.strip()]
            status["fsdp2_compile_error"] = f"rank {e.rank} failed: {lines[-1] if lines else e}"
            run["configs"].remove(config)
    return {**status, "backend": run["backend"]}


class _Memory:
    """The memory runs: each configuration alone in a fresh world (RSS is per process), with
    --quick or under torchrun all in one; `mem` by (run, configuration)."""

    def __init__(self, args, ranks, world: int, steps: int, log):
        self.args, self.ranks, self.world, self.steps, self.log, self.mem = args, ranks, world, steps, log, {}

    @staticmethod
    def job(run: dict, config: str) -> tuple:
        compiled = {"backend": run["backend"], "steps": run["first_steps"]} if run.get("backend") else None
        return run["name"], run["shape"], config, compiled

    def __call__(self, w: int, jobs: list[tuple]) -> list[list[dict]]:
        out, live = [], self.args.malloc == "live"
        for b in [jobs] if self.args.quick or self.args.torchrun else [[j] for j in jobs]:
            per_rank = self.ranks(memory, w, b, self.steps, live, preload=PRELOAD)
            out += [[r[i] for r in per_rank] for i in range(len(b))]
            self.log(f"memory W={w} {[j[2] for j in b]}")
        return out


def _measure(args, runs, world: int, ranks, steps: tuple[int, int, int], log) -> tuple[dict, _Memory, dict]:
    """Every run's timing and memory (`steps`: warm-up, measured, memory), the compile section's
    status first."""
    measure, status = _Memory(args, ranks, world, steps[2], log), {}
    if any(r["section"] == "compile" for r in runs.get(world, [])):
        status = _compile_runs(args, runs[world], measure)
    timed = {w: ranks(time_all, w, rs, *steps[:2], preload=PRELOAD) for w, rs in runs.items()}
    log("timing")
    for w, rs in runs.items():
        held = [r for r in rs if r["section"] != "hsdp"] if steps[2] else []
        jobs = [measure.job(r, c) for r in held for c in r["configs"] if (r["name"], c) not in measure.mem]
        measure.mem.update(zip([(j[0], j[2]) for j in jobs], measure(w, jobs)))
    return timed, measure, status


def _scaling(args, runs: dict, world: int, measure: _Memory) -> list:
    """The wide model's memory at W = 1, 2 and the main W."""
    wide = next((r for r in runs.get(world, []) if r["name"] == "wide"), None)
    if not wide or not measure.steps or args.no_scaling:
        return []
    configs, out = [c for c in SCALING if c in wide["configs"]], []
    for w in sorted({1, 2} - {world}):
        out += [(w, res) for res in measure(w, [measure.job(wide, c) for c in configs])]
    return out + [(world, measure.mem[("wide", c)]) for c in configs]


def main(argv: list[str] | None = None) -> dict:
    from benchmarks._fsdp_report import report

    args = parse(
        __doc__,
        argv,
        "tiny models, 2 ranks (hsdp: 4), one world per run kind",
        world_size=dict(type=int, help="default 4 (--quick: 2; torchrun's)"),
        steps=dict(type=int, help="measured steps (default 5, --quick 2)"),
        warmup=1,
        memory_steps=(2, "profiled (+1 after), 1 for RSS; 0: none"),
        malloc=dict(choices=["live", "default"], default="live"),
        sections=dict(nargs="+", choices=list(SECTIONS), help="default: all"),
        models=dict(nargs="+", choices=list(MODELS), help="zero3's (default: both; --quick: wide)"),
        configs=dict(nargs="+", choices=CONFIGS, help="default: every section's"),
        backend=dict(help="compile: torch.compile's (default inductor, --quick aot_eager)"),
        first_steps=(3, "compile: steps after the first in the fresh worlds"),
        no_scaling=(False, "skip the W = 1, 2 memory runs"),
        torchrun=(False, "a rank per torchrun process (see the docstring)"),
    )
    sections = args.sections or list(SECTIONS)
    # under torchrun this process is one rank; the world is torchrun's, and cannot be rebuilt per run
    world, ranks, where = _torchrun.ranks(args.torchrun, args.world_size, 2 if args.quick else 4)
    worlds = {s: world if args.torchrun else FIXED_WORLD.get(s, world) for s in SECTIONS}
    if "hsdp" in sections and worlds["hsdp"] % 2:
        args.error(f"hsdp: 2 replicas need an even number of ranks, not {worlds['hsdp']}")
    args.no_scaling |= args.torchrun
    args.backend = args.backend or ("aot_eager" if args.quick else "inductor")
    steps, warmup = args.steps or (2 if args.quick else 5), min(args.warmup, 1) if args.quick else args.warmup
    memory_steps = min(args.memory_steps, 2) if args.quick else args.memory_steps
    args.first_steps = min(args.first_steps, 2) if args.quick else args.first_steps
    if memory_steps == 1:
        args.error("--memory-steps: 0, or 2 and more (the peak is taken after the first step)")
    t0, first = time.perf_counter(), _torchrun.is_first()
    log = lambda msg: (
        first and print(f"# {msg}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    )  # noqa: E731
    cache = None if args.quick else tempfile.mkdtemp(prefix="fsdp_bench_compile_")
    try:
        runs = _runs(args, sections, worlds, cache)
        timed, measure, status = _measure(args, runs, world, ranks, (warmup, steps, memory_steps), log)
    finally:
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
    if _torchrun.quiet(args.torchrun):
        return {}
    out = {s: {"rows": []} for s in sections}
    for w, rs in runs.items():
        for r in rs:
            timings = {c: [rk[r["name"]][c] for rk in timed[w]] for c in r["configs"]}
            mine = {c: measure.mem[(r["name"], c)] for c in r["configs"] if (r["name"], c) in measure.mem}
            rows = summarize(r["name"], r["shape"], timings, mine, w)
            out[r["section"]]["rows"] += [{"section": r["section"], **row} for row in rows]
    if "zero3" in out:
        out["zero3"]["scaling"] = _scaling(args, runs, world, measure)
    name = "fsdp" if sections == list(SECTIONS) else "_".join(["fsdp", *sections])
    malloc = args.malloc if where.get("device", "cpu") == "cpu" else None
    run = dict(name=name, world=world, worlds=worlds, hsdp_world=worlds["hsdp"], steps=steps, warmup=warmup)
    run.update(status)
    run.update(memory_steps=memory_steps, malloc=malloc, quick=args.quick)
    run["shapes"] = {r["name"]: r["shape"] for rs in runs.values() for r in rs}
    run.update(threads=next(iter(timed.values())).threads, wall_s=time.perf_counter() - t0, **where)
    return report(out, run)


if __name__ == "__main__":
    main()
