"""What `vo.Muon` plans for a step, rebuilt from the library's public pure functions: each bucket's
layout, every matrix's home and Newton-Schulz cost, and one owner assignment over all of them.
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
from vescale_optim.units.owners import assign_owners, imbalance

__all__ = ["ALIGN", "BUCKET_CAP", "assign_owners", "assignment", "default_buckets", "imbalance",
           "matrix_view", "model_buckets", "ns_flops"]  # fmt: skip

BUCKET_CAP = vo.ShardingConfig().bucket_cap_numel  # the optimizers' defaults
ALIGN = vo.ShardingConfig().align


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
    cost its Newton-Schulz FLOPs; then ONE `assign_owners` over every matrix, in bucket order, and
    the per-rank load (`opt.ns_load`)."""
    costs, homes, layouts = [], [], []
    for shapes in buckets:
        layout = plan_layout([math.prod(s) for s in shapes], [s[-1] for s in shapes], world, ALIGN)
        layouts.append((layout.shard_size, tuple(layout.offsets)))
        for shape, start in zip(shapes, layout.offsets):
            count, rows, cols = matrix_view(shape)
            for k in range(count):
                lo = start + k * rows * cols
                first, last = lo // layout.shard_size, (lo + rows * cols - 1) // layout.shard_size
                homes.append(first if first == last else None)
                costs.append(ns_flops(rows, cols, MUON["ns_steps"]))
    t0 = time.perf_counter()
    owners = assign_owners(costs, world, homes)
    load = [0.0] * world
    for c, o in zip(costs, owners):
        load[o] += c
    return dict(costs=costs, homes=homes, owners=owners, seconds=time.perf_counter() - t0, layouts=layouts,
                load=load)  # fmt: skip
