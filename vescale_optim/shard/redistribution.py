"""Pure redistribution plans: who sends which interval of which tensor to whom.

A plan moves flat intervals between per-rank flat buffers. Each side is described
by `Piece`s — "on rank r, at `offset` of its buffer, lie elements [start, stop) of
tensor t" — and the plan is every overlap of a source piece with a destination piece
of the same tensor. Plans involve no processes, so they are tested by `simulate`;
`collectives.run_plan` executes one with a single `all_to_all_single`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import torch

from .spec import RaggedShard, Shape


@dataclass(frozen=True)
class Piece:
    rank: int
    tensor: int
    offset: int  # where the piece begins in the rank's flat buffer
    start: int  # flat element range [start, stop) of the tensor it holds
    stop: int


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    src_offset: int
    dst_offset: int
    length: int


@dataclass(frozen=True)
class RankProgram:
    """One rank's part of a plan: split sizes and where its bytes come from / go to."""

    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    sends: tuple[tuple[int, int], ...]  # (offset, length) in the source buffer, send order
    recvs: tuple[tuple[int, int], ...]  # (offset, length) in the destination buffer, receive order

    @staticmethod
    def _contiguous(chunks: tuple[tuple[int, int], ...]) -> tuple[int, int] | None:
        if not chunks:
            return (0, 0)
        pos = chunks[0][0]
        for off, length in chunks:
            if off != pos:
                return None
            pos += length
        return chunks[0][0], pos

    @cached_property
    def send_range(self) -> tuple[int, int] | None:
        """[lo, hi) when everything sent is one contiguous run of the source, in order."""
        return self._contiguous(self.sends)

    @cached_property
    def recv_range(self) -> tuple[int, int] | None:
        return self._contiguous(self.recvs)


@dataclass(frozen=True)
class Plan:
    world_size: int
    transfers: tuple[Transfer, ...]  # ordered by (src, dst, tensor, start)
    src_numel: tuple[int, ...]  # per-rank source buffer length
    dst_numel: tuple[int, ...]  # per-rank destination buffer length

    def program(self, rank: int) -> RankProgram:
        w = self.world_size
        send_splits, recv_splits = [0] * w, [0] * w
        sends, recvs = [], []
        for t in self.transfers:
            if t.src == rank:
                send_splits[t.dst] += t.length
                sends.append((t.src_offset, t.length))
            if t.dst == rank:
                recv_splits[t.src] += t.length
                recvs.append((t.dst_offset, t.length))
        return RankProgram(tuple(send_splits), tuple(recv_splits), tuple(sends), tuple(recvs))

    def bytes_sent(self, rank: int, element_size: int = 1) -> int:
        """Elements (times `element_size`) that `rank` sends to other ranks."""
        return element_size * sum(t.length for t in self.transfers if t.src == rank != t.dst)

    def simulate(self, sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Execute the plan in-process: `sources[r]` is rank r's flat source buffer."""
        dtype = sources[0].dtype if sources else torch.float32
        out = [torch.zeros(n, dtype=dtype) for n in self.dst_numel]
        for t in self.transfers:
            out[t.dst][t.dst_offset : t.dst_offset + t.length] = sources[t.src][
                t.src_offset : t.src_offset + t.length
            ]
        return out


def plan_move(
    src: Sequence[Piece],
    dst: Sequence[Piece],
    world_size: int,
    src_numel: Sequence[int] | None = None,
    dst_numel: Sequence[int] | None = None,
) -> Plan:
    """Plan that delivers every destination piece from the source pieces overlapping it."""
    by_tensor: dict[int, tuple[list[Piece], list[Piece]]] = {}
    for p in src:
        if p.stop > p.start:
            by_tensor.setdefault(p.tensor, ([], []))[0].append(p)
    for p in dst:
        if p.stop > p.start:
            by_tensor.setdefault(p.tensor, ([], []))[1].append(p)
    moves = []
    for tensor, (sp, dp) in by_tensor.items():
        sp.sort(key=lambda p: p.start)
        dp.sort(key=lambda p: p.start)
        i = 0
        for d in dp:
            while i < len(sp) and sp[i].stop <= d.start:
                i += 1
            j = i
            while j < len(sp) and sp[j].start < d.stop:
                s = sp[j]
                lo, hi = max(s.start, d.start), min(s.stop, d.stop)
                t = Transfer(s.rank, d.rank, s.offset + lo - s.start, d.offset + lo - d.start, hi - lo)
                moves.append(((s.rank, d.rank, tensor, lo), t))
                j += 1
    moves.sort(key=lambda m: m[0])

    def extent(pieces: Sequence[Piece]) -> tuple[int, ...]:
        ends = [0] * world_size
        for p in pieces:
            ends[p.rank] = max(ends[p.rank], p.offset + p.stop - p.start)
        return tuple(ends)

    return Plan(
        world_size,
        tuple(t for _, t in moves),
        tuple(src_numel) if src_numel is not None else extent(src),
        tuple(dst_numel) if dst_numel is not None else extent(dst),
    )


def ragged_pieces(
    shape: Shape, placement: RaggedShard, tensor: int = 0, offsets: Sequence[int] | None = None
) -> list[Piece]:
    """Each rank's piece of a ragged tensor, at `offsets[r]` of its buffer (default 0)."""
    out = []
    for r, (start, stop) in enumerate(placement.ranges(shape)):
        out.append(Piece(r, tensor, 0 if offsets is None else offsets[r], start, stop))
    return out


def plan_redistribute(shape: Shape, src: RaggedShard, dst: RaggedShard) -> Plan:
    """Ragged -> ragged for one tensor: each rank's buffer is its local piece."""
    src.check(shape)
    dst.check(shape, src.world_size)
    return plan_move(ragged_pieces(shape, src), ragged_pieces(shape, dst), src.world_size)


def plan_gather_to_owner(
    pieces: Sequence[Piece],
    numels: Sequence[int],
    owners: Sequence[int],
    world_size: int,
    src_numel: Sequence[int] | None = None,
) -> Plan:
    """Many tensors at once: every owner receives its tensors whole, packed in tensor
    order into its destination buffer (see `owner_offsets`)."""
    offsets, totals = owner_offsets(numels, owners, world_size)
    dst = [Piece(o, t, offsets[t], 0, numels[t]) for t, o in enumerate(owners)]
    return plan_move(pieces, dst, world_size, src_numel, totals)


def plan_scatter_from_owner(
    pieces: Sequence[Piece],
    numels: Sequence[int],
    owners: Sequence[int],
    world_size: int,
    dst_numel: Sequence[int] | None = None,
) -> Plan:
    """The reverse of `plan_gather_to_owner`: owners send each rank its pieces back."""
    offsets, totals = owner_offsets(numels, owners, world_size)
    src = [Piece(o, t, offsets[t], 0, numels[t]) for t, o in enumerate(owners)]
    return plan_move(src, pieces, world_size, totals, dst_numel)


def owner_offsets(numels: Sequence[int], owners: Sequence[int], world_size: int):
    """Offset of each tensor in its owner's gather buffer, and each rank's buffer length."""
    totals = [0] * world_size
    offsets = []
    for n, o in zip(numels, owners):
        offsets.append(totals[o])
        totals[o] += n
    return offsets, tuple(totals)


def in_arrival_order(plan: Plan) -> tuple[Plan, list[list[tuple[int, int, int]]]]:
    """`plan` with each rank's destination laid out in arrival order (by source rank, then
    as sent), so that `run_plan` receives every piece in place, never unpacking; and for
    each rank where its pieces belong in the original destination: `(dst_offset,
    packed_offset, length)`, sorted by `dst_offset`."""
    pos = [0] * plan.world_size
    transfers, where = [], [[] for _ in range(plan.world_size)]
    for t in plan.transfers:
        where[t.dst].append((t.dst_offset, pos[t.dst], t.length))
        transfers.append(replace(t, dst_offset=pos[t.dst]))
        pos[t.dst] += t.length
    packed = Plan(plan.world_size, tuple(transfers), plan.src_numel, tuple(pos))
    return packed, [sorted(w) for w in where]
