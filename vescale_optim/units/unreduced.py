"""Unreduced values of sharded gradients (DTensor's `Partial`): whole-tensor reductions of a
rank's pieces, reduced over the ranks only when the value is used, all of a call's partial
values together (one all-reduce per group and reduction kind). See `reduced_grad`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..shard.collectives import all_reduce_
from ..shard.comm import Comm


class Pieces(Protocol):
    """What a whole-tensor reduction reads of a sharded tensor (`reduced_grad.Sharded`, which
    imports this module: naming it here would close an import circle)."""

    _comm: Comm
    _across: Comm | None  # the tensor-parallel group whose shards add to the whole (None: none)
    dtype: torch.dtype
    device: torch.device

    def local(self) -> torch.Tensor: ...

    def dim(self) -> int: ...

    def numel(self) -> int: ...


# The one dispatch of sharded and partial tensors (`reduced_grad._dispatch`): installed by
# `reduced_grad` when it is imported, which it is before any Unreduced exists (only its ops make them).
_dispatch: Callable[[Any, Any, tuple, dict], Any] | None = None


def use_dispatch(dispatch: Callable[[Any, Any, tuple, dict], Any]) -> None:
    """Make `dispatch` the torch-function dispatch of `Unreduced` values (see `_dispatch`)."""
    global _dispatch
    _dispatch = dispatch


_AMAX = {torch.amax, torch.amin, torch.Tensor.amax, torch.Tensor.amin}  # these take a dim; max(dim) does not


class ShardedGradError(RuntimeError):
    """An operation that a sharded gradient (or a value derived from one) cannot run on its
    shards: the message names the op and says what works instead."""


def _name(func: Any) -> str:
    name = getattr(func, "__name__", repr(func))
    if name == "__get__" and hasattr(func, "__self__"):  # a property: Tensor.T, Tensor.real, ...
        return getattr(func.__self__, "__name__", name)
    return name


def _refuse(func: Any, why: str = "") -> ShardedGradError:
    return ShardedGradError(
        f"{_name(func)}() on a gradient that was reduce-scattered into the optimizer's shards{why}: "
        "after backward, gradients are averaged over ranks and each rank holds one piece of them. "
        "Supported: element-wise ops (in place or not) with scalars, tensors of the same layout or "
        "full tensors, whole-tensor reductions (norm, sum, max, all, ...: their values are reduced "
        "over the ranks when used) and torch.nn.utils.clip_grad_norm_ / clip_grad_value_; "
        "p.grad.full_tensor() gathers the whole gradient; assign a tensor to .grad to replace it"
    )


def _shell(cls: type, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Any:
    """A tensor of `cls` with this shape, dtype and device that holds no memory of its own."""
    return torch.empty((), dtype=dtype, device=device).expand(tuple(shape)).as_subclass(cls)


# --- partial values ---------------------------------------------------------------------------


@dataclass
class _Term:
    """One value still to be reduced over `comm`: this rank's `local` (0-dim float64), the
    reduction `op` ("sum", "max" or "min"), and `finish`, which makes the value from the
    reduced one; `across`, when the tensor is the shard of a tensor-parallel DTensor, the TP
    group over which the reduced value is reduced again (a norm of a `Shard`-placed gradient
    sums over its TP shards; a replicated one counts once: None)."""

    local: torch.Tensor
    op: str
    comm: Comm
    finish: Callable[[torch.Tensor], torch.Tensor]
    across: Comm | None = None


class Unreduced(torch.Tensor):
    """A value of the whole averaged gradient, of which this rank holds its contribution
    (as a DTensor with a `Partial` placement does): a reduction of sharded gradients (`p.grad.norm()`,
    `torch.isfinite(p.grad).all()`), or a `torch.stack` of such values and ordinary ones.

    Using its value in any way (`.item()`, printing, arithmetic, a further norm) reduces it
    over the ranks first, in one all-reduce per group and reduction kind for every partial
    value the call takes, and the result is an ordinary tensor, the same on every rank. That
    is a collective: every rank must use it at the same point. `.to(...)` and `torch.stack`
    stay partial."""

    _items: list[_Term | torch.Tensor]

    @staticmethod
    def _of(
        items: list[_Term | torch.Tensor], shape: Sequence[int], dtype: torch.dtype, device: torch.device
    ) -> Unreduced:
        out = _shell(Unreduced, shape, dtype, device)
        out._items = items
        return out

    def value(self) -> torch.Tensor:
        """The reduced value (collective; see the class docstring)."""
        return _resolve([self])[0]

    def __repr__(self) -> str:  # a repr reduces, on every rank alike (as printing any value would)
        return f"Unreduced({self.value()!r})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, types, args, kwargs or {})


def _resolve(partials: Sequence[Unreduced]) -> list[torch.Tensor]:
    """The values of `partials`: for all their terms of one process group and reduction, one
    all-reduce over that group, then one over each TP group for the terms of its tensor-parallel
    shards (laid side by side in the wire, so each is a slice). Groups are told apart by the
    process group they stand for, not by the `Comm` objects (each unit builds its own): the
    whole model's norm under TP is two all-reduces whatever its number of units."""
    groups: dict[tuple, list[_Term]] = {}
    for p in partials:
        for item in p._items:
            if isinstance(item, _Term):
                groups.setdefault((_group_key(item.comm), item.op), []).append(item)
    reduced: dict[int, torch.Tensor] = {}
    for (_, op), terms in groups.items():
        tp: dict[tuple, list[_Term]] = {}  # the terms of TP shards, by TP group
        for t in terms:
            if t.across is not None:
                tp.setdefault(_group_key(t.across), []).append(t)
        ordered = [t for t in terms if t.across is None] + [t for ts in tp.values() for t in ts]
        comm, kind = terms[0].comm, "sum" if op == "sum" else "max"
        device = terms[0].local.device
        if comm.active or tp:
            device = comm.device if comm.active else next(iter(tp.values()))[0].across.device
        wire = torch.stack([t.local.to(device) for t in ordered])
        if op == "min":  # there is no MIN in this library's collectives: the max of the negation
            wire = wire.neg_()
        what = "a reduction of sharded gradients"
        all_reduce_(wire, comm, kind, what=what)
        start = len(ordered) - sum(len(ts) for ts in tp.values())
        for ts in tp.values():  # a contiguous slice: reduced in place
            all_reduce_(wire[start : start + len(ts)], ts[0].across, kind, what=what)
            start += len(ts)
        if op == "min":
            wire = wire.neg_()
        for k, t in enumerate(ordered):
            reduced[id(t)] = wire[k]
    values = []
    for p in partials:
        items = [item.finish(reduced[id(item)]) if isinstance(item, _Term) else item for item in p._items]
        items = [v.to(p.dtype).to(p.device) for v in items]
        values.append(items[0].reshape(p.shape) if p.dim() == 0 else torch.stack(items).reshape(p.shape))
    return values


def _group_key(comm: Comm) -> tuple:
    """The process group `comm` stands for (the default group when its group is None; no
    group at all when it talks to no one), alike for every `Comm` of that group."""
    return comm.distributed, id(comm.group)


def _then(item: _Term | torch.Tensor, f: Callable[[torch.Tensor], torch.Tensor]) -> _Term | torch.Tensor:
    if isinstance(item, _Term):
        return _Term(item.local, item.op, item.comm, lambda r, g=item.finish: f(g(r)), item.across)
    return f(item)


def _partial_cast(self: Unreduced, func, args, kwargs) -> Unreduced:
    """`.to(...)`, `.float()`, ... of a partial value: still partial."""
    probe = func(torch.empty((), dtype=self.dtype, device=self.device), *args[1:], **kwargs)
    if probe.dtype == self.dtype and probe.device == self.device:
        return self
    items = [_then(item, lambda v: v.to(probe.dtype).to(probe.device)) for item in self._items]
    return Unreduced._of(items, self.shape, probe.dtype, probe.device)


def _stack(tensors: Sequence[torch.Tensor], dim: int = 0) -> Unreduced | None:
    """`torch.stack` of 0-dim values some of which are partial, kept partial (else None)."""
    if dim != 0 or not tensors:
        return None
    if any(t.dim() != 0 or type(t) not in (Unreduced, torch.Tensor) for t in tensors):
        return None
    first = tensors[0]
    items: list[_Term | torch.Tensor] = []
    for t in tensors:
        if t.dtype != first.dtype or t.device != first.device:
            return None
        items.extend(t._items if isinstance(t, Unreduced) else [t])
    return Unreduced._of(items, (len(items),), first.dtype, first.device)


def _float_dtype(x: torch.Tensor) -> torch.dtype | None:
    return torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else None


def _norm(self: Pieces, ord_: Any = 2, dtype: torch.dtype | None = None) -> Unreduced:
    """The vector norm of order `ord_` of the whole tensor, partial."""
    if ord_ is None or ord_ == "fro":
        ord_ = 2.0
    if isinstance(ord_, str):
        raise _refuse(torch.linalg.norm, f" of order {ord_!r}")
    p = float(ord_)
    x = self.local()
    out_dtype = dtype or self.dtype
    acc = dtype or _float_dtype(x)
    if math.isinf(p):
        op = "max" if p > 0 else "min"
        if x.numel() == 0:  # this rank holds none of it: the reduction's identity
            local = torch.full((), 0.0 if p > 0 else math.inf, dtype=torch.float64, device=x.device)
        else:
            local = x.abs().amax() if p > 0 else x.abs().amin()

        def finish(r: torch.Tensor) -> torch.Tensor:
            return r.to(out_dtype)
    elif p == 0:
        op, local = "sum", torch.count_nonzero(x).to(torch.float64)

        def finish(r: torch.Tensor) -> torch.Tensor:
            return r.to(out_dtype)
    else:
        op = "sum"
        local = (
            torch.linalg.vector_norm(x, p, dtype=acc).to(torch.float64) ** p
            if x.numel()
            else torch.zeros((), dtype=torch.float64, device=x.device)
        )

        def finish(r: torch.Tensor) -> torch.Tensor:
            return r.pow(1.0 / p).to(out_dtype)

    term = _Term(local.to(torch.float64).reshape(()), op, self._comm, finish, self._across)
    return Unreduced._of([term], (), out_dtype, self.device)


def _reduction(self: Pieces, kind: str, func, args, kwargs) -> Unreduced:
    """A whole-tensor reduction (`sum`, `max`, `all`, ...) of a sharded tensor, partial."""
    dim = kwargs.get("dim", args[1] if len(args) > 1 and not isinstance(args[1], torch.dtype) else None)
    keepdim = bool(kwargs.get("keepdim", args[2] if len(args) > 2 and isinstance(args[2], bool) else False))
    dtype = kwargs.get("dtype", args[1] if len(args) > 1 and isinstance(args[1], torch.dtype) else None)
    if dim is not None:
        dims = (dim,) if isinstance(dim, int) else tuple(dim)
        if sorted(d % max(self.dim(), 1) for d in dims) != list(range(self.dim())):
            raise _refuse(func, f" over dim={dim} (only reductions over the whole tensor)")
        if kind in ("max", "min") and func not in _AMAX:
            raise _refuse(func, f" over dim={dim} (only reductions over the whole tensor)")
    x = self.local()
    shape = (1,) * self.dim() if keepdim else ()
    empty = x.numel() == 0
    f64 = torch.float64
    if kind in ("sum", "mean"):
        out_dtype = dtype or (self.dtype if self.dtype.is_floating_point else torch.int64)
        local, op = (x.sum(dtype=f64) if not empty else torch.zeros((), dtype=f64, device=x.device)), "sum"
        n = self.numel()

        def finish(r: torch.Tensor) -> torch.Tensor:
            return (r / n if kind == "mean" else r).to(out_dtype)
    elif kind in ("max", "min"):
        out_dtype = self.dtype
        fill = -math.inf if kind == "max" else math.inf
        local = (
            (x.amax() if kind == "max" else x.amin()).to(f64)
            if not empty
            else torch.full((), fill, dtype=f64, device=x.device)
        )
        op = kind

        def finish(r: torch.Tensor) -> torch.Tensor:
            return r.to(out_dtype)
    elif kind in ("all", "any"):
        out_dtype = torch.bool
        local = (
            (x.all() if kind == "all" else x.any()).to(f64)
            if not empty
            else torch.full((), 1.0 if kind == "all" else 0.0, dtype=f64, device=x.device)
        )
        op = "min" if kind == "all" else "max"

        def finish(r: torch.Tensor) -> torch.Tensor:
            return r != 0
    else:  # count_nonzero
        out_dtype = torch.int64
        local, op = torch.count_nonzero(x).to(f64), "sum"

        def finish(r: torch.Tensor) -> torch.Tensor:
            return r.to(out_dtype)

    return Unreduced._of(
        [_Term(local.reshape(()), op, self._comm, finish, self._across)], shape, out_dtype, self.device
    )


def _norm_call(func, args, kwargs) -> Unreduced:
    self = args[0]
    rest = list(args[1:])
    if func is torch.linalg.vector_norm:
        ord_ = kwargs.get("ord", rest[0] if rest else 2)
    elif func is torch.linalg.norm:
        ord_ = kwargs.get("ord", rest[0] if rest else None)
        matrix_dim = kwargs.get("dim", rest[1] if len(rest) > 1 else None)
        if ord_ is not None and self.dim() == 2 and matrix_dim is None:
            raise _refuse(func, f" of order {ord_!r} (a matrix norm; vector norms work)")
    else:  # Tensor.norm / torch.norm: p
        ord_ = kwargs.get("p", rest[0] if rest else "fro")
    dim = kwargs.get("dim", rest[1] if len(rest) > 1 else None)
    keepdim = kwargs.get("keepdim", rest[2] if len(rest) > 2 else False)
    if dim is not None:
        dims = (dim,) if isinstance(dim, int) else tuple(dim)
        if sorted(d % max(self.dim(), 1) for d in dims) != list(range(self.dim())):
            raise _refuse(func, f" over dim={dim} (only norms of the whole tensor)")
    out = _norm(self, ord_, kwargs.get("dtype"))
    if keepdim:
        out = Unreduced._of(out._items, (1,) * self.dim(), out.dtype, out.device)
    return out
