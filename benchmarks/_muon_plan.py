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
from vescale_optim.optim.muon import ns_flops  # noqa: I001
from vescale_optim.shard.layout import bucket_indices, plan_layout
from vescale_optim.units.owners import assign_owners, imbalance, keep_homes, rank_loads

__all__ = ["ALIGN", "BUCKET_CAP", "assign_owners", "assignment", "default_buckets", "exchange_seconds",
           "imbalance", "matrix_view", "member_flops", "model_buckets", "ns_flops"]  # fmt: skip

BUCKET_CAP = vo.ShardingConfig().bucket_cap_numel  # the optimizers' defaults
ALIGN = vo.ShardingConfig().align
BYTES = 2  # bf16: what a split matrix's all-gathers carry


# A split matrix's share of the work and its exchanges, from the plan's public fields (`plan.splits[i]`:
# `shape`, `rows` of M per member, `x_rows` of X per member): the library's count, written out here;
# `assignment` checks the shares against `plan.loads`, `benchmarks/scale.py` the seconds against
# `plan.times`, so a count that drifts from the library's fails the benchmark.


def member_flops(split, index: int, steps: int) -> int:
    """Newton–Schulz FLOPs member `index` of a split runs: its rows of `X Xᵀ`, `A A` and `B X` each
    step (a tall matrix's last `B X` by its columns instead); the members' sum is `ns_flops`."""
    m, n = split.shape
    a, b, x = min(m, n), max(m, n), split.x_rows[index]
    if m <= n:
        return steps * (4 * x * a * b + 2 * x * a * a)
    last = 2 * a * a * split.rows[index]  # B X[:, its columns]
    return steps * (2 * x * a * b + 2 * x * a * a) + (steps - 1) * 2 * x * a * b + last


def exchange_seconds(split, steps: int, across: bool, cost: vo.CostModel) -> float:
    """Seconds a split's all-gathers take in `cost` (ring, blocks padded to the widest): M's row
    blocks, then each step X's (but the first) and A's, and B's in a tall matrix's last step."""
    m, n = split.shape
    a, b = min(m, n), max(m, n)
    gathers = [(split.rows, n)]
    for k in range(steps):
        if k:
            gathers.append((split.x_rows, b))
        gathers.append((split.x_rows, a))
        if m > n and k == steps - 1:
            gathers.append((split.x_rows, a))
    return sum(cost.all_gather(len(split.rows), max(rows) * cols * BYTES, across) for rows, cols in gathers)


def matrix_view(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(count, rows, cols) as Muon sees a parameter: a 2-D weight is one matrix, a 3-D one a stack
    of `count`, a 4-D convolution weight one `[out, in*kh*kw]` matrix."""
    if len(shape) == 3:
        return shape[0], shape[1], shape[2]
    return 1, shape[0], math.prod(shape[1:])


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
            costs.append(member_flops(plan.splits[i], j, MUON["ns_steps"]))
            work_homes.append(None)
            owners.append(rank)
    shares = rank_loads(costs, owners, world)  # equal-cost trades leave every rank's load as planned
    if any(abs(x - y) > 1e-9 * max(y, 1.0) for x, y in zip(shares, plan.loads)):
        raise AssertionError("split shares counted here differ from plan.loads: member_flops drifted")
    return dict(costs=costs, homes=work_homes, owners=owners, seconds=seconds, layouts=layouts,
                load=list(plan.loads), plan=plan)  # fmt: skip
