"""What `.grad` holds once a unit's gradients were reduce-scattered into the optimizer's shards,
and what torch's gradient utilities compute on it.

Over a process group a parameter's averaged gradient lives in the ranks' shards, each rank
holding one contiguous flat piece of it (the unit's RaggedShard layout), so `.grad` is a
`ReducedGrad`: a tensor with the parameter's shape, dtype and device whose values are the
pieces. Through `__torch_function__` it supports what gradient utilities and training scripts
do with gradients, computed on the pieces, the same way DTensor's `Partial` placement works
for FSDP2:

- element-wise ops (`mul_`, `div_`, `clamp_`, `add_`, `zero_`, `nan_to_num_`, `abs`,
  `isfinite`, the `_foreach_` variants, ...) run on this rank's piece; their other operands
  may be scalars, 0-dim or one-element tensors, tensors of the same layout (another
  gradient of the same shape and placement, or a result derived from one), or full tensors
  that broadcast to the gradient's shape (every rank must pass the same: this rank's part
  is sliced out). Out-of-place results are `Sharded` tensors of the same layout;
- reductions over the whole tensor (`norm` / `linalg.vector_norm` of any order,
  `_foreach_norm`, `sum`, `mean`, `max`, `min`, `amax`, `amin`, `all`, `any`,
  `count_nonzero`) return a `Unreduced`: this rank's contribution, reduced over the ranks only
  when its value is used. `torch.stack` of partials stays partial, so the norm of stacked
  per-parameter norms (what `torch.nn.utils.clip_grad_norm_` and `get_total_norm` compute)
  costs one small all-reduce for all parameters together. Every rank must use a partial's
  value in the same order (it is a collective), as with any DTensor reduction;
- `full_tensor()` gathers the whole averaged gradient on every rank (collective);
- anything else raises `ShardedGradError`, naming the op.

In one process with nothing to reduce `.grad` is an ordinary tensor (a view of the shard),
unless the shard keeps another dtype than the parameter (bf16 parameters keep fp32 gradient
shards): then it is a `ReducedGrad` over one rank, which supports the same operations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..shard.collectives import full_tensor
from ..shard.comm import Comm
from .op_names import funcs, tensor_attrs
from .tp_grads import TPPlace
from .unreduced import (
    ShardedGradError,
    Unreduced,
    _name,
    _norm,
    _norm_call,
    _partial_cast,
    _reduction,
    _refuse,
    _resolve,
    _shell,
    _stack,
    use_dispatch,
)

if TYPE_CHECKING:
    from .unit_view import UnitView

_METADATA = tensor_attrs(
    "size dim numel shape.__get__ ndim.__get__ dtype.__get__ device.__get__ layout.__get__"
    " requires_grad.__get__ grad_fn.__get__ is_sparse.__get__ is_floating_point untyped_storage"
    " data_ptr element_size requires_grad_ is_leaf.__get__ is_cuda.__get__ is_meta.__get__"
    " is_complex nelement stride is_contiguous storage_offset get_device is_quantized.__get__"
    " is_nested.__get__ is_mkldnn.__get__ itemsize.__get__ nbytes.__get__"
)
_FACTORIES = tensor_attrs("new_zeros new_ones new_empty new_full new_tensor")
_SELF = tensor_attrs("detach detach_")  # the same values: the tensor itself
_CASTS = tensor_attrs("to type float double half bfloat16 cpu cuda")
_ELEMENTWISE = funcs(
    "abs neg negative sign sgn square sqrt rsqrt exp log reciprocal nan_to_num isfinite isnan isinf"
    " isposinf isneginf logical_not signbit add sub subtract mul multiply div divide true_divide pow"
    " clamp clip clamp_min clamp_max maximum minimum where lerp addcmul addcdiv eq ne gt ge lt le"
    " logical_and logical_or masked_fill clone"
) | funcs(
    "add radd sub rsub mul rmul truediv rtruediv div rdiv pow rpow neg abs eq ne lt le gt ge and or invert",
    "__{}__",
)
_INPLACE = funcs(
    "abs_ neg_ sign_ sgn_ square_ sqrt_ nan_to_num_ add_ sub_ mul_ div_ true_divide_ pow_ clamp_ clip_"
    " clamp_min_ clamp_max_ lerp_ addcmul_ addcdiv_ masked_fill_ zero_ fill_ copy_"
) | funcs("iadd isub imul itruediv idiv ipow", "__{}__")
_NORMS = {torch.Tensor.norm, torch.norm, torch.linalg.vector_norm, torch.linalg.norm}
_REDUCED_AS = {"amax": "max", "amin": "min"}  # the others reduce as their own name says
_REDUCTIONS = {
    f: _REDUCED_AS.get(name, name)
    for name in ("sum", "mean", "max", "amax", "min", "amin", "all", "any", "count_nonzero")
    for f in (getattr(torch.Tensor, name), getattr(torch, name))
}


# --- sharded values -----------------------------------------------------------------------------


class Sharded(torch.Tensor):
    """A tensor of the gradient's layout: this rank holds the flat piece `[lo, hi)` of its
    row-major elements (`ranges[rank]`), each rank one piece in rank order. What element-wise
    ops on a sharded gradient return (`p.grad.abs()`, `torch.isfinite(p.grad)`); supports the
    same operations as `ReducedGrad` (see the module's docstring)."""

    _ranges: tuple[tuple[int, int], ...]
    _comm: Comm
    _local_values: torch.Tensor
    _tp: TPPlace | None = None  # a tensor-parallel parameter's: the pieces are of its TP shard

    @staticmethod
    def _of(local: torch.Tensor, like: Sharded) -> Sharded:
        out = _shell(Sharded, like.shape, local.dtype, local.device)
        out._ranges, out._comm, out._local_values, out._tp = like._ranges, like._comm, local, like._tp
        return out

    def local(self) -> torch.Tensor:
        """This rank's piece, flat (a view of the shard for a gradient: writing it writes the
        gradient)."""
        return self._local_values

    @property
    def _across(self) -> Comm | None:
        return None if self._tp is None else self._tp.across

    @property
    def placements(self) -> tuple:
        """A tensor-parallel gradient's DTensor placements (absent otherwise)."""
        if self._tp is None:
            raise AttributeError("placements: not the gradient of a DTensor parameter")
        return tuple(self._tp.param.placements)

    @property
    def device_mesh(self):
        """A tensor-parallel gradient's DTensor mesh (absent otherwise)."""
        if self._tp is None:
            raise AttributeError("device_mesh: not the gradient of a DTensor parameter")
        return self._tp.param.device_mesh

    def to_local(self) -> Sharded:
        """A tensor-parallel gradient's TP shard (of its local shape, the same pieces), as
        DTensor's `to_local()`; itself for any other."""
        if self._tp is None:
            return self
        return _relabel(self, self._tp.local_shape)

    def full_tensor(self) -> torch.Tensor:
        """The whole tensor on every rank, as an ordinary tensor (collective: an all-gather, and
        for a tensor-parallel gradient one more over TP)."""
        local = self.local()
        numel = sum(hi - lo for lo, hi in self._ranges)
        shape = self.shape if self._tp is None else self._tp.local_shape
        comm = self._comm
        if not comm.active:
            gathered = local.clone()
        else:
            from ..shard.spec import RaggedShard

            # the pieces as a RaggedShard of single elements: any split of the flat tensor
            units = tuple(hi - lo for lo, hi in self._ranges)
            gathered, _ = full_tensor(local, (numel,), RaggedShard((0,), units), comm)
        return gathered.view(shape) if self._tp is None else self._tp.whole(gathered.view(shape))

    def __repr__(self) -> str:
        what = f"shape={tuple(self.shape)}, dtype={self.dtype}"
        return f"{type(self).__name__}({what}: in the optimizer's shards)"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, types, args, kwargs or {})


class ReducedGrad(Sharded):
    """What a parameter's `.grad` holds once its unit's gradients were reduce-scattered over a
    process group: the parameter's shape, dtype and device, with the values in the optimizer's
    shards (this rank's piece is a view of its gradient shard, so in-place ops change the
    gradient the step uses). See the module's docstring for what it supports.

    Loss scalers work on it (`torch.amp.GradScaler.unscale_` unscales and checks this rank's
    piece; `ShardedGradScaler` agrees on infs over ranks), and casts to another dtype or
    device give a placeholder of the new dtype or device over the same piece (so
    `model.to(...)` runs; the step then refuses the moved parameter); assigning a tensor to
    `.grad` replaces the gradient."""

    _unit: UnitView
    _index: int

    def local(self) -> torch.Tensor:
        unit = self._unit
        unit.grads.wait()
        start, stop = unit.full.local_range(self._index)
        return unit.grads.shard[start:stop]

    def _piece(self) -> torch.Tensor:
        """This rank's elements of the gradient, in the unit's shard (after any reduction)."""
        return self.local()

    def to_local(self) -> ReducedGrad:
        if self._tp is None:
            return self
        return ReducedGrad._of(self._unit, self._index, self._tp.local_shape, self.dtype, self.device)

    @staticmethod
    def _of(  # type: ignore[override]
        unit: UnitView, i: int, shape, dtype, device, tp: TPPlace | None = None
    ) -> ReducedGrad:
        """Parameter `i`'s placeholder, of `shape` (a DTensor parameter's global shape with `tp`)."""
        out = _shell(ReducedGrad, shape, dtype, device)
        out._unit, out._index, out._tp = unit, i, tp
        offset = unit.layout.offsets[i]
        spans = (unit.layout.rank_range(i, r) for r in range(unit.comm.world_size))
        out._ranges = tuple((a - offset, b - offset) for a, b in spans)
        out._comm = unit.comm
        return out


def _relabel(t: Sharded, shape: tuple[int, ...]) -> Sharded:
    """`t`'s pieces as a tensor of `shape` with no tensor-parallel place (its TP shard alone)."""
    out = _shell(Sharded, shape, t.dtype, t.device)
    out._ranges, out._comm, out._local_values = t._ranges, t._comm, t._local_values
    return out


# --- dispatch --------------------------------------------------------------------------------


def _flatten(args: Any) -> list:
    found: list = []

    def walk(a: Any) -> None:
        if isinstance(a, (list, tuple)):
            for x in a:
                walk(x)
        elif isinstance(a, dict):
            for x in a.values():
                walk(x)
        else:
            found.append(a)

    walk(args)
    return found


def _map(args: Any, f: Callable[[Any], Any]) -> Any:
    if isinstance(args, list):
        return [_map(a, f) for a in args]
    if isinstance(args, tuple):
        return tuple(_map(a, f) for a in args)
    if isinstance(args, dict):
        return {k: _map(v, f) for k, v in args.items()}
    return f(args)


def _localize(value: Any, like: Sharded, func: Any) -> Any:
    """`value` as an operand of an element-wise op on `like`'s piece."""
    if isinstance(value, Unreduced):
        return value.value()
    if isinstance(value, Sharded):
        if tuple(value.shape) != tuple(like.shape) or value._ranges != like._ranges:
            raise _refuse(func, f" with a sharded operand of another layout (shape {tuple(value.shape)})")
        return value.local()
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and value.dim() <= like.dim():
            return value.reshape(())
        lo, hi = like._ranges[like._comm.rank]
        try:
            full = value.expand(like.shape)
        except RuntimeError:
            raise _refuse(
                func,
                f" with a tensor of shape {tuple(value.shape)}, which does not broadcast "
                f"to the gradient's {tuple(like.shape)}",
            ) from None
        if like._tp is not None:  # the whole tensor's elements of this rank's TP shard
            full = like._tp.slice(full)
        return full.reshape(-1)[lo:hi]
    return value


def _anchor(values: Sequence[Any]) -> Sharded | None:
    return next((v for v in values if isinstance(v, Sharded)), None)


def _elementwise(func, args, kwargs, inplace: bool):
    like = _anchor(_flatten((args, kwargs)))
    local_args = _map(args, lambda a: _localize(a, like, func))
    local_kwargs = _map(kwargs, lambda a: _localize(a, like, func))
    if inplace and not isinstance(args[0], Sharded):
        raise _refuse(func, " into an ordinary tensor (read the gradient with full_tensor() first)")
    out = func(*local_args, **local_kwargs)
    if inplace:
        return args[0]
    if isinstance(out, torch.Tensor):
        lo, hi = like._ranges[like._comm.rank]
        if out.numel() != hi - lo:
            raise _refuse(func)
        return Sharded._of(out.reshape(-1), like)
    return out


def _foreach(func, args, kwargs):
    """A `torch._foreach_*` call over lists that hold sharded tensors: on the pieces (the
    ordinary tensors of a list as they are)."""
    name = _name(func)
    first = next(a for a in args if isinstance(a, (list, tuple)))
    if name == "_foreach_norm":
        ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        dtype = kwargs.get("dtype")
        plain = torch.linalg.vector_norm
        return [
            _norm(t, ord_, dtype) if isinstance(t, Sharded) else plain(t, ord_, dtype=dtype) for t in first
        ]

    def operand(x: Any, k: int) -> Any:
        like = first[k]
        if isinstance(like, Sharded):
            return _localize(x, like, func)
        return x.value() if isinstance(x, Unreduced) else x

    def whole(a: Any) -> Any:
        return a.value() if isinstance(a, Unreduced) else a

    mapped = [
        [operand(x, k) for k, x in enumerate(a)] if isinstance(a, (list, tuple)) else whole(a) for a in args
    ]
    if name.endswith("_"):
        func(*mapped, **kwargs)
        return None
    outs = func(*mapped, **kwargs)
    return [Sharded._of(o.reshape(-1), t) if isinstance(t, Sharded) else o for o, t in zip(outs, first)]


def _dispatch(func, types, args: tuple, kwargs: dict):
    """`__torch_function__` of sharded and partial tensors (see the module's docstring)."""
    if func in _METADATA:
        return torch.Tensor.__torch_function__(func, (), args, kwargs)
    if func in _SELF:
        return args[0]
    self = args[0] if args else None
    if func is torch.Tensor.view_as and isinstance(self, Sharded) and tuple(args[1].shape) == self.shape:
        return self  # the same shape: itself (how DTensor.from_local holds a DTensor parameter's)
    if func in _CASTS and isinstance(self, ReducedGrad):
        probe = func(torch.empty((), dtype=self.dtype, device=self.device), *args[1:], **kwargs)
        if probe.dtype == self.dtype and probe.device == self.device:
            return self
        return ReducedGrad._of(self._unit, self._index, self.shape, probe.dtype, probe.device, self._tp)
    if func in _CASTS and isinstance(self, Sharded):
        return Sharded._of(func(self.local(), *args[1:], **kwargs), self)
    if func in _CASTS and isinstance(self, Unreduced):
        return _partial_cast(self, func, args, kwargs)
    if func in _FACTORIES and isinstance(self, (Sharded, Unreduced)):  # new tensors of this dtype and device
        return func(torch.empty((), dtype=self.dtype, device=self.device), *args[1:], **kwargs)
    if func is torch._has_compatible_shallow_copy_type:
        return False  # so `model.to(...)` assigns the cast placeholder instead of mutating this one
    flat = _flatten((args, kwargs))
    sharded = [v for v in flat if isinstance(v, Sharded)]
    if not sharded:  # partial values, perhaps with ordinary tensors
        if func is torch.stack:
            stacked = _stack(*args, **kwargs)
            if stacked is not None:
                return stacked
        partials = [v for v in flat if isinstance(v, Unreduced)]
        values = dict(zip(map(id, partials), _resolve(partials)))
        plain = lambda a: values[id(a)] if isinstance(a, Unreduced) else a  # noqa: E731
        return func(*_map(args, plain), **_map(kwargs, plain))
    name = _name(func)
    if name.startswith("_foreach_") or name == "_amp_foreach_non_finite_check_and_unscale_":
        return _foreach(func, args, kwargs)
    if func in _NORMS and isinstance(self, Sharded):
        return _norm_call(func, args, kwargs)
    if func in _REDUCTIONS and isinstance(self, Sharded):
        return _reduction(self, _REDUCTIONS[func], func, args, kwargs)
    if func is torch.Tensor.zero_ and isinstance(self, Sharded):
        self.local().zero_()
        return self
    if func in _INPLACE:
        return _elementwise(func, args, kwargs, inplace=True)
    if func in _ELEMENTWISE:
        return _elementwise(func, args, kwargs, inplace=False)
    raise _refuse(func)


use_dispatch(_dispatch)  # Unreduced's values dispatch here too

__all__ = ["Unreduced", "ReducedGrad", "Sharded", "ShardedGradError"]
