"""`opt.step_stats`: what one step did on this rank, refreshed by every step.

The base counts the common statistics (the bytes of the step's own collectives and of the
units' gathers and reductions since the previous step); each optimizer class names the ones
it counts itself (`step_stat_names`: Muon's Newton–Schulz work, Shampoo's roots), registered
here as the class is defined. Every optimizer reports every registered name, 0 where it
counts none, so the step statistics of AdamW, Muon and Shampoo have the same keys.
"""

from __future__ import annotations

from collections.abc import Iterable

COMMON = ("bytes_sent", "bytes_received", "gather_bytes", "reduce_bytes")
_REGISTERED: dict[str, None] = {}  # in the order the optimizer classes were defined


def register(names: Iterable[str]) -> None:
    """Add an optimizer class's own statistics to every optimizer's `step_stats`."""
    _REGISTERED.update(dict.fromkeys(names))


def fresh() -> dict[str, int]:
    """Zero statistics for a new step: the registered names, then the common ones."""
    return dict.fromkeys((*_REGISTERED, *COMMON), 0)
