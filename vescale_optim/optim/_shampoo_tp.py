"""Shampoo's tiles under tensor parallelism, seen from the dp x tp world (`units.tp_pieces`).

A matrix cut over TP on the tile grid holds other tiles of the full tensor on each TP rank:
each TP rank plans its own over the data-parallel group (`Shampoo._plan_work`), with no TP
traffic. A matrix replicated over TP (a plain parameter, or a Replicate DTensor) holds the same
tiles on every TP rank: they are owner work over the whole dp x tp world in its `replicated`
view (each tp rank a replica of its own, `TPWorld.replicated`), so each is computed once in the
world and its update reaches every TP rank's copy. They are balanced after the cut tiles, over
the root work those left on each rank of the world.

`TPTiles.owned` lists every tile of the world per segment (every TP rank's cut tiles, keyed by
the full tensor's tile indices, and the shared ones) with the world rank that owns it: the full
torch state dict gathers their factors from there, keyed as in one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..owners.balance import assign_owners, spread_homes
from ..owners.plan import OwnerPlan, SegmentMoves, WorkItem, plan_owners
from ..shard.collectives import all_gather_object
from ..units.tp_pieces import TPWorld, tp_world
from ._shampoo_math import Tile
from ._shampoo_tiles import CHANNELS


@dataclass(frozen=True)
class TPTiles:
    """The dp x tp world (`world`), each segment's moves of its tiles replicated over TP
    (`shared`, over `world.comm`), every tile of the world per segment as `(param, key, h, w,
    owner)` (`owned`, owners as ranks of `world.comm`), and over all tiles: root work per world
    rank after and before balancing (`loads`, `home_loads`), how many tiles (`tiles`) and how
    many travel each step (`moved`)."""

    world: TPWorld
    shared: list[SegmentMoves]
    owned: list[list[tuple[int, str, int, int, int]]]
    loads: tuple[float, ...]
    home_loads: tuple[float, ...]
    tiles: int
    moved: int


def plan_tp_tiles(
    runtime,
    cut: OwnerPlan,
    cut_tiles: Sequence[Sequence[Tile]],
    shared_tiles: Sequence[Sequence[Tile]],
    shared_work: Sequence[Sequence[WorkItem]],
    slack: float,
    tolerate: float,
) -> TPTiles:
    """The world of `runtime`'s data-parallel group times its TP group, and the plan of the
    tiles replicated over TP (`shared_work[i]`: segment i's, the same on every TP rank) after
    the cut tiles' plan `cut` of this TP rank (`cut_tiles[i]`: segment i's). Collective over TP
    (one exchange of the plans, at construction); NotImplementedError, alike on every rank, where
    the TP ranks' segments do not line up (uneven TP shards laid out differently)."""
    topo, tp = runtime.topology, runtime.tp[0]
    world = tp_world(runtime.dp, tp, topo, tp.rank)
    held = [[(t.key, it.pieces, it.home) for t, it in zip(tiles, work)]
            for tiles, work in zip(shared_tiles, shared_work)]  # fmt: skip
    mine = (
        list(cut.loads), list(cut.home_loads), cut.moved, held,
        [[(t.param, t.key, t.h, t.w, o) for t, o in zip(tiles, moves.owners)]
         for tiles, moves in zip(cut_tiles, cut.segments)],
    )  # fmt: skip
    theirs = all_gather_object(mine, tp)
    if any(th[3] != held for th in theirs):
        raise NotImplementedError(
            "Shampoo under tensor parallelism computes the tiles of matrices replicated over TP once in "
            "the dp x tp world, which needs the same data-parallel layout of them on every TP rank; the "
            "TP ranks laid them out differently (uneven TP shards in the same buckets?): put the "
            "replicated matrices in a param group of their own, or cut the TP shards evenly"
        )
    size, n = topo.shards, world.comm.world_size

    def at(t: int, w: int) -> int:
        """The world rank of TP rank t's data-parallel rank w."""
        replica, shard = topo.coords(w)
        return world.sharded.ranks[replica][t * size + shard]

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
        world, plan.segments, owned,
        loads=tuple(b + x for b, x in zip(base, plan.loads)),
        home_loads=tuple(b + x for b, x in zip(base_home, plan.home_loads)),
        tiles=sum(len(o) for o in owned), moved=sum(th[2] for th in theirs) + plan.moved,
    )  # fmt: skip
