"""Initialise a model built on the meta device one unit at a time.

Modules are visited in the outermost module's `modules()` order (the order a model usually builds them),
each calling its own `reset_parameters()` into its unit's unsharded buffer; once every
module of a unit is done, the rank keeps its shard and frees the buffer, so the peak is
about one unit (plus the outermost one, whose modules come first and last). A parameter
that a module shares with an earlier one (a tied head) keeps the earlier module's
values, as when the tie is made after building. Every rank draws from rank 0's random
state, so they agree, and the result equals the model built normally under that state;
the callers' own random states are left as they were.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..shard.collectives import broadcast_
from .assign import module_order
from .unit import Unit


def _rank0_rng_state(unit: Unit, device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    for state in states:
        broadcast_(state, 0, unit.world)
    return states


def materialize(units: Sequence[Unit], modules: Sequence[nn.Module]) -> None:
    """Initialise every parameter of `units` (the units of `modules`) that was on the meta
    device."""
    owner: dict[int, tuple[Unit, int]] = {}
    for unit in units:
        if unit.meta:
            for i, p in enumerate(unit.params):
                owner[id(p)] = (unit, i)
    if not owner:
        return
    plan: list[tuple[nn.Module, list[tuple[Unit, int]]]] = []
    remaining: dict[int, int] = {}
    for module in module_order(modules):
        mine = [owner[id(p)] for p in module.parameters(recurse=False) if id(p) in owner]
        if not mine:
            continue
        if not hasattr(module, "reset_parameters"):
            name = type(module).__name__
            raise ValueError(f"a {name} holds parameters on the meta device but has no reset_parameters()")
        plan.append((module, mine))
        for unit, _ in mine:
            remaining[unit.index] = remaining.get(unit.index, 0) + 1
    device = units[0].device
    states = _rank0_rng_state(units[0], device)
    done: set[int] = set()  # parameters initialised so far (by id)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        torch.set_rng_state(states[0])
        if device.type == "cuda":
            torch.cuda.set_rng_state(states[1], device)
        for module, mine in plan:
            for unit, _ in mine:
                unit.open_empty()
            for name, buf in module.named_buffers(recurse=False):
                if buf.is_meta:
                    setattr(module, name, torch.empty_like(buf, device=device))
            kept = [(unit.params[i], unit.params[i].detach().clone()) for unit, i in mine
                    if id(unit.params[i]) in done]  # fmt: skip
            module.reset_parameters()
            for p, value in kept:
                p.copy_(value)
            done.update(id(unit.params[i]) for unit, i in mine)
            for unit, _ in mine:
                remaining[unit.index] -= 1
                if remaining[unit.index] == 0:
                    unit.adopt_full()
