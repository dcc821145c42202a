"""A Muon segment's matrices as owner work: the items `vo.Muon` declares, and what each rank
does with them in a step (`SegmentWork`, one per part of a segment's moves).

Without tensor parallelism a segment's matrices are its parameters' blocks (`group_blocks`: a
stack's matrices, `split_sizes` / `num_heads` rows), each an item of its data-parallel pieces.
In the dp x tp world (`units.tp_pieces.TPWorld`) a matrix cut over TP is one item of its full
matrix, with pieces from every TP shard; an expert stack's local matrices are items of every tp
rank (each of its own tp rank's pieces: every rank plans all of them, the same plan); a plain
matrix is one item seen from every tp rank as a replica. A segment holding items of both views
moves each view in a part of its own; the update is applied when the last part is back.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..owners.plan import SegmentMoves, WorkItem
from ..shard.redistribution import Piece
from ..units.segment import Segment
from ..units.tensor_parallel import local_shape
from ..units.tp_pieces import (
    REPLICATED,
    SHARDED,
    Experts,
    TPItem,
    TPMatrix,
    expert_pieces,
    tp_matrix,
    tp_pieces,
)
from ._muon_math import group_blocks, ns_flops, row_blocks


def blocked(group: dict) -> bool:
    return group.get("split_sizes") is not None or group.get("num_heads") is not None


def tp_blocks(shape: tuple[int, int], group: dict, cut: TPMatrix, t: int) -> list[tuple[int, ...]] | None:
    """The blocks (`split_sizes` / `num_heads` rows) of TP shard `t`'s local matrix, of a matrix of
    `shape` cut as `cut` says: `(local offset, local rows, local cols, rows, cols)`, the last two the
    block's shape in the full matrix. A `Shard(1)` cut holds a column slice of every block (each
    made whole over TP by its owner); a `Shard(0)` cut holds whole blocks, or None when its rows
    cut one."""
    rows, cols = shape
    sizes, out, top = row_blocks(rows, group.get("split_sizes"), group.get("num_heads")), [], 0
    lo, hi = t * rows // cut.size, (t + 1) * rows // cut.size
    for n in sizes:
        a, z, top = top, top + n, top + n
        if cut.dim == 1:
            out.append((a * cols // cut.size, n, cols // cut.size, n, cols))
        elif a < hi and z > lo:
            if a < lo or z > hi:
                return None
            out.append(((a - lo) * cols, n, cols, n, cols))
    return out


def local_blocks(p, group: dict, kind: TPMatrix | Experts | None) -> list[tuple[int, ...]]:
    """This rank's blocks of `p`'s local tensor as `tp_blocks` gives them (any parameter)."""
    if isinstance(kind, TPMatrix) and blocked(group):
        return tp_blocks(tuple(p.shape), group, kind, kind.index) or []
    if isinstance(kind, TPMatrix):
        return [(0, *local_shape(p), *p.shape)]
    return [(at, r, c, r, c) for at, r, c in group_blocks(local_shape(p), group)]


def refuse_tp_blocks(param_groups: list[dict]) -> None:
    """A `Shard(0)` cut whose TP shards do not hold whole blocks of its group's `split_sizes` /
    `num_heads`, refused by name before anything is built (every rank sees the same cuts)."""
    for gi, group in enumerate(param_groups):
        names, ps = group.get("param_names"), group["params"]
        for j, p in enumerate(ps if group.get("use_muon", True) and blocked(group) else ()):
            kind = tp_matrix(p) if p.ndim == 2 else None
            if not (isinstance(kind, TPMatrix) and kind.dim == 0):
                continue
            for t in range(kind.size):
                if tp_blocks(tuple(p.shape), group, kind, t) is None:
                    name = f"'{names[j]}' " if names else ""
                    raise NotImplementedError(
                        f"param group {gi}, parameter {name}#{j} of shape {tuple(p.shape)}: its TP shard {t} "
                        f"(rows {t * p.shape[0] // kind.size} to {(t + 1) * p.shape[0] // kind.size}) cuts a "
                        "block of split_sizes / num_heads; Muon orthogonalizes whole blocks under a Shard(0) "
                        "cut only where each TP shard holds whole blocks"
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


def matrix_work(seg: Segment, ns_steps: int, kinds: list[TPMatrix | Experts | None] | None = None,
                tp_world: bool = False) -> MatrixWork:  # fmt: skip
    """The segment's matrices (its parameters' blocks) as work items. A matrix's pieces lie in
    each shard rank's part of the segment (from `seg.rank_start(r)`); its cost is its
    Newton–Schulz FLOPs; its home the one rank that holds it whole, if one does. With
    `tp_world`, `kinds[i]` (`tp_pieces.tp_kind`) says how parameter i lies over TP: a cut one is
    its full matrix, with pieces from every TP shard; an expert stack's blocks are items of every
    tp rank, one after the other; a plain one is a replicated item."""
    layout, shard, shards = seg.layout, seg.layout.shard_size, len(seg.counts)
    out = MatrixWork([], [], [], [])

    def add(pieces, rows, cols, home, block, tag):
        k = len(out.items)
        pieces = tuple(Piece(q.rank, k, q.offset, q.start, q.stop) for q in pieces)
        out.items.append(WorkItem(pieces, ns_flops(rows, cols, ns_steps), home))
        out.shapes.append((rows, cols))
        out.blocks.append(block)
        out.tags.append(tag)

    def place(i: int, at: int, numel: int) -> tuple[list[Piece], int | None]:
        """The pieces of parameter i's local elements `[at, at + numel)` and their home."""
        start = layout.offsets[i] + at
        first, last = start // shard, (start + numel - 1) // shard  # shard ranks it spans
        pieces = []
        for r in range(first, last + 1):
            lo, hi = max(start, r * shard), min(start + numel, (r + 1) * shard)
            off = lo - r * shard - seg.rank_start(r)  # in rank r's part of the segment
            pieces.append(Piece(r, 0, off, lo - start, hi - start))
        return pieces, first if first == last else None

    for i, p in enumerate(seg.params):
        kind = kinds[i] if kinds and tp_world else None
        if isinstance(kind, TPMatrix) and blocked(seg.group):  # blocks of the TP shards
            first = 0  # the full matrix's index of a TP shard's first block
            for t in range(kind.size) if kind.dim == 0 else (None,):
                shard_blocks = tp_blocks(tuple(p.shape), seg.group, kind, t or 0)
                for b, (at, n, c, rows, cols) in enumerate(shard_blocks, start=first):
                    pieces, home = place(i, at, n * c)
                    if t is None:  # a column slice on every tp rank: the whole block from all of them
                        add(tp_pieces(pieces, kind, shards), rows, cols, None, (i, b), TPItem(SHARDED))
                    else:  # whole on tp rank t: orthogonalized there, as an expert matrix
                        at_home = None if home is None else t * shards + home
                        add(expert_pieces(pieces, t, shards), n, c, at_home, (i, b), TPItem(SHARDED, t))
                first += len(shard_blocks)
            continue
        local = []  # per block: its pieces, home and shape on this rank's layout
        for b, (at, rows, cols) in enumerate(group_blocks(local_shape(p), seg.group)):
            local.append((b, *place(i, at, rows * cols), rows, cols))
        if isinstance(kind, Experts):  # tp rank t's copy of each block, for every t (the stack's t * n + b)
            for t in range(kind.size):
                for b, pieces, home, rows, cols in local:
                    at_home = None if home is None else t * shards + home
                    block = (i, t * len(local) + b)
                    add(expert_pieces(pieces, t, shards), rows, cols, at_home, block, TPItem(SHARDED, t))
        elif isinstance(kind, TPMatrix):  # the full matrix, from the TP shards of every tp rank
            for b, pieces, _, _, _ in local:
                add(tp_pieces(pieces, kind, shards), *tuple(p.shape), None, (i, b), TPItem(SHARDED))
        else:
            for b, pieces, home, rows, cols in local:
                add(pieces, rows, cols, home, (i, b), TPItem(REPLICATED) if tp_world else None)
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
    def of(moves: SegmentMoves, items: list[WorkItem], shapes: list[tuple[int, int]],
           ids: list[int]) -> SegmentWork:  # fmt: skip
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
