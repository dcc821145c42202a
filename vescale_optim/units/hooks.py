"""The autograd pieces the schedule hooks into modules with: finding tensors in a module's
arguments, a callback once a module's backward is done, and counting a unit's gradient
arrivals when no module tells when they are done."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch.autograd.graph import register_multi_grad_hook


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj):
    """`obj` with `fn` applied to every tensor inside nested tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple
        return type(obj)(*(map_tensors(fn, x) for x in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(map_tensors(fn, x) for x in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    return obj


def tensors_in(obj) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    map_tensors(lambda t: found.append(t) or t, obj)
    return found


class PostBackward(torch.autograd.Function):
    """Identity on a module's inputs whose backward runs once the module's backward is
    done (every gradient of its inputs is computed)."""

    @staticmethod
    def forward(ctx, callback, *inputs):
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


class Arrivals:
    """Calls `on_done` once every parameter of `params` that takes part in a backward has
    had its gradient accumulated.

    The first backward learns which take part from a multi-grad hook, which holds every
    incoming gradient until the last arrives; later backward passes count arrivals of those
    parameters and hold nothing. (A parameter that stops taking part leaves the unit for
    `finish()` to reduce; one that starts is reduced after the rest, at the step.)"""

    def __init__(self, params: Sequence[torch.Tensor], on_done: Callable[[], None]):
        self.params = list(params)
        self.expected: set[int] | None = None  # ids of the parameters that take part
        self.arrived: set[int] = set()
        self.on_done = on_done
        self.handle = register_multi_grad_hook(self.params, self._learn, mode="all")

    def _learn(self, grads) -> None:
        if self.expected is None:
            self.expected = {id(p) for p, g in zip(self.params, grads) if g is not None}
            self._check()

    def arrive(self, p: torch.Tensor) -> None:
        self.arrived.add(id(p))
        self._check()

    def reset(self) -> None:
        """A new round: forget arrivals; once learned, drop the multi-grad hook."""
        self.arrived = set()
        if self.expected is not None and self.handle is not None:
            self.handle.remove()
            self.handle = None

    def _check(self) -> None:
        if self.expected is not None and self.expected <= self.arrived:
            self.arrived = set()
            self.on_done()
