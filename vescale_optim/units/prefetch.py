"""Which unit to gather next, and when: the orders forward and backward run units in.

Forward gathers the unit after the one starting, in the order units first ran (issued
before that unit's compute is queued). Backward runs units in the reverse order of the last
forward's post-hooks; the unit before the one computing is gathered as that one's backward
starts (FSDP2's pre-backward prefetch). Issued later, half-way through the unit's gradients as
it once was to spare the memory of the backward's start, the gather waits on its stream for the
compute the host queued before it: on an H200 it started after the unit's last kernel and
hid nothing (`benchmarks/gpu_check.py`'s overlap stage). A unit whose module holds other
units' (the model around its blocks) gets gradients before and after theirs: there the
prefetch follows its first gradient. Until then the prefetch is *deferred*; any other collective of
backward issues it first, so the order of collectives never depends on how far the unit
computing got.
"""

from __future__ import annotations

from .unit import State, Unit


def after(order: list[Unit], unit: Unit) -> Unit | None:
    """The unit after `unit` in `order`, if it is to be gathered (it is resharded)."""
    if unit in order:
        k = order.index(unit) + 1
        if k < len(order) and order[k].state is State.RESHARDED:
            return order[k]
    return None


class Prefetcher:
    """The recorded orders and backward's deferred prefetch (`backward_prefetch=False`: none)."""

    def __init__(self, backward_prefetch: bool = True):
        self.backward_prefetch = backward_prefetch
        self.forward_order: list[Unit] = []  # pre-forward order, recorded as units first run
        self.backward_order: list[Unit] = []  # reverse post-forward order of the last forward
        self._post_forward_seen: list[Unit] = []
        self._deferred: Unit | None = None  # the unit backward prefetches next
        self._computing: Unit | None = None  # ... once this unit has accumulated
        self._awaited = 0  # this many more gradient elements

    def forward_starts(self, unit: Unit) -> Unit | None:
        """`unit`'s forward starts: the unit to gather now, before its compute is queued."""
        if unit not in self.forward_order:
            self.forward_order.append(unit)
        return after(self.forward_order, unit)

    def forward_ends(self, unit: Unit, outermost: bool) -> None:
        """`unit`'s forward ended; the outermost module's end fixes backward's order."""
        if unit in self._post_forward_seen:
            self._post_forward_seen.remove(unit)
        self._post_forward_seen.append(unit)
        if outermost:
            self.backward_order = list(reversed(self._post_forward_seen))
            self._post_forward_seen = []

    def backward_starts(self, unit: Unit, encloses: bool) -> bool:
        """`unit`'s backward starts: defer gathering the unit before it until `unit` has
        accumulated enough (see the module's docstring). Returns whether it is due at once."""
        following = after(self.backward_order, unit) if self.backward_prefetch else None
        if following is None:
            return False
        numel = sum(p.numel() for p in unit.params if p.requires_grad)
        awaited = min(numel, 1) if encloses else 0
        self._deferred = following
        if not awaited:
            return True
        self._computing, self._awaited = unit, awaited
        return False

    def accumulated(self, unit: Unit, numel: int) -> bool:
        """`numel` gradient elements of `unit` arrived: whether the deferred prefetch is due."""
        if self._computing is not unit:
            return False
        self._awaited -= numel
        return self._awaited <= 0

    @property
    def deferred(self) -> bool:
        return self._deferred is not None

    def take(self) -> Unit | None:
        """The deferred unit to gather now, if any (it is no longer deferred)."""
        unit, self._deferred = self._deferred, None
        if unit is not None:
            self._computing, self._awaited = None, 0
        return unit
