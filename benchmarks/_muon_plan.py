"""What `vo.Muon` plans for a step, rebuilt from the library's public pure functions: each bucket's
layout, every matrix's home and Newton-Schulz cost, and one plan over all of them (`vo.muon_plan`:
owners of whole matrices, groups of split ones), owners traded toward homes as `vo.Muon` does.
`benchmarks/muon.py` runs it on real model shapes (part b) and checks it against `vo.Muon`'s own
`opt.units` and `opt.ns_load` (part a).

    assignment(default_buckets(shapes), world)   # {"costs", "homes", "owners", "layouts", "load", ...}
    model_buckets("llama3-8b", "block")           # the hidden matrices, one bucket per block
"""

from __future__ import annotations

import math
import time

import vescale_optim as vo
from benchmarks._optim import MUON
from benchmarks.model_shapes import MODELS, matrices

# The library's pure planning functions, called as vo.Muon calls them: imported here only, so that
# a module that moves is a one-line fix.
from vescale_optim.optim.muon import matrix_view, ns_flops  # noqa: I001
from vescale_optim.owners.balance import assign_owners, imbalance, keep_homes, rank_loads
from vescale_optim.shard.layout import bucket_indices, plan_layout

__all__ = [
    "ALIGN",
    "BUCKET_CAP",
    "assign_owners",
    "assignment",
    "default_buckets",
    "imbalance",
    "matrix_view",
]
__all__ += ["model_buckets", "ns_flops"]

BUCKET_CAP = vo.ShardingConfig().bucket_cap_numel  # the optimizers' defaults
ALIGN = vo.ShardingConfig().align


def default_buckets(shapes: list[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
    """A Muon group's buckets as `vo.Muon` forms them by default: model order, capped numel."""
    numels = [math.prod(s) for s in shapes]
    return [[shapes[i] for i in b] for b in bucket_indices(numels, [None] * len(shapes), BUCKET_CAP)]


def model_buckets(model: str, bucketing: str) -> list[list[tuple[int, ...]]]:
    """The model's hidden matrices (`matrices(hidden_only=True)`): one bucket per block, or default."""
    hidden = {name for name, _ in matrices(model, hidden_only=True)}
    blocks = [b for b in ([s for name, s in block if name in hidden] for block in MODELS[model]()) if b]
    return blocks if bucketing == "block" else default_buckets([s for b in blocks for s in b])


def assignment(buckets: list[list[tuple[int, ...]]], world: int) -> dict:
    """What `vo.Muon` computes for these buckets of one Muon group: each laid out with a granule of
    one row; a matrix's home is the rank whose shard holds all of it (None when it spans ranks), its
    cost its Newton-Schulz FLOPs; then ONE `vo.muon_plan` over every matrix with those homes, in bucket
    order, owners
    of whole matrices traded toward their homes (`keep_homes`, between equal costs), and the per-rank load
    (`opt.ns_load`). `costs`/`homes`/`owners` list one entry per piece of work: a whole matrix, or
    each member's share of a split one (home None), so `imbalance(costs, owners, world)` is the plan's."""
    dims, homes, layouts = [], [], []
    for shapes in buckets:
        layout = plan_layout([math.prod(s) for s in shapes], [s[-1] for s in shapes], world, ALIGN)
        layouts.append((layout.shard_size, tuple(layout.offsets)))
        for shape, start in zip(shapes, layout.offsets):
            count, rows, cols = matrix_view(shape)
            for k in range(count):
                lo = start + k * rows * cols
                first, last = lo // layout.shard_size, (lo + rows * cols - 1) // layout.shard_size
                homes.append(first if first == last else None)
                dims.append((rows, cols))
    t0 = time.perf_counter()
    plan = vo.muon_plan(dims, world, ns_steps=MUON["ns_steps"], homes=homes)
    seconds = time.perf_counter() - t0
    keys = [ns_flops(rows, cols, MUON["ns_steps"]) for rows, cols in dims]
    whole = keep_homes(plan.owners, keys, [() if h is None else (h,) for h in homes])
    costs, work_homes, owners = [], [], []
    for i, (rows, cols) in enumerate(dims):
        if whole[i] is not None:
            costs.append(ns_flops(rows, cols, MUON["ns_steps"]))
            work_homes.append(homes[i])
            owners.append(whole[i])
            continue
        for j, rank in enumerate(plan.groups[i]):
            costs.append(plan.splits[i].member_flops(j, MUON["ns_steps"]))  # its share
            work_homes.append(None)
            owners.append(rank)
    shares = rank_loads(costs, owners, world)  # equal-cost trades leave every rank's load as planned
    if any(abs(x - y) > 1e-9 * max(y, 1.0) for x, y in zip(shares, plan.loads)):
        raise AssertionError("the pieces of work assembled here differ from plan.loads")
    out = dict(costs=costs, homes=work_homes, owners=owners, seconds=seconds, layouts=layouts)
    return {**out, "load": list(plan.loads), "plan": plan}
