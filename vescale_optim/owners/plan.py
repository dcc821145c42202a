"""Owner work: math that needs an item whole on one rank (Muon's matrices, Shampoo's tiles).

An optimizer declares, per segment, its `WorkItem`s: which shard rank holds which flat range
of an item, at which offset of that rank's source buffer (`Piece`s), what the item costs and
its home (the shard rank where its data lies whole, or where most of it lies). `plan_owners`
chooses one owner per item over the whole world with the one balancer
(`balance.assign_owners`; with a `replicate x shard` mesh homes are first spread over the
replicas, so each item is computed once in the world), and builds, for each segment, the
plans that bring the items to their owners (`channels` inputs each) and their results back,
seen from one rank (`SegmentMoves`). An item whose owner holds it whole stays in place. It
knows nothing of what the owner computes; `SegmentMoves.move` returns the `Move` that
`moves.run_moves` runs overlapped with every other segment's.

Buffers of a segment on a rank, for `SegmentMoves`:
- source: in place (`sources` given, one channel), the buffer the pieces' offsets index;
  staged, a buffer of `send_numel` the optimizer fills as `pack` says, channels of a piece
  one after the other;
- received (owners): each arriving item at `received_at[item]`, channel `c` at
  `received_at[item] + c * numel`;
- result (owners): each arriving item's result at `result_at[item]` (`result_numel` long; with
  one channel, the received buffer itself will do);
- back: the results' pieces in arrival order (received in place), as `returned` says.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from ..shard.mesh import Topology
from ..shard.redistribution import (
    Piece,
    Plan,
    RankProgram,
    in_arrival_order,
    owner_offsets,
    plan_gather_to_owner,
    plan_scatter_from_owner,
)
from .balance import assign_owners, rank_loads, spread_homes
from .moves import Move


@dataclass(frozen=True)
class WorkItem:
    """One item of owner work. `pieces`: `Piece(shard rank, _, offset in that rank's source,
    start, stop)` covering the item's flat elements `[0, numel)` once (every replica holds the
    same); `home`: a shard rank to keep the item at when the balance allows, or None."""

    pieces: tuple[Piece, ...]
    cost: float
    home: int | None = None

    @property
    def numel(self) -> int:
        return sum(p.stop - p.start for p in self.pieces)

    def held(self, shard: int) -> int:
        """Elements of the item that `shard` holds."""
        return sum(p.stop - p.start for p in self.pieces if p.rank == shard)


def whole_on(pieces: Sequence[Piece]) -> int | None:
    """The one shard rank that holds all of an item's elements, else None."""
    ranks = {p.rank for p in pieces if p.stop > p.start}
    return ranks.pop() if len(ranks) == 1 else None


def mostly_on(pieces: Sequence[Piece]) -> int:
    """The shard rank that holds most of an item's elements (ties: the lowest)."""
    held: dict[int, int] = {}
    for p in pieces:
        held[p.rank] = held.get(p.rank, 0) + p.stop - p.start
    return min(held, key=lambda r: (-held[r], r))


def _nothing() -> None:
    return None


@dataclass
class SegmentMoves:
    """One segment's owner work seen from one world rank (see the module's docstring for the
    buffers).

    `owners[k]`: the world rank that computes item k. `moved`: the items that travel, in the
    order of the owners' received buffers. `local`: items this rank computes where they lie
    (it holds them whole); `arriving`: items it computes once received. `pack`: this rank's
    staged pieces `(item, piece, offset)`; `returned`: `(item, piece, offset in back)` for each
    piece of a result this rank gets back (by the piece's offset, for in-place sources).
    Pieces are the items' own."""

    owners: list[int]
    moved: list[int]
    local: list[int]
    arriving: list[int]
    received_at: dict[int, int]
    result_at: dict[int, int]
    result_numel: int
    send_numel: int
    back_numel: int
    pack: list[tuple[int, Piece, int]]
    returned: list[tuple[int, Piece, int]]
    gather: Plan | None = None
    scatter: Plan | None = None
    programs: tuple[RankProgram, RankProgram] | None = field(default=None, repr=False)

    def move(
        self,
        src: torch.Tensor,
        *,
        compute: Callable[[torch.Tensor], torch.Tensor | None],
        finish: Callable[[torch.Tensor], None],
        local: Callable[[], None] = _nothing,
        label: str = "compute",
        returns: bool = True,
    ) -> Move | None:
        """The segment's round trip: `src` (this rank's source buffer) goes to the owners;
        `local()` runs meanwhile; `compute(received)` runs on what arrived and returns the
        results (laid out as `result_at` says); with `returns`, they come back into a buffer
        `back`, and `finish(back)` applies them. When nothing travels, `local()` and `finish`
        run now and there is no `Move` (every rank agrees: the plan is the same everywhere)."""
        if self.gather is None:
            with record_function(f"vescale_optim.{label}"):  # the label of the work, moved or not
                local()
            finish(src.new_empty(0))
            return None
        back = src.new_empty(self.back_numel if returns else 0)
        gather_program, scatter_program = self.programs
        return Move(
            gather=self.gather,
            src=src,
            scatter=self.scatter if returns else None,
            dst=back,
            programs=(gather_program, scatter_program if returns else None),
            label=label,
            local=local,
            compute=compute,
            finish=lambda: finish(back),
        )


@dataclass(frozen=True)
class OwnerPlan:
    """Every segment's `SegmentMoves` for one rank, and what the balance gave: `owners`
    (world ranks, all items of all segments in order), per world rank `loads` (the cost it
    computes) and `home_loads` (the cost at the items' homes, spread over replicas: before
    balancing), and how many items travel (`moved`)."""

    segments: list[SegmentMoves]
    owners: list[int]
    loads: list[float]
    home_loads: list[float]
    moved: int


def plan_owners(
    work: Sequence[Sequence[WorkItem]],
    topology: Topology,
    rank: int,
    *,
    slack: float = 0.05,
    tolerate: float | None = None,
    channels: int = 1,
    sources: Sequence[Sequence[int]] | None = None,
    owners: Sequence[int] | None = None,
) -> OwnerPlan:
    """Owners for every item of every segment (`work[i]`: segment i's items), balanced over
    the world of `topology` by one `assign_owners(slack=, tolerate=)` unless `owners` (world
    ranks, every item of every segment in order) are given, and each segment's moves as
    world rank `rank` sees them. `sources[i][s]`: with in-place sources, the length of
    segment i's source buffer on shard rank s; without, sources are staged."""
    if sources is not None and channels != 1:
        raise ValueError(f"in-place sources carry one channel; got channels={channels}")
    costs = [item.cost for items in work for item in items]
    homes = spread_homes(costs, [item.home for items in work for item in items], topology.ranks)
    if owners is None:
        owners = assign_owners(costs, topology.world_size, homes, slack, tolerate)
    elif len(owners) != len(costs):
        raise ValueError(f"{len(owners)} owners for {len(costs)} items")
    owners = list(owners)
    segments, pos = [], 0
    for i, items in enumerate(work):
        numel = None if sources is None else sources[i]
        segments.append(_segment(items, owners[pos : pos + len(items)], topology, rank, channels, numel))
        pos += len(items)
    return OwnerPlan(
        segments,
        owners,
        rank_loads(costs, owners, topology.world_size),
        rank_loads(costs, homes, topology.world_size),
        sum(len(s.moved) for s in segments),
    )


def _segment(
    items: Sequence[WorkItem],
    owners: list[int],
    topo: Topology,
    rank: int,
    channels: int,
    source_numel: Sequence[int] | None,
) -> SegmentMoves:
    """One segment's moves: an item travels unless its owner holds it whole (with replicas,
    every item travels: its result goes to every replica). The owner gathers from the pieces
    of its own replica and scatters to the pieces of every replica."""
    world = topo.world_size
    coords = [(0, 0)] * world  # (replica, shard) of each world rank
    for replica, row in enumerate(topo.ranks):
        for shard, w in enumerate(row):
            coords[w] = (replica, shard)
    if topo.replicas == 1:
        moved = [k for k, item in enumerate(items) if item.held(coords[owners[k]][1]) != item.numel]
    else:
        moved = list(range(len(items)))
    # by first holder, so that pieces from one rank arrive in order (received in place)
    first = [min((p.rank for p in item.pieces if p.stop > p.start), default=0) for item in items]
    moved.sort(key=lambda k: (first[k], k))
    numels, to = [items[k].numel for k in moved], [owners[k] for k in moved]
    wide, wide_to = [n for n in numels for _ in range(channels)], [o for o in to for _ in range(channels)]
    routes = _routes(items, moved, to, coords, rank, channels, source_numel)
    received, _ = owner_offsets(wide, wide_to, world)
    results, result_numel = owner_offsets(numels, to, world)
    owned = [j for j, o in enumerate(to) if o == rank]
    travels = set(moved)
    out = SegmentMoves(
        owners=list(owners),
        moved=moved,
        local=[k for k, o in enumerate(owners) if o == rank and k not in travels],
        arriving=sorted(moved[j] for j in owned),
        received_at={moved[j]: received[channels * j] for j in owned},
        result_at={moved[j]: results[j] for j in owned},
        result_numel=result_numel[rank],
        send_numel=routes.send_numel[rank],
        back_numel=0,
        pack=routes.pack,
        returned=[],
    )
    if not moved:
        return out
    out.gather = plan_gather_to_owner(routes.gather, wide, wide_to, world, routes.send_numel)
    scatter = plan_scatter_from_owner(routes.scatter, numels, to, world, routes.back_numel)
    out.scatter, where = in_arrival_order(scatter)
    out.back_numel = out.scatter.dst_numel[rank]
    out.returned = [(*routes.mine[dst], offset) for dst, offset, _ in where[rank]]
    out.programs = (out.gather.program(rank), out.scatter.program(rank))
    return out


@dataclass
class _Routes:
    """Where each moved item's pieces go, over every world rank: `gather` (to the owner, from
    its own replica) and `scatter` (the results back, to every replica) as `Piece`s of moved
    item `j` (channel `c` of it as `channels * j + c` when staged); each rank's `send_numel`
    and `back_numel`; this rank's `pack` (item, piece, offset in the staged source) and `mine`
    (its result pieces, by destination offset)."""

    gather: list[Piece] = field(default_factory=list)
    scatter: list[Piece] = field(default_factory=list)
    pack: list[tuple[int, Piece, int]] = field(default_factory=list)
    send_numel: list[int] = field(default_factory=list)
    back_numel: list[int] = field(default_factory=list)
    mine: dict[int, tuple[int, Piece]] = field(default_factory=dict)


def _routes(
    items: Sequence[WorkItem],
    moved: list[int],
    to: list[int],
    coords: list[tuple[int, int]],
    rank: int,
    channels: int,
    source_numel: Sequence[int] | None,
) -> _Routes:
    """The pieces of the `moved` items (their owners `to`), sent in place from the sources
    (`source_numel` given) or staged (see the module's docstring)."""
    held: dict[int, list[tuple[int, Piece]]] = {}  # by shard rank, in send order (by owner)
    for j in sorted(range(len(moved)), key=lambda j: (to[j], j)):
        for p in items[moved[j]].pieces:
            if p.stop > p.start:
                held.setdefault(p.rank, []).append((j, p))
    in_place = source_numel is not None
    out = _Routes()
    for w, (replica, shard) in enumerate(coords):
        sent = back = 0
        for j, p in held.get(shard, ()):
            n = p.stop - p.start
            if coords[to[j]][0] == replica:  # the owner gathers from its own replica
                if in_place:
                    out.gather.append(Piece(w, j, p.offset, p.start, p.stop))
                else:
                    for c in range(channels):  # channels of a piece one after the other
                        out.gather.append(Piece(w, channels * j + c, sent + c * n, p.start, p.stop))
                    if w == rank:
                        out.pack.append((moved[j], p, sent))
                    sent += channels * n
            dst = p.offset if in_place else back
            out.scatter.append(Piece(w, j, dst, p.start, p.stop))
            if w == rank:
                out.mine[dst] = (moved[j], p)
            back += n
        out.send_numel.append(source_numel[shard] if in_place else sent)
        out.back_numel.append(source_numel[shard] if in_place else back)
    return out
