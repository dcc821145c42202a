"""`with opt.gathered():` — whole parameters outside forward and backward (FSDP1's
`summon_full_params`, DeepSpeed's `GatheredParameters`).

Inside, every selected unit is gathered and held (a forward inside does not free it);
on exit, what was written in place lands in the shards (and the fp32 masters), then the
sharded units are freed again. Only values that changed are taken into a separate
shard (a bf16 parameter over an fp32 master, an 8-bit gather): an unwritten master keeps
its full precision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from .schedule import Schedule
from .unit import State, Unit


def _selected(units: Sequence[Unit], modules: nn.Module | Iterable[nn.Module] | None) -> list[Unit]:
    """The units holding a parameter of `modules` (all of them for None)."""
    if modules is None:
        return list(units)
    if isinstance(modules, nn.Module):
        modules = [modules]
    wanted = {id(p) for m in modules for p in m.parameters()}
    return [u for u in units if any(id(p) in wanted for p in u.params)]


@contextlib.contextmanager
def gathered(
    units: Sequence[Unit],
    schedule: Schedule,
    modules: nn.Module | Iterable[nn.Module] | None = None,
    writeback: bool = True,
) -> Iterator[None]:
    """Whole parameters of `units` (those of `modules`, if given) inside; collective.

    Every rank must enter it, with the same `modules`, and write the same values (the
    writes of every rank's own piece are kept; a write that differs between ranks leaves
    the ranks' parameters different). `writeback=False` discards in-place writes. Memory:
    the selected sharded units' full parameters at once, in the compute dtype (plus, for
    `writeback=False` on units that keep whole parameters, a copy of their shards)."""
    busy = schedule.unfinished_forward()
    if busy is not None:
        raise RuntimeError(f"opt.gathered() inside the forward of units {busy}; enter it between steps")
    chosen = _selected(units, modules)
    meta = [u.name for u in chosen if u.meta]
    if meta:
        raise RuntimeError(f"opt.gathered(): units {meta} are still on the meta device (not initialised)")
    schedule.wait_reductions()
    opened = [u for u in chosen if u.state is not State.GATHERED]
    with torch.no_grad():
        for u in opened:
            u.unshard(async_op=True)  # issued together, waited in order
        saved = [u.shard.clone() if not writeback and not u.sharded else None for u in chosen]
    for u in chosen:
        u.wait_unshard()
        u.hold()
    try:
        yield
    finally:
        with torch.no_grad():
            for u, kept in zip(chosen, saved):
                u.release()
                if writeback:
                    u.write_back()
                elif kept is not None:  # whole parameters everywhere: back to the shard's values
                    u.shard.copy_(kept)
                    u.gather_after_step()
                elif u not in opened:  # gathered before: its values again
                    u.regather()
                if u in opened:
                    u.reshard()
