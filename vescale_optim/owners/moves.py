"""The phased part of a step, for math that needs whole matrices or tiles on one rank.

A segment whose update needs more than its own elements returns a `Move` from
`_update`: this rank's pieces travel to their owners, are computed on there, and the
results travel back. `run_moves` runs the moves of every segment of a step together,
so the communication of one overlaps the computation of another:

    issue every gather -> local work of every move -> for each move: wait, compute,
    issue its scatter -> for each move: wait, finish
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from ..shard.collectives import Comm, run_plan
from ..shard.redistribution import Plan, RankProgram


def _nothing() -> None:
    return None


@dataclass
class Move:
    """One segment's round trip. `src` (this rank's pieces, in `gather`'s source layout)
    goes to the owners; `local()` runs meanwhile on what this rank already holds whole;
    `compute(received)` runs on what arrived and returns what goes back by `scatter` into
    `dst` (no `scatter`: nothing goes back); `finish()` applies the result."""

    gather: Plan
    src: torch.Tensor
    compute: Callable[[torch.Tensor], torch.Tensor | None]
    finish: Callable[[], None]
    scatter: Plan | None = None
    dst: torch.Tensor | None = None
    local: Callable[[], None] = _nothing
    programs: tuple[RankProgram, RankProgram | None] | None = None
    label: str = "compute"
    _received: torch.Tensor | None = field(default=None, repr=False)


def _programs(m: Move, rank: int) -> tuple[RankProgram, RankProgram | None]:
    """`rank`'s programs of `m`'s gather and scatter (none for a move that returns nothing)."""
    return m.gather.program(rank), m.scatter.program(rank) if m.scatter else None


def run_moves(moves: Sequence[Move], comm: Comm) -> tuple[int, int]:
    """Run `moves` with their communication overlapped (see the module's docstring); return
    the bytes this rank sent to and received from other ranks."""
    rank = comm.rank
    programs = [m.programs or _programs(m, rank) for m in moves]
    sent = received = 0
    for m, pair in zip(moves, programs):
        size = m.src.element_size()
        for p in pair:
            if p is not None:
                sent += size * (sum(p.send_splits) - p.send_splits[rank])
                received += size * (sum(p.recv_splits) - p.recv_splits[rank])
    with record_function("vescale_optim.moves.gather"):
        gathers = []
        for m, (gp, _) in zip(moves, programs):
            m._received = m.src.new_empty(m.gather.dst_numel[rank])
            what = f"{m.label}: gather to owners"
            gathers.append(run_plan(m.gather, m.src, m._received, comm, gp, async_op=True, what=what))
    for m in moves:
        with record_function(f"vescale_optim.{m.label}"):
            m.local()
    scatters = []
    for m, (_, sp), handle in zip(moves, programs, gathers):
        handle.wait()
        with record_function(f"vescale_optim.{m.label}"):
            out = m.compute(m._received)
        if m.scatter is not None:
            what = f"{m.label}: scatter from owners"
            scatters.append(run_plan(m.scatter, out, m.dst, comm, sp, async_op=True, what=what))
        else:
            scatters.append(None)
    with record_function("vescale_optim.moves.finish"):
        for m, handle in zip(moves, scatters):
            if handle is not None:
                handle.wait()
            m._received = None
            m.finish()
    return sent, received
