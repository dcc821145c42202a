"""What the agreement on `no_sync()` costs: the time of each backward and of a train step with
gradient accumulation, with the agreement as shipped, without it, and under torch's own check.

Each backward starts with the ranks' agreement on `no_sync()` (one small all-reduce, issued at the
backward's first event and read back before its first reduce-scatter: the one host sync in
backward), so that `no_sync()` entered on some ranks only fails on every rank instead of leaving
reductions unmatched. Per backward and per train step of `--micro` micro-batches (all but the last
under `no_sync()`), on a local gloo world: `without the agreement` (patched out on every rank, here
only), `as shipped`, and `TORCH_DISTRIBUTED_DEBUG=DETAIL` (torch's fingerprint check of every
collective). On CPU gloo's collectives are synchronous, so the agreement's latency is added whole;
docs/benchmarks.md says what a GPU pays.

    python benchmarks/sync_check.py [--world-size 4] [--layers 8] [--micro 4] [--quick]
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch.distributed as dist  # noqa: E402

import vescale_optim as vo  # noqa: E402
from benchmarks._gpt import build_gpt, launch, random_batch  # noqa: E402
from benchmarks._main import finish, parse  # noqa: E402
from benchmarks._report import table  # noqa: E402

PRELOAD = ["benchmarks.sync_check"]
MODES = ("without the agreement", "as shipped", "TORCH_DISTRIBUTED_DEBUG=DETAIL")


def _group(mode: str):
    before = dist.get_debug_level()
    if mode == MODES[2]:
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        return dist.new_group(list(range(dist.get_world_size())))
    finally:
        dist.set_debug_level(before)


@contextlib.contextmanager
def _without_agreement(mode: str):
    """The agreement on no_sync() taken out (`mode` is the first), on this rank: every rank
    runs the same mode, so the collectives still pair up."""
    from vescale_optim.units.reduction import ReductionPipeline

    shipped = ReductionPipeline.issue_agreement
    if mode == MODES[0]:
        ReductionPipeline.issue_agreement = lambda self, world: None
    try:
        yield
    finally:
        ReductionPipeline.issue_agreement = shipped


def _rank(rank: int, world: int, layers: int, width: int, micro: int, runs: int) -> list[dict]:
    rows = []
    for mode in MODES:
        group = _group(mode)
        model = build_gpt(n_layers=layers, d_model=width, vocab=512, seq_len=32)
        opt = vo.AdamW(model.parameters(), lr=1e-3, shard_modules=[*model.blocks, model], process_group=group)
        steps, quiet, reducing = [], [], []
        with _without_agreement(mode):
            for t in range(runs + 1):
                dist.barrier()
                start = time.perf_counter()
                for m in range(micro):
                    x, y = random_batch(2, 32, 512, seed=rank * 1000 + t * micro + m)
                    loss = model.loss(x, y)
                    begin = time.perf_counter()
                    with opt.no_sync() if m < micro - 1 else contextlib.nullcontext():
                        loss.backward()
                    if t:  # the first one warms up
                        (quiet if m < micro - 1 else reducing).append((time.perf_counter() - begin) * 1e3)
                opt.step()
                opt.zero_grad()
                if t:
                    steps.append((time.perf_counter() - start) * 1e3)
        row = {"check": mode, "median ms": statistics.median(steps)}
        row["backward ms (no_sync)"] = statistics.median(quiet) if quiet else None
        rows.append({**row, "backward ms (reducing)": statistics.median(reducing)})
        dist.destroy_process_group(group)
    return rows


def main(argv: list[str] | None = None) -> dict:
    sizes = dict(world_size=4, layers=8, width=256, micro=4, runs=5)
    args = parse(__doc__, argv, "2 small layers, 2 micro-batches, 2 runs", **sizes)
    sizes = (args.layers, args.width, args.micro, args.runs)
    layers, width, micro, runs = (2, 32, 2, 2) if args.quick else sizes
    per_rank = launch(_rank, args.world_size, layers, width, micro, runs, preload=PRELOAD)
    rows = []
    for i, row in enumerate(per_rank[0]):  # each column: the slowest rank's median
        slowest = {k: max(r[i][k] for r in per_rank) for k, v in row.items() if k != "check" and v}
        rows.append({**row, **slowest})
    base = rows[1]["median ms"]
    for r in rows:
        r["x as shipped"] = r["median ms"] / base
    print(f"{layers} blocks of width {width}, {micro} micro-batches per step, {args.world_size} ranks")
    print(f"(slowest rank's median of {runs}; gloo is synchronous on CPU)\n")
    print(table(rows, floatfmt=".3f"))
    payload = {"world_size": args.world_size, "layers": layers, "width": width, "micro": micro, "rows": rows}
    return finish("sync_check", args, payload, threads=per_rank.threads)


if __name__ == "__main__":
    main()
