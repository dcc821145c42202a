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
would leave the others' reduce-scatters unmatched (gloo aborts the process, NCCL hangs).
So each backward starts with the ranks' agreement on it (`check_sync`: one small all-reduce
of which ranks reduce, issued before that backward's first reduction), read back before any
reduction is waited for on gloo, where the host waits anyway, and at the step on CUDA, so no
host sync falls in backward: a mismatch raises `NoSyncMismatchError` on every rank, the
parameters untouched.
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

    def __init__(self, units: Sequence[Unit]):
        self.units = list(units)
        self.sync_grads = True  # False under `no_sync()`: backward keeps full gradients
        self.reduced: set[int] = set()  # indices of the units reduced in this round
        self._in_flight: Unit | None = None  # the unit whose reduce-scatter is not waited for
        self._checks: list[tuple[Callable[[], list[bool]], Comm]] = []  # agreements not yet read

    def issue(self, unit: Unit) -> None:
        """Reduce-scatter `unit`'s gradients (the caller has advanced the one in flight)."""
        unit.grads.reduce(async_op=True)
        self._in_flight = unit

    def check_sync(self, world: Comm) -> None:
        """A backward starts: issue the ranks' agreement on whether it reduces (see the
        module's docstring). Rank r sets flag r if it reduces, flag W + r if not."""
        if not world.active:
            return
        size = world.world_size
        flags = [False] * (2 * size)
        flags[world.rank if self.sync_grads else size + world.rank] = True
        self._checks.append((any_rank_issued(flags, world, what="the agreement on no_sync()"), world))

    def verify(self, in_backward: bool = False) -> None:
        """Read the agreements issued (in backward only where the host waits anyway: not on
        CUDA) and raise on every rank if some ranks reduce and others do not."""
        while self._checks and not (in_backward and self._checks[0][1].device.type == "cuda"):
            read, world = self._checks.pop(0)
            flags, size = read(), world.world_size
            reduce = [r for r in range(size) if flags[r]]
            skip = [r for r in range(size) if flags[size + r]]
            if reduce and skip:
                self._checks.clear()
                raise NoSyncMismatchError(
                    f"ranks {skip} ran a backward inside `with opt.no_sync():` and ranks {reduce} did not; "
                    "use no_sync() for the same backward passes on every rank (nothing was stepped)"
                )

    def advance(self) -> None:
        """Wait for the reduce-scatter in flight and start its all-reduce across replicas."""
        if self._in_flight is not None:
            self.verify(in_backward=True)  # first: it may be a reduction no other rank joins
            self._in_flight.grads.advance()
            self._in_flight = None

    def wait_all(self) -> None:
        """Wait for every reduction issued (and the all-reduces across replicas they start)."""
        self.verify(in_backward=True)
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
        self.reduced.clear()
