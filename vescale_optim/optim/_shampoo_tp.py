"""Shampoo's tiles under tensor parallelism, read from the runtime's `TensorParallel`
(`units.tp_view`): each parameter's cut, the TP group and the dp x tp world.

A matrix cut over TP on the tile grid holds other tiles of the full tensor on each TP rank
(`tp_tile_offset`: where its TP shard's tiles start in the full tensor's grid): each TP rank
plans its own over the data-parallel group (`Shampoo._plan_work`), with no TP traffic. A matrix
replicated over TP (a plain parameter, or a Replicate DTensor) holds the same tiles on every TP
rank: they are owner work over the whole dp x tp world in its `replicated` view (each tp rank a
replica of its own, `DpTpWorld.replicated`), so each is computed once in the world and its
update reaches every TP rank's copy. They are balanced after the cut tiles, over the root work
those left on each rank of the world.

`TPTiles.owned` lists every tile of the world per segment (every TP rank's cut tiles, keyed by
the full tensor's tile indices, and the shared ones) with the world rank that owns it: the full
torch state dict gathers their factors from there, keyed as in one process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..owners.balance import assign_owners, spread_homes
from ..owners.plan import OwnerPlan, SegmentMoves, WorkItem, plan_owners
from ..shard.collectives import all_gather_object
from ..units.tp_view import DpTpWorld, ParamCut, TensorParallel
from ._shampoo_math import Tile, matrix_shape
from ._shampoo_tiles import CHANNELS


def tp_tile_offset(cut: ParamCut, max_dim: int, name: str) -> tuple[int, int]:
    """`(rows, cols)`: how many whole tiles of the full matrix lie above and left of this TP
    rank's shard of a parameter cut as `cut` says (seen as `[shape[0], rest]`; `(0, 0)` for a
    parameter not sharded over TP).

    Shampoo under tensor parallelism keeps every tile of the full tensor inside one TP shard,
    so each TP rank's tiles of its local shard are the full tensor's own tiles, computed where
    they lie with no TP traffic. That holds when every shard's first row (a `Shard(0)` cut) or
    column (a cut of a later dimension) starts a tile, and its last one ends a tile or the
    matrix. The answer is the same on every rank, from the global shape and placements; a cut
    off the tile grid is a NotImplementedError naming the parameter, the block size and the
    TP shard shape."""
    if not cut.sharded or matrix_shape(cut.shape) is None:
        return 0, 0
    shape, first = cut.shape, cut.cuts[0]
    m, n = matrix_shape(shape)
    dim = first.dim
    refusal = (
        f"Shampoo under tensor parallelism needs every tile of the full tensor inside one TP shard: "
        f"parameter {name} (global shape {shape}, TP shard shape {cut.local_shape}, placements "
        f"{cut.placements}) is cut off the grid of max_preconditioner_dim={max_dim}"
    )
    if len(cut.cuts) > 1 or math.prod(shape[1:dim]) != 1:
        raise NotImplementedError(
            refusal + ": one Shard placement of dim 0, or of a dimension whose shards are column blocks "
            "of [shape[0], rest], is supported"
        )
    size, inner = shape[dim], math.prod(shape[dim + 1 :])
    extent, ways = (m, 1) if dim == 0 else (n, inner), first.ways
    chunk = -(-size // ways)  # DTensor's Shard cut, torch.chunk's way
    for s in range(ways):
        a, b = min(s * chunk, size) * extent[1], min((s + 1) * chunk, size) * extent[1]
        if b > a and (a % max_dim or (b % max_dim and b != extent[0])):
            what = "rows" if dim == 0 else "columns"
            raise NotImplementedError(
                refusal + f": a TP shard spans {extent[1] * chunk} {what}, not a multiple of it"
            )
    start = min(first.index * chunk, size) * extent[1]
    return (start // max_dim, 0) if dim == 0 else (0, start // max_dim)


@dataclass(frozen=True)
class TPTiles:
    """The dp x tp world (`world`), each segment's moves of its tiles replicated over TP
    (`shared`, over `world.comm`), every tile of the world per segment as `(param, key, h, w,
    owner)` (`owned`, owners as ranks of `world.comm`), and over all tiles: root work per world
    rank after and before balancing (`loads`, `home_loads`), how many tiles (`tiles`) and how
    many travel each step (`moved`)."""

    world: DpTpWorld
    shared: list[SegmentMoves]
    owned: list[list[tuple[int, str, int, int, int]]]
    loads: tuple[float, ...]
    home_loads: tuple[float, ...]
    tiles: int
    moved: int


def plan_tp_tiles(
    tp: TensorParallel,
    cut: OwnerPlan,
    cut_tiles: Sequence[Sequence[Tile]],
    shared_tiles: Sequence[Sequence[Tile]],
    shared_work: Sequence[Sequence[WorkItem]],
    slack: float,
    tolerate: float,
) -> TPTiles:
    """The plan of the tiles replicated over TP (`shared_work[i]`: segment i's, the same on every
    TP rank) over `tp`'s dp x tp world, after the cut tiles' plan `cut` of this TP rank
    (`cut_tiles[i]`: segment i's). Collective over TP (one exchange of the plans, at
    construction); NotImplementedError, alike on every rank, where the TP ranks' segments do not
    line up (uneven TP shards laid out differently)."""
    world = tp.world()
    held = [
        [(t.key, it.pieces, it.home) for t, it in zip(tiles, work)]
        for tiles, work in zip(shared_tiles, shared_work)
    ]
    listed = [
        [(t.param, t.key, t.h, t.w, o) for t, o in zip(tiles, moves.owners)]
        for tiles, moves in zip(cut_tiles, cut.segments)
    ]
    theirs = all_gather_object((list(cut.loads), list(cut.home_loads), cut.moved, held, listed), tp.group)
    if any(th[3] != held for th in theirs):
        raise NotImplementedError(
            "Shampoo under tensor parallelism computes the tiles of matrices replicated over TP once in "
            "the dp x tp world, which needs the same data-parallel layout of them on every TP rank; the "
            "TP ranks laid them out differently (uneven TP shards in the same buckets?): put the "
            "replicated matrices in a param group of their own, or cut the TP shards evenly"
        )
    return _balance_shared(tp, world, theirs, shared_tiles, shared_work, slack, tolerate)


def _balance_shared(
    tp: TensorParallel, world: DpTpWorld, theirs: list, shared_tiles, shared_work, slack, tolerate
):
    """The shared tiles balanced over the world after every TP rank's cut tiles (`theirs`: each TP
    rank's loads, home loads, moved count and owned cut tiles), and every tile's owner."""
    topo, n = tp.topology, world.comm.world_size

    def at(t: int, w: int) -> int:
        """The world rank of TP rank t's data-parallel rank w."""
        replica, shard = topo.coords(w)
        return world.sharded.ranks[replica][t * topo.shards + shard]

    base, base_home = [0.0] * n, [0.0] * n
    for t, (loads, home_loads, *_) in enumerate(theirs):
        for w, (x, y) in enumerate(zip(loads, home_loads)):
            base[at(t, w)] += x
            base_home[at(t, w)] += y
    items = [it for work in shared_work for it in work]
    costs = [it.cost for it in items]
    homes = spread_homes(costs, [it.home for it in items], world.replicated.ranks)
    owners = assign_owners(costs, n, homes, slack, tolerate, loads=base)
    plan = plan_owners(shared_work, world.replicated, world.comm.rank, channels=CHANNELS, owners=owners)
    owned = []
    for i, (tiles, moves) in enumerate(zip(shared_tiles, plan.segments)):
        every = [(p, key, h, w, at(t, o)) for t, th in enumerate(theirs) for p, key, h, w, o in th[4][i]]
        owned.append(every + [(x.param, x.key, x.h, x.w, o) for x, o in zip(tiles, moves.owners)])
    return TPTiles(
        world,
        plan.segments,
        owned,
        loads=tuple(b + x for b, x in zip(base, plan.loads)),
        home_loads=tuple(b + x for b, x in zip(base_home, plan.home_loads)),
        tiles=sum(len(o) for o in owned),
        moved=sum(th[2] for th in theirs) + plan.moved,
    )
