"""The gradient reductions of a round: one reduce-scatter in flight, the one place that runs them.

A unit's reduction has two steps (its `GradBuffers`): the reduce-scatter over the shard
group, then (HSDP) the all-reduce of the shard across replicas, issued once the first is
waited for. In backward one reduce-scatter is in flight at a time: before the next
reduce-scatter is issued, the one in flight is waited for (its unreduced buffer freed) and
its all-reduce across replicas started, to run on while backward goes on. Gathers do not
wait for it (the schedule's prefetch runs beside it).
`drain()` is the step's end of the same pipeline: the units some rank still holds
unreduced gradients for are reduced together, then every all-reduce across replicas is
issued and every reduction waited for, so the step finds complete shards.

Every rank must reduce in the same backward passes: `with opt.no_sync():` on some ranks only
would leave the others' reduce-scatters unmatched (gloo aborts the process, NCCL hangs, and a
later collective may pair with the orphan). So the ranks agree on it before any reduce-scatter
of a round (a backward, or the forwards and backwards that end in one reduction of each unit)
is issued: one small all-reduce of which ranks reduce, issued at the round's first backward
event (`issue_agreement`), and read back at its first reduction (`settle`), before that
reduction is issued or skipped, on every rank alike. On a mismatch no rank issues the
reduce-scatter and every rank raises `NoSyncMismatchError` there, in backward, whatever it
does next (a `loss.item()`, the next micro-batch): nothing is left for the group to match, so
it goes on. The read is a host sync, the one in backward, and only with a group that talks:
on a GPU the host waits there for that all-reduce alone (issued when backward started, behind
the forward), while the device still has the first unit's backward queued.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..shard.collectives import Comm
from ..shard.flags import any_rank_issued
from .unit import Unit


class NoSyncMismatchError(RuntimeError):
    """Some ranks ran a backward inside `no_sync()` and others did not."""


class ReductionPipeline:
    """Reductions of `units`: which reduced in this round, and the one in flight."""

    def __init__(self, units: Sequence[Unit], microbatches: int = 1):
        self.units = list(units)
        self.sync_grads = True  # False under `no_sync()`: backward keeps full gradients
        self.microbatches = microbatches  # rounds per step; the last one reduces
        self.rounds = 1  # the rounds opened since the step, this one included
        self.reduced: set[int] = set()  # indices of the units reduced in this round
        self._in_flight: Unit | None = None  # the unit whose reduce-scatter is not waited for
        self._agreement: tuple[Callable[[], list[bool]], Comm] | None = None  # issued, not read
        self._issued = False  # this round's agreement on no_sync() was issued

    @property
    def reduces(self) -> bool:
        """Whether this round reduces: outside `no_sync()`, and its step's last micro-batch (or
        a later one)."""
        return self.sync_grads and self.rounds >= self.microbatches

    def issue(self, unit: Unit) -> None:
        """Reduce-scatter `unit`'s gradients (the caller has advanced the one in flight and
        settled the round's agreement)."""
        unit.grads.reduce(async_op=True)
        self._in_flight = unit

    def issue_agreement(self, world: Comm) -> None:
        """The round's first backward event: issue the ranks' agreement on whether it reduces
        (see the module's docstring; once a round). Rank r sets flag r if it reduces, flag
        W + r if not."""
        if self._issued or not world.active:
            return
        self._issued = True
        size = world.world_size
        flags = [False] * (2 * size)
        flags[world.rank if self.reduces else size + world.rank] = True
        self._agreement = (any_rank_issued(flags, world, what="the agreement on no_sync()"), world)

    def settle(self, world: Comm) -> None:
        """A reduction of the round, before it is issued or skipped: read the round's
        agreement if it is not read yet (issued now if no backward event came first) and
        raise on every rank if some ranks reduce and others do not."""
        self.issue_agreement(world)
        self.verify()

    def verify(self) -> None:
        """Read the agreement issued and not read yet, if any (the step's, or a new round's,
        for a round that reduced nothing), and raise on every rank if some ranks reduce and
        others do not."""
        if self._agreement is None:
            return
        (read, world), self._agreement = self._agreement, None
        flags, size = read(), world.world_size
        reduce = [r for r in range(size) if flags[r]]
        skip = [r for r in range(size) if flags[size + r]]
        if reduce and skip:
            raise NoSyncMismatchError(
                f"ranks {skip} ran a backward inside `with opt.no_sync():` and ranks {reduce} did not; "
                "use no_sync() for the same backward passes on every rank (nothing was reduced or stepped)"
            )

    def advance(self) -> None:
        """Wait for the reduce-scatter in flight and start its all-reduce across replicas."""
        if self._in_flight is not None:
            self._in_flight.grads.advance()
            self._in_flight = None

    def wait_all(self) -> None:
        """Wait for every reduction issued (and the all-reduces across replicas they start)."""
        self.advance()
        for unit in self.units:
            unit.grads.wait()

    def drain(self, pending: Sequence[Unit]) -> None:
        """The step's reductions: reduce `pending` (every rank the same units, in order), then
        finish every unit's reduction across replicas and wait for all of them."""
        for unit in pending:
            unit.grads.reduce(async_op=True)
        for unit in pending:
            unit.grads.advance()
        for unit in self.units:
            unit.grads.sync_replicas()
            unit.grads.advance()
        for unit in self.units:
            unit.grads.wait()

    def new_round(self) -> None:
        """A round opens: the last one's agreement, if it was never settled, is read first."""
        self.verify()
        self.reduced.clear()
        self._issued = False
        self.rounds += 1
