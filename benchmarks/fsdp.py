"""Fully sharded training (ZeRO-3) against FSDP2 on gloo: step time, exposed communication,
peak memory, bytes moved and copies.

Configurations, each training its own copy of the same seeded model on the same per-rank batches:
`ours Z3 AdamW|Muon` (`vo.AdamW` / `vo.Muon(muon_groups(model))` with `shard_modules=[*model.blocks,
model]`), `ours Z3 no-bwd-prefetch` (the same, `backward_prefetch=False`: at most two unit-sized
buffers in backward), `ours Z2` (no `shard_modules`: whole parameters, gradients reduce-scattered)
and `FSDP2 AdamW|Muon` (`benchmarks._optim.fsdp2`: `fully_shard` per block and the root, torch's
optimizers on the DTensors); each of ours is compared with FSDP2 with its optimizer (`x`). Models:
`gpt`, where activations weigh about as much as the sharded state, and `wide` (wide layers, short
sequences), where parameters, gradients and state dominate memory as in large-model training.

Time: all configurations in one world, one step each in turn (the order rotating): `fwd`, `bwd`,
`step`, `zero_grad` after a barrier; `train` their sum; `update` is `step` less the communication
exposed in it, `update % step` its share (a regression of the step's own work shows there). A
number is the median over steps of the slowest rank's, a ratio the median of per-step ratios.
`stand-in ms`: rank 0's profiled `vescale::stand_ins[unit]` regions in a step (parameters turned
into their stand-ins between uses and back; `% fwd` against `fwd ms`). `exposed comm`: the time
the training thread spent in collectives or waiting for them (`benchmarks._comm`); on CPU FSDP2's
are synchronous, so all exposed. `MB sent`: per rank and step, by kind (`benchmarks._comm`).
Copies: the outermost copy ops of one more step on rank 0 (`benchmarks._copies`) by path:
`collective path` (FSDP2's or our communication code, DTensor's redistribution), `grad accum`
(AccumulateGrad), `c10d` (gloo's staging), `own slice` (ours on gloo: the shard copied into its
slice before the in-place broadcast) and `compute` (context only); `copies` = the first two.

Memory, each configuration alone in a fresh world: `peak live` is the most tensor bytes alive on
a rank in a step after the first (`benchmarks._live`: ATen's allocator in the profiler, so every
buffer counts alike), `at step start` what a rank holds between steps, `peak at` the phase and
library region open at the peak; then the peak RSS over one more step (`--malloc live`: glibc
returns large blocks at once) and less the bare process's. Scaling: the `wide` model's peak live
bytes per parameter at W = 1, 2 and the main W. Sanity: each configuration's loss after training
against its FSDP2 peer's, and lowered.

Under torchrun (`--torchrun`, `benchmarks._torchrun`) every process is one rank (NCCL on
`cuda:LOCAL_RANK`, else gloo), all configurations in the same processes, no scaling runs; rank 0
writes `fsdp_torchrun[_quick].json`. On CUDA phases are timed until the device finished them,
`peak live` is `torch.cuda.max_memory_allocated()` after the first step and `at step start` the
allocated bytes after it, both less what the rank held before; `exposed comm`, `update` and the
copies are left out (the host only issues collectives and waits on streams; backward runs on
autograd's device thread, which the copy classifier would take for c10d's).

    python benchmarks/fsdp.py               # 4 ranks, both models (~7.5 min on 2 cores)
    python benchmarks/fsdp.py --quick       # tiny wide model, 2 ranks, a few steps (a smoke test)
    torchrun --nproc-per-node 8 benchmarks/fsdp.py --torchrun --steps 4   # one rank per process
"""

from __future__ import annotations

import gc
import sys
import time
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from benchmarks import _torchrun, _train  # noqa: E402
from benchmarks._comm import CommMeter  # noqa: E402
from benchmarks._copies import copies_by_path  # noqa: E402
from benchmarks._live import live_steps  # noqa: E402
from benchmarks._main import parse  # noqa: E402
from benchmarks._measure import live_malloc, reset_peak, slowest, status_kb  # noqa: E402
from benchmarks._optim import fsdp2, ours  # noqa: E402
from benchmarks._train import PHASES, against_peers, batches, device, interleave, ms, timed_row  # noqa: E402

CONFIGS = ["ours Z3 AdamW", "ours Z3 no-bwd-prefetch AdamW", "FSDP2 AdamW", "ours Z2 AdamW"]
CONFIGS += [c.replace("AdamW", "Muon") for c in CONFIGS]
SCALING = ["ours Z3 AdamW", "FSDP2 AdamW"]
MODELS = {
    "gpt": dict(vocab=8192, d_model=256, n_layers=6, n_heads=8, seq_len=128, batch=2, seq=128),
    "wide": dict(vocab=2048, d_model=768, n_layers=4, n_heads=12, seq_len=16, batch=1, seq=16),
}
QUICK = {
    "gpt": dict(vocab=512, d_model=64, n_layers=2, n_heads=4, seq_len=32, batch=2, seq=32),
    "wide": dict(vocab=256, d_model=128, n_layers=2, n_heads=4, seq_len=8, batch=1, seq=8),
}
PRELOAD = ["benchmarks.fsdp"]  # besides benchmarks._gpt.PEERS
# row keys with no meaning there
NOT_ON_CUDA = ["_update", "update ms", "update % step", "exposed comm ms", "exposed/phase ms", "copies"]
NOT_ON_CUDA += ["own slice copies", "c10d copies", "compute copies", "copy events"]
# innermost frames of ours that are the optimizers' math, not communication (kernels/packed.py,
# the 8-bit wire format, is communication)
MATH_CODE = ("optim/", "kernels/newton_schulz.py", "kernels/quant.py")
COLLECTIVE_CODE = ("vescale::", "vescale_optim.sync_grads", "vescale_optim.gather_params", "FSDP::", "fsdp::")
COLLECTIVE_CODE += ("vescale_optim/shard/collectives.py", "vescale_optim/units/", "torch/distributed/fsdp/")
COLLECTIVE_CODE += tuple(f"torch/distributed/{m}" for m in ("tensor/_redistribute", "tensor/placement_types"))
COLLECTIVE_CODE += ("torch/distributed/tensor/_collective_utils", "torch/distributed/_functional_collectives")


def peer(config: str) -> str:
    return "FSDP2 " + config.split()[-1]


def _stand_in_seconds(rank: int, tr: Trainer, x, y) -> float | None:
    """Rank 0: one step of `tr` under the profiler (CPU events, no stacks), the seconds inside
    `vescale::stand_ins[...]`: the units turning their parameters into stand-ins between uses
    and back (host work on any device)."""
    if rank != 0:
        tr.step(x, y, record=False)
        return None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        tr.step(x, y, record=False)
    return sum(e.cpu_time_total for e in prof.events() if e.name.startswith("vescale::stand_ins[")) / 1e6


class Trainer(_train.Trainer):
    """One configuration of this benchmark (see the module's docstring)."""

    def optimizer(self, model: torch.nn.Module):
        family = self.config.split()[-1]
        if not self.config.startswith("ours"):
            return fsdp2(model, family)
        sharding = {"shard_modules": [*model.blocks, model]} if " Z3 " in self.config else {}
        if "no-bwd-prefetch" in self.config:
            sharding["backward_prefetch"] = False
        return ours(model, family, **sharding)

    def comm_result(self) -> dict:
        """Per phase, the seconds exposed in each recorded step, and the calls and bytes of the last."""
        total = {"calls": Counter(), "sent": Counter()}
        for c in (self.comm[-1] if self.comm else {}).values():  # the last recorded step
            total["calls"].update(c["calls"])
            total["sent"].update(c["sent"])
        exposed = {k: [c[k]["exposed_s"] for c in self.comm] for k in PHASES}
        return {"exposed_s": exposed, "comm": {k: dict(v) for k, v in total.items()} if self.comm else {}}


def _classify(event, context: list[str]) -> str:
    text = " | ".join(context)
    if "vescale::unshard[" in text:
        return "own slice"
    ours = [c.split("vescale_optim/", 1)[1] for c in context if "vescale_optim/" in c and ".py(" in c]
    if ours and ours[0].startswith(MATH_CODE):  # the optimizers' math, even where the runtime calls it
        return "compute"
    if any(m in text for m in COLLECTIVE_CODE):
        return "collective path"
    return "grad accum" if "AccumulateGrad" in text else "compute"


def _count_copies(rank: int, tr: Trainer, x, y) -> dict | None:
    """One step of `tr`, under the profiler on rank 0: its copies by path (CPU only: see the docstring)."""
    if rank != 0 or device().type == "cuda":
        tr.step(x, y, record=False)
        return None
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True)
    with prof, record_function("bench::train"):
        tr.step(x, y, record=False)
    return copies_by_path(prof, "bench::train", _classify)


def _time_all(rank: int, world: int, models: dict, configs: list[str], warmup: int, steps: int) -> dict:
    """Per model: every configuration in this world, interleaved step by step."""
    meter = CommMeter().install()
    out = {}
    for name, shape in models.items():
        pool = batches(shape, rank, world)
        trainers = [Trainer(c, shape, meter) for c in configs]
        interleave(trainers, pool, warmup, steps)
        copies = {tr.config: _count_copies(rank, tr, *pool[0]) for tr in trainers}
        stand_ins = {tr.config: _stand_in_seconds(rank, tr, *pool[0]) for tr in trainers}
        out[name] = {}
        for tr in trainers:
            more = dict(copies=copies[tr.config], stand_ins_s=stand_ins[tr.config], **tr.comm_result())
            out[name][tr.config] = tr.result(*pool[0], **more)
        del trainers
        gc.collect()
    return out


def _memory(rank: int, world: int, jobs: list[tuple[str, dict, str]], steps: int, live: bool) -> list[dict]:
    """Each (model, shape, config) in turn: live tensor bytes over `steps` profiled steps (+1),
    then peak RSS over one more without the profiler (see the module's docstring); on CUDA the
    allocator's peak (`_cuda_memory`)."""
    if device().type == "cuda":
        return [_cuda_memory(rank, world, job, steps) for job in jobs]
    tuned = live_malloc() if live else False
    results = []
    for model, shape, config in jobs:
        gc.collect()
        base_kb = status_kb("VmRSS")
        pool = batches(shape, rank, world)
        tr, trace = live_steps(lambda: Trainer(config, shape), pool, steps)  # noqa: B023
        stats = tr.opt.memory_stats() if hasattr(tr.opt, "memory_stats") else None
        gc.collect()
        reset = reset_peak()
        tr.step(*pool[(steps + 1) % 2])
        result = {
            "model": model,
            "config": config,
            "params": tr.params,
            **trace.summary(),
            "memory_stats": stats,
        }
        result.update(
            rss_base_kb=base_kb, rss_peak_kb=status_kb("VmHWM"), peak_reset=reset, live_malloc=tuned
        )
        results.append(result)
        del tr, trace
        gc.collect()
    return results


def _cuda_memory(rank: int, world: int, job: tuple[str, dict, str], steps: int) -> dict:
    """CUDA: the caching allocator's peak over `steps - 1` steps after the first (the peak reset
    after it), and what is allocated after the first, less what the rank held before building it."""
    model, shape, config = job
    gc.collect()
    torch.cuda.empty_cache()
    pool = batches(shape, rank, world)
    base = torch.cuda.memory_allocated()
    tr = Trainer(config, shape)
    tr.step(*pool[0])
    start = torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    for s in range(1, steps):
        tr.step(*pool[s % 2])
    result = {"model": model, "config": config, "params": tr.params, "live_start": start}
    result["live_peak"] = torch.cuda.max_memory_allocated() - base
    result["memory_stats"] = tr.opt.memory_stats() if hasattr(tr.opt, "memory_stats") else None
    result["source"] = "torch.cuda.max_memory_allocated"
    del tr
    gc.collect()
    return result


def _row(model: str, config: str, res: list[dict], mem: list[dict] | None) -> dict:
    """One configuration's row from every rank's timing (and memory) results."""
    exposed = {k: slowest([r["exposed_s"][k] for r in res]) for k in PHASES}
    r0, copies = res[0], res[0]["copies"] or {}
    sent = r0["comm"].get("sent", {})
    row = {"model": model, **timed_row(config, res)}
    row["_update"] = slowest(
        [[t - e for t, e in zip(r["times_s"]["step"], r["exposed_s"]["step"])] for r in res]
    )
    row["update ms"] = ms(row["_update"])
    row["exposed comm ms"] = ms([sum(t) for t in zip(*exposed.values())])
    row["exposed/phase ms"] = {k: ms(v) for k, v in exposed.items()}
    row.update(
        {"MB sent": sum(sent.values()) / 2**20, "MB sent by kind": {k: v / 2**20 for k, v in sent.items()}}
    )
    row["calls"] = r0["comm"].get("calls", {})
    row["copies"] = sum(copies.get(p, {}).get("copies", 0) for p in ("collective path", "grad accum"))
    row.update({f"{p} copies": copies.get(p, {}).get("copies", 0) for p in ("own slice", "c10d", "compute")})
    row["copy events"] = copies
    # the guard on the step's own work: what share of opt.step() is the update (not communication)
    row["update % step"] = 100 * row["update ms"] / row["step ms"] if row["step ms"] else 0.0
    row["stand-in ms"] = 1e3 * (r0.get("stand_ins_s") or 0.0)  # rank 0's profiled step (fwd and bwd)
    row["stand-in % fwd"] = 100 * row["stand-in ms"] / row["fwd ms"] if row["fwd ms"] else 0.0
    if r0.get("device") == "cuda":  # see the docstring: no exposed comm, update nor copies there
        for k in NOT_ON_CUDA:
            del row[k]
    if mem and "source" in mem[0]:  # CUDA: the allocator's peak; no place nor RSS
        peak, start = (max(m[k] for m in mem) / 2**20 for k in ("live_peak", "live_start"))
        row.update({"peak live MB": peak, "at step start MB": start, "memory": mem})
    elif mem:
        top = max(mem, key=lambda m: m["live_peak"])
        row["peak live MB"] = top["live_peak"] / 2**20
        row["at step start MB"] = max(m["live_start"] for m in mem) / 2**20
        row.update({"peak at": " > ".join(top["live_where"][1:]), "peak by": top["live_by"]})
        row["peak RSS MB"] = max(m["rss_peak_kb"] for m in mem) / 1024
        row["RSS-base MB"] = max(m["rss_peak_kb"] - m["rss_base_kb"] for m in mem) / 1024
        row["memory"] = mem
    return row


def summarize(model: str, timed: dict[str, list[dict]], memory: dict[str, list[dict]]) -> list[dict]:
    """Table rows for one model, with ratios against each configuration's FSDP2 peer."""
    rows = {c: _row(model, c, res, memory.get(c)) for c, res in timed.items()}
    for row in rows.values():
        base = rows.get(peer(row["config"]))
        for k in ("peak live MB", "peak RSS MB"):
            if base is not None and row.get(k) and base.get(k):
                row[f"{k.rsplit(' ', 1)[0]} x"] = row[k] / base[k]
    keys = ["train", "step", "update"] if all("_update" in r for r in rows.values()) else ["train", "step"]
    return against_peers(rows, peer, keys)


def main(argv: list[str] | None = None) -> dict:
    from benchmarks._fsdp_report import report

    args = parse(
        __doc__,
        argv,
        "tiny wide model, 2 ranks, one world per run kind",
        world_size=dict(type=int, help="default 4 (--quick: 2; torchrun's)"),
        steps=dict(type=int, help="measured steps (default 5, --quick 2)"),
        warmup=1,
        memory_steps=(2, "profiled (+1 after), 1 for RSS; 0: none"),
        malloc=dict(choices=["live", "default"], default="live"),
        models=dict(nargs="+", choices=list(MODELS), help="default: both (--quick: wide)"),
        configs=dict(nargs="+", default=CONFIGS, choices=CONFIGS),
        no_scaling=(False, "skip the W = 1, 2 memory runs"),
        torchrun=(False, "a rank per torchrun process (see the docstring)"),
    )
    # under torchrun this process is one rank; the world is torchrun's, and cannot be rebuilt per run
    world, ranks, where = _torchrun.ranks(args.torchrun, args.world_size, 2 if args.quick else 4)
    args.no_scaling |= args.torchrun
    steps = args.steps or (2 if args.quick else 5)
    warmup = min(args.warmup, 1) if args.quick else args.warmup
    memory_steps = min(args.memory_steps, 2) if args.quick else args.memory_steps
    if memory_steps == 1:
        args.error("--memory-steps: 0, or 2 and more (the peak is taken after the first step)")
    models = args.models or (["wide"] if args.quick else list(MODELS))
    shapes = {m: (QUICK if args.quick else MODELS)[m] for m in models}
    t0, first = time.perf_counter(), _torchrun.is_first()
    log = lambda msg: first and print(f"# {msg}", file=sys.stderr, flush=True)  # noqa: E731

    timed = ranks(_time_all, world, shapes, args.configs, warmup, steps, preload=PRELOAD)
    log(f"timing: {time.perf_counter() - t0:.0f} s")

    def measure(w: int, jobs: list[tuple[str, dict, str]]) -> list[dict]:
        # fresh world per configuration (RSS is per process); --quick runs them all in one
        out = []
        for b in [jobs] if args.quick or args.torchrun else [[j] for j in jobs]:
            per_rank = ranks(_memory, w, b, memory_steps, args.malloc == "live", preload=PRELOAD)
            out += [[r[i] for r in per_rank] for i in range(len(b))]
            log(f"memory W={w} {[j[2] for j in b]}: {time.perf_counter() - t0:.0f} s")
        return out

    jobs = [(m, shapes[m], c) for m in shapes for c in args.configs] if memory_steps else []
    memory = dict(zip([(m, c) for m, _, c in jobs], measure(world, jobs)))
    if _torchrun.quiet(args.torchrun):
        return {}
    rows = []
    for m in shapes:
        mem = {c: memory[(m, c)] for c in args.configs if (m, c) in memory}
        rows += summarize(m, {c: [rk[m][c] for rk in timed] for c in args.configs}, mem)
    scaling = []
    if "wide" in shapes and memory_steps and not args.no_scaling:
        configs = [c for c in SCALING if c in args.configs]
        for w in sorted({1, 2} - {world}):
            scaling += [(w, res) for res in measure(w, [("wide", shapes["wide"], c) for c in configs])]
        scaling += [(world, memory[("wide", c)]) for c in configs]
    malloc = args.malloc if where.get("device", "cpu") == "cpu" else None
    run = dict(
        world=world, steps=steps, warmup=warmup, memory_steps=memory_steps, malloc=malloc, shapes=shapes
    )
    run.update(quick=args.quick, threads=timed.threads, wall_s=time.perf_counter() - t0, **where)
    return report(rows, scaling, run)


if __name__ == "__main__":
    main()
