"""What `.grad` holds once a unit's gradients were reduce-scattered into the optimizer's shards."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .unit import Unit

_METADATA = {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.shape.__get__,
    torch.Tensor.ndim.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.layout.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.grad_fn.__get__,
    torch.Tensor.is_sparse.__get__, torch.Tensor.is_floating_point, torch.Tensor.untyped_storage,
    torch.Tensor.data_ptr, torch.Tensor.element_size, torch.Tensor.requires_grad_,
    torch.Tensor.is_leaf.__get__, torch.Tensor.is_cuda.__get__, torch.Tensor.is_meta.__get__,
    torch.Tensor.is_complex,
}  # fmt: skip
_CASTS = {torch.Tensor.to, torch.Tensor.type, torch.Tensor.float, torch.Tensor.double, torch.Tensor.half,
          torch.Tensor.bfloat16, torch.Tensor.cpu, torch.Tensor.cuda}  # fmt: skip


class ReducedGrad(torch.Tensor):
    """What a parameter's `.grad` holds once its unit's gradients were reduce-scattered: the
    gradient exists (`p.grad is not None`, as in torch after backward) but lives in the
    optimizer's shards, so it has the parameter's shape, dtype and device and no values.

    Loss scalers work on it (`torch.amp.GradScaler.unscale_` unscales and checks this
    rank's piece of the shard; `ShardedGradScaler` agrees on infs over ranks), `zero_()`
    zeroes the piece, and casts give a placeholder of the new dtype or device (so
    `model.to(...)` runs; the step then refuses the moved parameter). Anything else that
    would read values raises and says why; assigning a tensor to `.grad` replaces the
    gradient."""

    _unit: Unit
    _index: int

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            return super().__torch_function__(func, types, args, kwargs)
        if func in _CASTS:
            self = args[0]
            probe = func(torch.empty((), dtype=self.dtype, device=self.device), *args[1:], **kwargs)
            return ReducedGrad._of(self._unit, self._index, self.shape, probe.dtype, probe.device)
        if func is torch._has_compatible_shallow_copy_type:
            return False  # so `model.to(...)` assigns the cast placeholder instead of mutating this one
        if func is torch.Tensor.zero_:
            args[0]._piece().zero_()
            return args[0]
        if func is torch._amp_foreach_non_finite_check_and_unscale_:
            grads, found_inf, inv_scale = args
            for g in grads:
                piece = g._piece() if isinstance(g, ReducedGrad) else g
                torch._amp_foreach_non_finite_check_and_unscale_([piece], found_inf, inv_scale)
            return None
        name = getattr(func, "__name__", repr(func))
        raise RuntimeError(
            f"{name}() on a gradient that was reduce-scattered into the optimizer's shards: after "
            "backward, gradients are averaged over ranks and sharded, so .grad holds no values. Use "
            "opt.clip_grad_norm_() to clip; assign a tensor to .grad to replace the gradient"
        )

    def _piece(self) -> torch.Tensor:
        """This rank's elements of the gradient, in the unit's shard (after any reduction)."""
        unit = self._unit
        unit.grads.wait()
        start, stop = unit.full.local_range(self._index)
        return unit.grads.shard[start:stop]

    def __repr__(self) -> str:
        return f"ReducedGrad(shape={tuple(self.shape)}, dtype={self.dtype}: in the optimizer's shards)"

    @staticmethod
    def _of(unit: Unit, i: int, shape, dtype, device) -> ReducedGrad:
        out = torch.empty((), dtype=dtype, device=device).expand(shape).as_subclass(ReducedGrad)
        out._unit, out._index = unit, i
        return out
