"""Muon's split matrices in a step: their row blocks brought to their groups' members, split
Newton–Schulz (`_split_ns`), the results back into the segments' update buffers.

Each member's block (its rows of M) is a work item of the owner layer with its member as
owner, so one staged gather plan over the world brings every block to its member (a block a
member holds whole stays in place) and one scatter plan brings the results back to every holder
of every replica. The process groups, one per distinct set of members, are made once, at
construction, from the optimizer's group by all of its ranks in the same order (`shard.groups`:
never by the members alone). All of it runs once a step, in the step's phase
across segments (`vo.Muon._step_phase`: every Muon segment has its momentum, no update has been
applied yet), so every rank issues the same world collectives at the same point. Everything a step needs to
know of where blocks lie and go is planned once, at construction (`SplitStep`); a step only
moves and computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..owners.plan import WorkItem, plan_owners
from ..shard.collectives import Comm, run_plan
from ..shard.groups import split_groups
from ..shard.mesh import Topology
from ..shard.redistribution import Piece
from ..units.segment import Segment
from ._muon_plan import MuonPlan
from ._split_ns import Job, run_split


def _groups(plan: MuonPlan, world: Comm) -> dict[tuple[int, ...], Comm]:
    """A process group per distinct set of members (world ranks), made from the optimizer's
    group by all of its ranks in one order (`shard.groups`); the `Comm`s of those this rank is in."""
    if not world.active:
        return {}
    made = split_groups(world.group, sorted(set(plan.groups.values())))
    return {members: Comm(group) for members, group in made.items()}


@dataclass(frozen=True)
class _Block:
    """A block this rank computes: member `member` of matrix `matrix`'s split, block `block` of
    the plan, from the segment at `seg` (position); it arrives at `received` in the gathered
    buffer, or lies whole here at `at` in the segment's update (read and written in place)."""

    matrix: int
    member: int
    block: int
    seg: int
    numel: int
    received: int | None
    at: int | None


class SplitStep:
    """The split matrices of Muon's segments `segs` (their `items`, one per matrix, and
    `shapes`, per segment; the plan's matrices are theirs in order), run from world rank `rank`."""

    def __init__(
        self,
        plan: MuonPlan,
        segs: Sequence[Segment],
        items: Sequence[Sequence[WorkItem]],
        shapes: Sequence[Sequence[tuple[int, int]]],
        topology: Topology,
        world: Comm,
    ):
        rank = world.rank
        self.plan, self.world = plan, world
        where = [(s, k) for s, seg_items in enumerate(items) for k in range(len(seg_items))]
        blocks, owners = [], []
        self.seg_of: list[int] = []  # the segment (position) of each block
        self.seg_of_matrix = {i: where[i][0] for i in plan.groups}
        self.mine: list[tuple[int, int, int]] = []  # (matrix, member index, block) this rank computes
        for i in sorted(plan.groups):
            s, k = where[i]
            split, cols = plan.splits[i], shapes[s][k][1]
            for j, member in enumerate(plan.groups[i]):
                lo, hi = split.start(j) * cols, (split.start(j) + split.rows[j]) * cols
                pieces = tuple(
                    Piece(
                        p.rank,
                        len(blocks),
                        p.offset + max(lo, p.start) - p.start,
                        max(lo, p.start) - lo,
                        min(hi, p.stop) - lo,
                    )
                    for p in items[s][k].pieces
                    if p.start < hi and p.stop > lo
                )
                if member == rank:
                    self.mine.append((i, j, len(blocks)))
                blocks.append(WorkItem(pieces, 0.0))  # owners are given: no cost to balance
                owners.append(member)
                self.seg_of.append(s)
        self.blocks = blocks
        self.moves = moves = plan_owners([blocks], topology, rank, owners=owners).segments[0]
        self.comms = _groups(plan, world)
        self.segs = list(segs)
        self._mine = [
            _Block(
                i,
                j,
                b,
                self.seg_of[b],
                blocks[b].numel,
                moves.received_at.get(b),
                None
                if b in moves.received_at
                else next(p.offset for p in blocks[b].pieces if p.stop > p.start),
            )
            for i, j, b in self.mine
        ]

    def run(self, updates: dict[int, torch.Tensor]) -> tuple[int, int, list[tuple[int, int]]]:
        """Split Newton–Schulz on every split matrix, in place in `updates` (segment position ->
        its bf16 update; a segment missing takes no step this time: its matrices run as zeros,
        their results are dropped). Returns the bytes sent and received, and `(matrix, member
        index)` of what this rank computed."""
        moves, like = self.moves, next(iter(updates.values()))
        send = like.new_zeros(moves.send_numel)
        for b, piece, off in moves.pack:
            _copy(send, off, updates.get(self.seg_of[b]), piece.offset, piece.stop - piece.start)
        got, traffic = like.new_empty(0), [0, 0]
        if moves.gather is not None:
            got = like.new_empty(moves.gather.dst_numel[self.world.rank])
            self._run(moves.gather, send, got, 0, traffic, "split Newton–Schulz: blocks to members")
        jobs = []
        for m in self._mine:
            split, group, src = self.plan.splits[m.matrix], self.segs[m.seg].group, updates.get(m.seg)
            if m.received is not None:
                block = got[m.received : m.received + m.numel]
            else:  # held whole here: read and written in place
                block = src[m.at : m.at + m.numel] if src is not None else like.new_zeros(m.numel)
            comm = self.comms[self.plan.groups[m.matrix]]
            jobs.append(
                Job(
                    split,
                    m.member,
                    block.view(-1, split.shape[1]),
                    comm,
                    group["ns_steps"],
                    group["ns_coefficients"],
                    group["eps"],
                )
            )
        outs, gathered = run_split(jobs)
        traffic = [traffic[0] + gathered, traffic[1] + gathered]  # a ring sends what it receives
        out = like.new_empty(moves.result_numel)
        for m, o in zip(self._mine, outs):
            if m.at is None:
                out[moves.result_at[m.block] : moves.result_at[m.block] + o.numel()].copy_(o.reshape(-1))
            else:
                _copy(updates.get(m.seg), m.at, o.reshape(-1), 0, o.numel())
        if moves.scatter is not None:
            back = like.new_empty(moves.back_numel)
            self._run(moves.scatter, out, back, 1, traffic, "split Newton–Schulz: results back")
            for b, piece, off in moves.returned:
                _copy(updates.get(self.seg_of[b]), piece.offset, back, off, piece.stop - piece.start)
        return traffic[0], traffic[1], [(i, j) for i, j, _ in self.mine]

    def _run(
        self, plan, src: torch.Tensor, dst: torch.Tensor, which: int, traffic: list[int], what: str
    ) -> None:
        """`plan` (the gather or the scatter) from `src` into `dst`, its bytes added to `traffic`."""
        program, rank, size = self.moves.programs[which], self.world.rank, src.element_size()
        run_plan(plan, src, dst, self.world, program, what=what)
        traffic[0] += size * (sum(program.send_splits) - program.send_splits[rank])
        traffic[1] += size * (sum(program.recv_splits) - program.recv_splits[rank])


def _copy(dst: torch.Tensor | None, at: int, src: torch.Tensor | None, start: int, n: int) -> None:
    """`dst[at : at + n] = src[start : start + n]`, unless either is missing (a segment not stepping)."""
    if dst is not None and src is not None:
        dst[at : at + n].copy_(src[start : start + n])
