"""The gradient reductions of a round: one reduce-scatter in flight, the one place that runs them.

A unit's reduction has two steps (its `GradBuffers`): the reduce-scatter over the shard
group, then (HSDP) the all-reduce of the shard across replicas, issued once the first is
waited for. In backward one reduce-scatter is in flight at a time: before the next
collective of backward is issued, the one in flight is waited for (its unreduced buffer
freed) and its all-reduce across replicas started, to run on while backward goes on.
`drain()` is the step's end of the same pipeline: the units some rank still holds
unreduced gradients for are reduced together, then every all-reduce across replicas is
issued and every reduction waited for, so the step finds complete shards.
"""

from __future__ import annotations

from collections.abc import Sequence

from .unit import Unit


class ReductionPipeline:
    """Reductions of `units`: which reduced in this round, and the one in flight."""

    def __init__(self, units: Sequence[Unit]):
        self.units = list(units)
        self.sync_grads = True  # False under `no_sync()`: backward keeps full gradients
        self.reduced: set[int] = set()  # indices of the units reduced in this round
        self._in_flight: Unit | None = None  # the unit whose reduce-scatter is not waited for

    def issue(self, unit: Unit) -> None:
        """Reduce-scatter `unit`'s gradients (the caller has advanced the one in flight)."""
        unit.grads.reduce(async_op=True)
        self._in_flight = unit

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
        self.reduced.clear()
