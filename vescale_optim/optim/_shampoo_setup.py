"""Shampoo's setup of a layout: every tile declared as owner work and placed by one balance.

`plan_setup` runs once the runtime has laid out the parameters (`vo.Shampoo._plan_work`, at
construction and again when the parameters were swapped before the first step) and returns a
`ShampooSetup`; a step only reads it. One balance of root work over the world: tiles whose
owner lacks some of their rows travel. Under tensor parallelism (the runtime's `TensorParallel`)
a TP shard's tiles are the full tensor's (`_shampoo_tp.tp_tile_offset`), and the tiles of
matrices replicated over TP are planned over the dp x tp world after the others
(`_shampoo_tp.plan_tp_tiles`); `root_work` and the counts are then the world's. Over FSDP2's
shards whole matrices go to owners instead (`_shampoo_fsdp`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..owners.plan import plan_owners
from ..units.fsdp_shards import FsdpGrads
from ..units.segment import FROZEN, Segment
from ._shampoo_fsdp import FsdpShampoo
from ._shampoo_math import Tile, tiles_of
from ._shampoo_tiles import CHANNELS, SegmentTiles, rows_held, tile_work
from ._shampoo_tp import TPTiles, plan_tp_tiles, tp_tile_offset

# No tile leaves the rank holding its rows while no rank's root work exceeds 1.2x the mean;
# when some must, tiles stay while their rank's work is within 1.1x the mean.
TOLERATE, SLACK = 0.2, 0.1


@dataclass
class ShampooSetup:
    """Shampoo's plan of one layout: by segment id, this rank's tiles of the segment (`tiles`: all
    of them, or under TP those of its TP shard) and those replicated over TP (`shared`, moved over
    the dp x tp world); each segment's index (`position`); root work per world rank after and
    before balancing (`root_work`, `native_root_work`), how many tiles there are (`num_tiles`) and
    how many travel each step (`moved_tiles`); under TP the dp x tp world's plan (`tp`), over
    FSDP2's shards the owners of whole matrices (`fsdp`)."""

    tiles: dict[int, SegmentTiles]
    shared: dict[int, SegmentTiles]
    position: dict[int, int]
    root_work: tuple[float, ...]
    native_root_work: tuple[float, ...]
    num_tiles: int
    moved_tiles: int
    tp: TPTiles | None = None
    fsdp: FsdpShampoo | None = field(default=None)


def plan_setup(runtime, labels: dict[int, str]) -> ShampooSetup:
    """Shampoo's setup of `runtime`'s layout (`labels`: each parameter's name in errors)."""
    if isinstance(runtime.wrapper, FsdpGrads):
        return _over_fsdp(runtime)
    tp = runtime.tensor_parallel
    segs, shared = list(runtime.segments), tp.group is not None
    shapes = [[tp.cut(p).local_shape for p in seg.params] for seg in segs]
    cut, rep = [], []  # per segment (tiles, work): those of this TP rank, those replicated over TP
    for seg, seg_shapes in zip(segs, shapes):
        found = _tiles_of(seg, seg_shapes, tp, labels)
        mixed = [shared and not tp.cut(seg.params[t.param]).sharded for t in found]  # once in dp x tp
        for kind, tiles in (
            (cut, [t for t, m in zip(found, mixed) if not m]),
            (rep, [t for t, m in zip(found, mixed) if m]),
        ):
            rows = [[rows_held(seg, t, r, seg_shapes) for r in range(runtime.topology.shards)] for t in tiles]
            kind.append((tiles, tile_work(tiles, rows)))
    work, topo, rank = [w for _, w in cut], runtime.topology, runtime.dp.rank
    plan = plan_owners(work, topo, rank, slack=SLACK, tolerate=TOLERATE, channels=CHANNELS)
    tiles = {
        id(seg): SegmentTiles(seg, seg_tiles, moves, seg_shapes)
        for seg, (seg_tiles, _), moves, seg_shapes in zip(segs, cut, plan.segments, shapes)
    }
    position = {id(seg): i for i, seg in enumerate(segs)}
    if not shared:
        loads, home = tuple(plan.loads), tuple(plan.home_loads)
        return ShampooSetup(tiles, {}, position, loads, home, len(plan.owners), plan.moved)
    cut_tiles, rep_tiles, rep_work = [t for t, _ in cut], [t for t, _ in rep], [w for _, w in rep]
    world = plan_tp_tiles(tp, plan, cut_tiles, rep_tiles, rep_work, SLACK, TOLERATE)
    shared_tiles = {
        id(seg): SegmentTiles(seg, seg_tiles, moves, seg_shapes)
        for seg, (seg_tiles, _), moves, seg_shapes in zip(segs, rep, world.shared, shapes)
        if seg_tiles
    }
    return ShampooSetup(
        tiles, shared_tiles, position, world.loads, world.home_loads, world.tiles, world.moved, tp=world
    )


def _tiles_of(seg: Segment, shapes: list[tuple[int, ...]], tp, labels: dict[int, str]) -> list[Tile]:
    """The tiles of the segment's parameters' local tensors (`shapes`), keyed by the full
    tensor's tile indices (a TP shard's first tile: `tp_tile_offset`); none for frozen ones."""
    if seg.tier == FROZEN:  # frozen parameters have no preconditioners
        return []
    d = seg.group["max_preconditioner_dim"]
    first = [tp_tile_offset(tp.cut(p), d, labels[id(p)]) for p in seg.params]
    return [t for i, shape in enumerate(shapes) for t in tiles_of(shape, d, i, first[i])]


def _over_fsdp(runtime) -> ShampooSetup:
    """Over FSDP2's shards, whole matrices at owners balanced by their tiles' root work over the
    world (`_shampoo_fsdp`); no tile of the other layouts."""
    segs = [seg for seg in runtime.segments if seg.tier != FROZEN]
    fsdp = FsdpShampoo(segs, runtime.wrapper, runtime.dp, runtime.tensor_parallel)
    position = {id(seg): i for i, seg in enumerate(segs)}
    loads, home = tuple(fsdp.loads), tuple(fsdp.home_loads)
    return ShampooSetup({}, {}, position, loads, home, fsdp.num_tiles, fsdp.moved_tiles, fsdp=fsdp)
