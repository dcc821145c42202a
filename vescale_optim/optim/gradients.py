"""Which parameters step, as in torch: those with a gradient on some rank.

A parameter is *marked* when autograd accumulates its gradient (a post-accumulate hook,
installed by the units' schedule) or when a `.grad` set by hand is taken in at the step;
`zero_grad(set_to_none=True)` clears the marks. At each step one small all-reduce (max)
of every rank's marks decides who steps. The same reduction says which units still
hold unreduced gradients on some rank (accumulated under `no_sync()`, or set by hand),
so every rank reduce-scatters the same units, and carries a flag for problems found
before anything is modified (parameters moved or cast after construction, unfrozen, a
unit still in its forward, a state-shaping hyperparameter changed): every rank refuses
together instead of hanging.
"""

from __future__ import annotations

import torch

from ..shard import all_reduce_
from ..units import Unit
from ..units.unit import ReducedGrad
from .segment import FROZEN


class GradTrackingMixin:
    """Gradient marks, the per-step agreement and `zero_grad` for `ShardedOptimizer`."""

    def _mark(self, p: torch.Tensor) -> None:
        where = self._where.get(id(p))
        if where is not None:
            where[0].marked[where[1]] = True

    def _step_problem(self) -> str | None:
        """Why this rank cannot step (nothing is modified to find out)."""
        busy = self._schedule.unfinished_forward()
        if busy is not None:
            return (
                f"step() while units {busy} are still gathered by a forward that has not finished; "
                "finish the forward (and its backward) before stepping"
            )
        for u in self._units:
            for i, p in enumerate(u.params):
                if p.dtype != u.compute_dtype or p.device != u.device or p.shape != u.full.shapes[i]:
                    return (
                        f"parameter {self._labels[id(p)]} is now {p.dtype} on {p.device}, shape "
                        f"{tuple(p.shape)}, but the optimizer holds it as {u.compute_dtype} on {u.device}: "
                        "it was moved or cast after the optimizer was built (model.double(), .half(), "
                        ".to(...)); move the model first, then build the optimizer"
                    )
        for seg in self._segments:
            if seg.tier != FROZEN:
                continue
            for i, p in enumerate(seg.params):
                if p.requires_grad or seg.marked[i]:
                    now = "requires grad" if p.requires_grad else "has a gradient"
                    return (
                        f"parameter {self._labels[id(p)]} was frozen (requires_grad=False) when the "
                        f"optimizer was built, so it has no optimizer state, but now {now}; build the "
                        "optimizer with it trainable (freezing it later is fine)"
                    )
        for gi, (g, fixed) in enumerate(zip(self.param_groups, self._structure)):
            for key, value in fixed.items():
                if g.get(key) != value:
                    return (
                        f"param group {gi}: '{key}' changed from {value!r} to {g.get(key)!r} after "
                        "construction; it shapes the optimizer state, so it is fixed"
                    )
            problem = self._check_group(gi, g)
            if problem:
                return problem
        return None

    @torch.no_grad()
    def _agree(self) -> list[Unit]:
        """One all-reduce (max) over every rank's marks, unreduced units and a problem flag:
        a parameter steps iff some rank has a gradient for it. Returns the units that some
        rank still has unreduced gradients for (every rank reduces those, in order)."""
        problem = self._step_problem()
        marks = [m for seg in self._segments for m in seg.marked]
        unreduced = [u.has_full_grad for u in self._units]
        flags = [*marks, *unreduced, problem is not None]
        flags = torch.tensor(flags, dtype=torch.float32, device=self._device)
        all_reduce_(flags, self._world, "max")
        agreed = [x > 0 for x in flags.tolist()]
        if problem is not None:
            raise RuntimeError(problem)
        if agreed[-1]:
            raise RuntimeError(
                "step refused: another rank found a problem with its parameters (see that rank's error)"
            )
        pos = 0
        for seg in self._segments:
            active = agreed[pos : pos + len(seg.params)]
            pos += len(seg.params)
            if seg.tier == FROZEN:
                active = [False] * len(active)
            seg.active = active
        return [u for u, f in zip(self._units, agreed[pos : pos + len(self._units)]) if f]

    def _reattach(self) -> None:
        """Bring what was set by hand into the units: a tensor assigned to `.data` (same
        dtype and shape) is written into the parameter's shard; one assigned to `.grad`
        replaces the parameter's gradient (and marks it); `.grad = None` unmarks it, as
        torch then skips the parameter. Moved or cast parameters are left for
        `_step_problem` to report."""
        for u in self._units:
            for i, p in enumerate(u.params):
                if p.dtype != u.compute_dtype or p.device != u.device or p.shape != u.full.shapes[i]:
                    continue
                view = u.views[i]
                if p.data_ptr() != view.data_ptr() and not u.holds_stand_in(i):
                    u.write_param(i, p.detach())
                    p.data = view
                g = p.grad
                if g is None:
                    seg, j = self._where[id(p)]
                    seg.marked[j] = False
                elif not isinstance(g, ReducedGrad) and not u.is_live_grad(i) and g.device == view.device:
                    u.take_grad(i, g)
                    self._mark(p)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every gradient, as torch: `set_to_none=True` sets every `.grad` to None (a
        parameter that then gets no gradient takes no step); `set_to_none=False` keeps the
        gradients that exist, zeroed (those parameters step with a zero gradient).

        Gradients live in the units' shards once reduce-scattered, where a parameter's
        `.grad` is a `ReducedGrad` placeholder; zeroing zeroes the shards."""
        self._schedule.wait_reductions()
        for u in self._units:
            u.clear_grad(set_to_none)
        if set_to_none:
            for seg in self._segments:
                seg.marked = [False] * len(seg.params)
        self._grads_reduced = False
