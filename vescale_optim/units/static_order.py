"""The fixed order of reductions not tied to a module's backward.

Units without module hooks (the buckets of no `shard_modules`, the outermost unit, a module
whose inputs need no gradient) reduce as soon as their own gradients are complete, but
every rank must issue their reduce-scatters in one order. The first backward learns it:
they reduce together at its end, in backward's usual order (descending index), and each
records when it completed; `settle()` then takes rank 0's order of completion for every
later backward, where each reduces once it and every unit before it are complete.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..shard.collectives import all_gather_object
from .unit import Unit


class StaticOrder:
    """The order (`units`) of the reductions without a module trigger, learned then fixed."""

    def __init__(self, units: Sequence[Unit]):
        self.units = sorted(units, key=lambda u: -u.index)  # backward's usual order until settled
        self.settled = False
        self._completed: list[Unit] = []  # in the order they completed, first backward

    def add(self, unit: Unit) -> None:
        """`unit` turned out to need watching (its module's inputs need no gradient)."""
        if unit not in self.units:
            self.units.append(unit)
            self.settled = False

    def due(
        self,
        unit: Unit,
        waiting: Callable[[Unit], bool],
        complete: Callable[[Unit], bool],
        trainable: Callable[[Unit], bool],
    ) -> list[Unit]:
        """`unit`'s gradients are complete: the units to reduce now, in order. `waiting(u)`:
        `u` still has to reduce in this round; `complete(u)`: its gradients arrived."""
        if not self.settled:  # learning: all together once all are complete, as every later backward
            if unit not in self._completed:
                self._completed.append(unit)
            rest = [u for u in self.units if waiting(u)]
            return rest if all(complete(u) or not trainable(u) for u in rest) else []
        due = []
        for u in self.units:
            if not waiting(u):
                continue
            if trainable(u) and not complete(u):
                break
            due.append(u)
        return due

    def rest(self, units: Sequence[Unit]) -> list[Unit]:
        """Every unit in the order a round's unfinished reductions are issued (the same on
        every rank): these first, then the rest by descending index."""
        others = sorted((u for u in units if u not in self.units), key=lambda u: -u.index)
        return self.units + others

    def settle(self, comm) -> None:
        """Take rank 0's order of completion (collective over `comm`: one order in every
        replica too, so their all-reduces pair up)."""
        order = all_gather_object([u.index for u in self._completed], comm)[0]
        by_index = {u.index: u for u in self.units}
        ranked = [by_index[i] for i in order if i in by_index]
        self.units = ranked + [u for u in self.units if u not in ranked]
        self.settled = True
