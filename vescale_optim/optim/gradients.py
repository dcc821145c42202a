"""Which parameters step, as in torch: those with a gradient (`p.grad is not None`) on
some rank.

Gradients are tracked per parameter: a tensor hook gives a parameter whose `.grad` is
None its (zeroed) view of the bucket's gradient buffer just before autograd
accumulates, so accumulation lands in the buffer; a post-accumulate hook marks it.
`zero_grad(set_to_none=True)` really sets `.grad` to None. At each step one small
all-reduce (max) of every rank's has-a-gradient flags decides who steps; the same
reduction carries a flag for problems found before anything is modified (parameters
moved or cast after construction, unfrozen, or a state-shaping hyperparameter changed),
so every rank refuses together instead of hanging.
"""

from __future__ import annotations

import weakref
from functools import partial

import torch

from ..shard import all_reduce_


class GradTrackingMixin:
    """Gradient tracking, the per-step agreement and `zero_grad` for `ShardedOptimizer`."""

    def _install_hooks(self) -> None:
        """Before autograd accumulates into a parameter whose `.grad` is None, give it its
        (zeroed) view of the gradient buffer; after, mark it as having a gradient."""
        ref, handles = weakref.ref(self), []
        for k, b in enumerate(self._buckets):
            for i, p in enumerate(b.params):
                handles.append(p.register_hook(partial(_attach_grad_view, ref, k, i)))
                handles.append(p.register_post_accumulate_grad_hook(partial(_mark_grad, ref, k, i)))
        weakref.finalize(self, _remove_hooks, handles)

    def _step_problem(self) -> str | None:
        """Why this rank cannot step (nothing is modified to find out)."""
        for b in self._buckets:
            dtype, device = b.pbuf.data.dtype, b.pbuf.data.device
            for i, p in enumerate(b.params):
                if p.dtype != dtype or p.device != device or p.shape != b.gviews[i].shape:
                    return (
                        f"parameter {self._labels[id(p)]} is now {p.dtype} on {p.device}, shape "
                        f"{tuple(p.shape)}, but the optimizer holds it as {dtype} on {device}: it was "
                        "moved or cast after the optimizer was built (model.double(), .half(), .to(...)); "
                        "move the model first, then build the optimizer"
                    )
        for p in self._frozen:
            if p.requires_grad or p.grad is not None:
                now = "requires grad" if p.requires_grad else "has a gradient"
                return (
                    f"parameter {self._labels[id(p)]} was frozen (requires_grad=False) when the optimizer "
                    f"was built, so it has no place in its buffers, but now {now}; build the optimizer "
                    "with it trainable (freezing it later is fine)"
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
    def _agree(self) -> None:
        """One all-reduce (max) over every rank's has-a-gradient flags (and a problem flag):
        a parameter steps iff some rank has a gradient for it."""
        problem = self._step_problem()
        has = [p.grad is not None for b in self._buckets for p in b.params]
        flags = torch.tensor([*has, problem is not None], dtype=torch.float32, device=self._device)
        all_reduce_(flags, self._comm, "max")
        agreed = [x > 0 for x in flags.tolist()]
        if problem is not None:
            raise RuntimeError(problem)
        if agreed[-1]:
            raise RuntimeError(
                "step refused: another rank found a problem with its parameters (see that rank's error)"
            )
        pos = 0
        for b in self._buckets:
            active = agreed[pos : pos + len(b.params)]
            pos += len(b.params)
            b.active = [True] * len(active) if self._whole_buckets and any(active) else active

    def _reattach(self) -> None:
        """Bring parameters and gradients back into the buffers: a tensor assigned to
        `.data` (same dtype and shape) or to `.grad` is copied in; a missing gradient
        counts as zero in the mean."""
        for b in self._buckets:
            for i, p in enumerate(b.params):
                view = b.pviews[i]
                if p.data_ptr() != view.data_ptr():
                    view.copy_(p.detach())
                    p.data = view
                gview = b.gviews[i]
                if p.grad is None:
                    gview.zero_()
                    b.marked[i] = False
                    continue
                if p.grad.data_ptr() != gview.data_ptr():
                    gview.copy_(p.grad)
                    p.grad = gview
                b.marked[i] = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch: `set_to_none=True` sets every `.grad` to None (autograd's next
        accumulation lands in the gradient buffer again); `set_to_none=False` zeroes the
        gradients that exist, which then take the next step with a zero gradient."""
        for b in self._buckets:
            if set_to_none:
                for p in b.params:
                    p.grad = None
                b.marked = [False] * len(b.params)
                continue
            b.gbuf.data.zero_()
            for i, p in enumerate(b.params):
                g = p.grad
                if g is not None and g.data_ptr() != b.gviews[i].data_ptr():
                    if g.dtype == b.gviews[i].dtype and g.device == b.gviews[i].device:
                        p.grad = b.gviews[i]
                    else:
                        g.zero_()
        for p in self._frozen:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        self._grads_reduced = False


def _attach_grad_view(ref, k: int, i: int, grad: torch.Tensor) -> None:
    opt = ref()
    if opt is None or opt._buckets is None:
        return
    b = opt._buckets[k]
    p, view = b.params[i], b.gviews[i]
    if p.grad is None and p.dtype == view.dtype and p.device == view.device and p.shape == view.shape:
        view.zero_()
        p.grad = view


def _mark_grad(ref, k: int, i: int, p: torch.Tensor) -> None:
    opt = ref()
    if opt is not None and opt._buckets is not None:
        opt._buckets[k].marked[i] = True


def _remove_hooks(handles) -> None:
    for h in handles:
        h.remove()
