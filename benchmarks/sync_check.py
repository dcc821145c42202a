"""What the agreement on `no_sync()` costs: a train step with gradient accumulation, as
shipped, with one more such all-reduce per backward, and under torch's own collective check.

`no_sync()` entered on some ranks only leaves the other ranks' reductions unmatched. The
step's agreement cannot see it (those ranks issued their reductions in backward, where the
collectives part ways), so each backward starts with the ranks' agreement on it: one small
all-reduce before its first reduction (`vo.NoSyncMismatchError` on every rank). That is one
collective per backward the step's agreement does not cover. Measured here, per train step
of `--micro` micro-batches (every one but the last under `no_sync()`), on a local gloo world:

- **as shipped**: the agreement in every backward;
- **+ one more per backward**: a second all-reduce of the same size in every backward, issued
  from a backward pre-hook and waited for at the step: what the agreement adds;
- **TORCH_DISTRIBUTED_DEBUG=DETAIL**: torch's check, every collective's fingerprint compared
  over a helper group first, on a group created under it.

    python benchmarks/sync_check.py [--world-size 4] [--layers 8] [--micro 4] [--quick]

On CPU gloo issues every collective synchronously: the extra all-reduce's latency is added
whole, where on a GPU it would run beside the compute.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import vescale_optim as vo  # noqa: E402
from benchmarks._gpt import build_gpt, launch, random_batch  # noqa: E402
from benchmarks._report import environment, host_line, save_json, table  # noqa: E402

PRELOAD = ["benchmarks.sync_check"]
MODES = ("as shipped", "+ one more per backward", "TORCH_DISTRIBUTED_DEBUG=DETAIL")


def _group(mode: str):
    before = dist.get_debug_level()
    if mode == MODES[2]:
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        return dist.new_group(list(range(dist.get_world_size())))
    finally:
        dist.set_debug_level(before)


def _agreement(flag: torch.Tensor, group, pending: list):
    """A backward pre-hook issuing one small all-reduce of the sync flag (its wait: `pending`)."""

    def hook(*_):
        pending.append(dist.all_reduce(flag, group=group, async_op=True))

    return hook


def _rank(rank: int, world: int, layers: int, width: int, micro: int, runs: int) -> list[dict]:
    rows = []
    for mode in MODES:
        group = _group(mode)
        model = build_gpt(n_layers=layers, d_model=width, vocab=512, seq_len=32)
        opt = vo.AdamW(model.parameters(), lr=1e-3, shard_modules=[*model.blocks, model], process_group=group)
        pending: list = []  # the per-backward agreements in flight
        if mode == MODES[1]:
            flag = torch.zeros(1, dtype=torch.int64)  # as the agreement's one word of flags
            model.blocks[-1].register_full_backward_pre_hook(_agreement(flag, group, pending))
        times = []
        for t in range(runs + 1):
            dist.barrier()
            start = time.perf_counter()
            for m in range(micro):
                x, y = random_batch(2, 32, 512, seed=rank * 1000 + t * micro + m)
                with opt.no_sync() if m < micro - 1 else contextlib.nullcontext():
                    model.loss(x, y).backward()
            for work in pending:  # the verdicts, read at the step
                work.wait()
            pending.clear()
            opt.step()
            opt.zero_grad()
            if t:  # the first one warms up
                times.append((time.perf_counter() - start) * 1e3)
        rows.append({"check": mode, "median ms": statistics.median(times)})
        dist.destroy_process_group(group)
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2 small layers, 2 micro-batches, 2 runs")
    args = ap.parse_args(argv)
    sizes = (args.layers, args.width, args.micro, args.runs)
    layers, width, micro, runs = (2, 32, 2, 2) if args.quick else sizes
    per_rank = launch(_rank, args.world_size, layers, width, micro, runs, preload=PRELOAD)
    rows = []
    for i, row in enumerate(per_rank[0]):
        slowest = max(r[i]["median ms"] for r in per_rank)
        rows.append({**row, "median ms": slowest})
    base = rows[0]["median ms"]
    for r in rows:
        r["x as shipped"] = r["median ms"] / base
    print(f"{layers} blocks of width {width}, {micro} micro-batches per step, {args.world_size} ranks "
          f"(slowest rank's median of {runs}; gloo is synchronous on CPU)\n")  # fmt: skip
    print(table(rows, floatfmt=".3f"))
    print(f"\n{host_line(per_rank.threads)}")
    payload = {"world_size": args.world_size, "layers": layers, "width": width, "micro": micro, "rows": rows,
               "env": environment(per_rank.threads)}  # fmt: skip
    path = save_json("sync_check_quick" if args.quick else "sync_check", payload)
    print(f"\nwrote {path}")
    return payload


if __name__ == "__main__":
    main()
