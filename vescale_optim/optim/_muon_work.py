"""A Muon segment's matrices as owner work: the items `vo.Muon` declares, and what each rank
does with them in a step (`SegmentWork`, one per part of a segment's moves).

Without tensor parallelism a segment's matrices are its parameters' blocks (`group_blocks`: a
stack's matrices, `split_sizes` / `num_heads` rows), each an item of its data-parallel pieces.
In the dp x tp world (`_muon_tp`) a matrix cut over TP is one item of its full matrix, with
pieces from every TP shard; an expert stack's local matrices are items of every tp rank (each of
its own tp rank's pieces: every rank plans all of them, the same plan); a plain matrix is one
item seen from every tp rank as a replica. A segment holding items of both views moves each view
in a part of its own; the update is applied when the last part is back. Who owns which item is
planned once, at construction (`_muon_setup.plan_setup`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..owners.plan import SegmentMoves, WorkItem
from ..shard.redistribution import Piece
from ..units.segment import Segment
from ..units.tp_view import ParamCut
from ._muon_math import group_blocks, ns_flops
from ._muon_tp import (
    REPLICATED,
    SHARDED,
    Experts,
    TPItem,
    TPMatrix,
    blocked,
    expert_pieces,
    tp_blocks,
    tp_pieces,
)


@dataclass(frozen=True)
class MatrixWork:
    """A segment's matrices: per item its `WorkItem`, `(rows, cols)`, `(param, block)` (the
    block it is of the parameter's local tensor, or in the dp x tp world of the whole tensor: what
    keys NorMuon's state) and, in the dp x tp world, its `TPItem` (else None)."""

    items: list[WorkItem]
    shapes: list[tuple[int, int]]
    blocks: list[tuple[int, int]]
    tags: list[TPItem | None]

    def add(self, pieces, rows: int, cols: int, ns_steps: int, home, block, tag) -> None:
        """One more matrix: its pieces (renumbered as this item's), shape, home, block and tag."""
        k = len(self.items)
        pieces = tuple(Piece(q.rank, k, q.offset, q.start, q.stop) for q in pieces)
        self.items.append(WorkItem(pieces, ns_flops(rows, cols, ns_steps), home))
        self.shapes.append((rows, cols))
        self.blocks.append(block)
        self.tags.append(tag)


def place(seg: Segment, i: int, at: int, numel: int) -> tuple[list[Piece], int | None]:
    """The pieces of parameter i's local elements `[at, at + numel)` (a piece per shard rank
    holding some, at its offset in that rank's part of the segment) and their home: the one shard
    rank holding them all, if one does."""
    layout = seg.layout
    shard, start = layout.shard_size, layout.offsets[i] + at
    first, last = start // shard, (start + numel - 1) // shard  # shard ranks it spans
    pieces = []
    for r in range(first, last + 1):
        lo, hi = max(start, r * shard), min(start + numel, (r + 1) * shard)
        off = lo - r * shard - seg.rank_start(r)  # in rank r's part of the segment
        pieces.append(Piece(r, 0, off, lo - start, hi - start))
    return pieces, first if first == last else None


def _tp_blocks(out: MatrixWork, seg: Segment, i: int, cut: ParamCut, kind: TPMatrix, ns_steps: int) -> None:
    """The blocks of a TP-cut matrix: a `Shard(1)` cut's blocks are column slices on every tp
    rank, each whole block an item of all of them; a `Shard(0)` cut's blocks lie whole on one tp
    rank, each an item of that rank's, orthogonalized there, as an expert matrix."""
    shards, first = len(seg.counts), 0  # (first: the full matrix's index of a TP shard's first block)
    for t in range(kind.size) if kind.dim == 0 else (None,):
        shard_blocks = tp_blocks(cut.shape, seg.group, kind, t or 0)
        for b, (at, n, c, rows, cols) in enumerate(shard_blocks, start=first):
            pieces, home = place(seg, i, at, n * c)
            if t is None:
                out.add(tp_pieces(pieces, kind, shards), rows, cols, ns_steps, None, (i, b), TPItem(SHARDED))
            else:
                at_home = None if home is None else t * shards + home
                tag = TPItem(SHARDED, t)
                out.add(expert_pieces(pieces, t, shards), n, c, ns_steps, at_home, (i, b), tag)
        first += len(shard_blocks)


def matrix_work(
    seg: Segment,
    ns_steps: int,
    cuts: list[ParamCut],
    kinds: list[TPMatrix | Experts | None] | None = None,
    tp_world: bool = False,
) -> MatrixWork:
    """The segment's matrices (its parameters' blocks, `cuts[i]`: how parameter i lies over its
    mesh) as work items. A matrix's pieces lie in each shard rank's part of the segment (from
    `seg.rank_start(r)`); its cost is its Newton–Schulz FLOPs; its home the one rank that holds it
    whole, if one does. With `tp_world`, `kinds[i]` (`_muon_tp.tp_kind`) says how parameter i lies
    over TP: a cut one is its full matrix, with pieces from every TP shard; an expert stack's
    blocks are items of every tp rank, one after the other; a plain one is a replicated item."""
    shards, out = len(seg.counts), MatrixWork([], [], [], [])
    for i, cut in enumerate(cuts):
        kind = kinds[i] if kinds and tp_world else None
        if isinstance(kind, TPMatrix) and blocked(seg.group):
            _tp_blocks(out, seg, i, cut, kind, ns_steps)
            continue
        local = []  # per block: its pieces, home and shape on this rank's layout
        for b, (at, rows, cols) in enumerate(group_blocks(cut.local_shape, seg.group)):
            local.append((b, *place(seg, i, at, rows * cols), rows, cols))
        if isinstance(kind, Experts):  # tp rank t's copy of each block, for every t (the stack's t * n + b)
            for t in range(kind.size):
                for b, pieces, home, rows, cols in local:
                    at_home = None if home is None else t * shards + home
                    block, tag = (i, t * len(local) + b), TPItem(SHARDED, t)
                    out.add(expert_pieces(pieces, t, shards), rows, cols, ns_steps, at_home, block, tag)
        elif isinstance(kind, TPMatrix):  # the full matrix, from the TP shards of every tp rank
            for b, pieces, _, _, _ in local:
                full = tp_pieces(pieces, kind, shards)
                out.add(full, *cut.shape, ns_steps, None, (i, b), TPItem(SHARDED))
        else:
            for b, pieces, home, rows, cols in local:
                out.add(pieces, rows, cols, ns_steps, home, (i, b), TPItem(REPLICATED) if tp_world else None)
    return out


@dataclass(frozen=True)
class SegmentWork:
    """A part of a Muon segment's moves, and this rank's matrices batched by shape: `(rows, cols)
    -> offsets` in the local update (`held`: matrices it holds whole) or in the received buffer
    (`arriving`), with the segment's matrix index of each (`held_ids`, `arriving_ids`: NorMuon's
    state); `returned`: `(offset, in back, length)` of the results that come back."""

    moves: SegmentMoves
    held: dict[tuple[int, int], list[int]]
    arriving: dict[tuple[int, int], list[int]]
    returned: list[tuple[int, int, int]]
    held_ids: dict[tuple[int, int], list[int]]
    arriving_ids: dict[tuple[int, int], list[int]]
    shapes: list[tuple[int, int]]  # per item, and its matrix index in the segment (`ids`)
    ids: list[int]

    @staticmethod
    def of(
        moves: SegmentMoves, items: list[WorkItem], shapes: list[tuple[int, int]], ids: list[int]
    ) -> SegmentWork:
        held: dict[tuple[int, int], list[int]] = {}
        arriving: dict[tuple[int, int], list[int]] = {}
        held_ids: dict[tuple[int, int], list[int]] = {}
        arriving_ids: dict[tuple[int, int], list[int]] = {}
        for k in moves.local:
            held.setdefault(shapes[k], []).append(next((p.offset for p in items[k].pieces), 0))
            held_ids.setdefault(shapes[k], []).append(ids[k])
        for k in moves.arriving:
            arriving.setdefault(shapes[k], []).append(moves.received_at[k])
            arriving_ids.setdefault(shapes[k], []).append(ids[k])
        returned = sorted((p.offset, at, p.stop - p.start) for _, p, at in moves.returned)
        return SegmentWork(moves, held, arriving, returned, held_ids, arriving_ids, shapes, ids)
