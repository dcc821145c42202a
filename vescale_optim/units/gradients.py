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

import contextlib
import math

import torch

from ..shard.collectives import all_reduce_, any_rank
from ..units import Unit
from ..units.reduced_grad import ReducedGrad
from .segment import FROZEN


class GradTrackingMixin:
    """Gradients for `ShardedOptimizer`: marks, the per-step agreement, `zero_grad`, when
    they are reduced (`no_sync`, `no_all_reduce`), clipping and non-finite checks."""

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
        what = "the step's agreement on which parameters step"
        agreed = any_rank(flags, self._world, self._device, what=what)
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

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside keep their gradients unreduced (summed in full buffers);
        the first backward after it, or the step, reduce-scatters everything at once.
        Faster accumulation for more memory; the result is the same."""
        with self._schedule.no_sync():
            yield

    @contextlib.contextmanager
    def no_all_reduce(self):
        """With a `replicate` mesh dimension: backward passes inside reduce-scatter their
        gradients within each shard group as usual but keep them unsynced across replicas;
        the first backward after it, or the step, all-reduces everything across replicas
        once. Fewer bytes across replicas for one extra gradient shard of memory."""
        for u in self._units:
            u.defer_replicas = True
        try:
            yield
        finally:
            for u in self._units:
                u.defer_replicas = False

    def _any_nonfinite(self) -> bool:
        local = any(u.grad_bytes and not torch.isfinite(u.grad).all() for u in self._units)
        return any_rank([local], self._world, self._device, what="the non-finite gradient check")[0]

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the averaged gradient to `max_norm` in `norm_type` norm over all shards.

        Returns the total norm before clipping (the same on every rank, and what
        `torch.nn.utils.clip_grad_norm_` gives on one process with the mean gradient).
        Finishes the gradient reduction here; `step()` does not repeat it.
        """
        self.reduce_gradients()
        norm_type = float(norm_type)
        grads = [u.grad for u in self._units if u.grad_bytes]
        inf = math.isinf(norm_type)
        # summed in float64, so that how parameters are grouped into units does not round it
        f64 = torch.float64
        parts = [g.abs().max().to(f64) if inf else torch.linalg.vector_norm(g, norm_type, dtype=f64)
                 ** norm_type for g in grads]  # fmt: skip
        total = torch.zeros(1, dtype=f64, device=self._device)
        if parts:
            total[0] = torch.stack(parts).max() if inf else torch.stack(parts).sum()
        all_reduce_(total, self._comm, "max" if inf else "sum", what="clip_grad_norm_'s total norm")
        total = (total[0] if inf else total[0] ** (1.0 / norm_type)).float()
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                "so it cannot be clipped. To disable this error and scale the gradients by the "
                "non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total
