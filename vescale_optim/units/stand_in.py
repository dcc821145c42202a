"""What a sharded parameter is between uses: itself, refusing to be read or written.

Between its unit's forward and backward a sharded parameter has no values on this rank
(they are shards, spread over the ranks). The unit then turns the parameter's class into
a stand-in subclass of its own class (`p.__class__ = stand_in_class(type(p))`, cached per
class) and back when it gathers: on the gathered path the parameter is exactly what it
was, so forward and backward (compiled or not) pay nothing, and between uses every torch
function reaches the stand-in's `__torch_function__`:

- metadata passes (shape, dtype, device, `requires_grad`, `.grad` get and set, `is_leaf`,
  `numel`, `data_ptr`, hook registration, the `.data` setter), run on the parameter as it
  is (the class flipped back around the call, no private torch API), and so do the
  factories that read nothing but it (`torch.zeros_like(p)`, `full_like`, `p.new_empty`);
- a cast that changes nothing (`model.to(same device)`, `.float()` of a float) is the
  parameter itself; one that changes dtype or device (`model.double()`) is refused;
- `detach()` (what `model.state_dict()` stores before the units' state-dict hooks put the
  gathered values in its place) gives a detached stand-in that refuses values in turn;
- everything else (the `.data` getter, arithmetic, `clone`, `copy.deepcopy`, in-place
  ops, `nn.init`) raises `ReshardedParameterError`, naming the parameter and the ways to
  its values: `model.state_dict()`, `with opt.gathered():`, or calling the root module.

Each parameter's `.data` is then its own stride-0 scalar (no memory, nothing shared with
another parameter); it is never read. A parameter class whose instances cannot change
class (another layout than its stand-in's) is refused when its unit is built.

A DTensor parameter (tensor parallelism) keeps its mesh and placements and its local tensor,
a view of its unit's buffer that holds no memory between uses (nothing re-points it: the
buffer is freed and given memory again in place). Its stand-in class also answers the
DTensor methods that reach the local tensor without a torch function: `to_local()` gives the
local tensor as a stand-in of its own (shape and dtype read, values refused by name), and
`full_tensor()` and `redistribute()` are refused.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Iterator, Sequence

import torch
from torch.overrides import resolve_name

from .op_names import tensor_attrs

_T = torch.Tensor
_METADATA = tensor_attrs(
    "size dim numel nelement shape.__get__ ndim.__get__ dtype.__get__ device.__get__ layout.__get__"
    " requires_grad.__get__ requires_grad.__set__ requires_grad_ grad.__get__ grad.__set__"
    " grad.__delete__ grad_fn.__get__ is_leaf.__get__ is_sparse.__get__ is_floating_point is_complex"
    " data_ptr element_size stride is_contiguous storage_offset get_device is_cuda.__get__"
    " is_cpu.__get__ is_meta.__get__ is_quantized.__get__ is_nested.__get__ is_mkldnn.__get__"
    " itemsize.__get__ nbytes.__get__ data.__set__ register_hook register_post_accumulate_grad_hook"
    " untyped_storage _version.__get__ output_nr.__get__ is_inference"
)
# torch's own checks, by name (not private attributes of ours to import): `nn.Module._apply`'s
_METADATA_NAMES = {"_has_compatible_shallow_copy_type"}
# a new tensor shaped like the parameter (an EMA's zeros, a gradient set by hand): no value read
_LIKE = {getattr(torch, f"{k}_like") for k in ("empty", "zeros", "ones", "full", "rand", "randn", "randint")}
_LIKE |= tensor_attrs("new_empty new_zeros new_ones new_full")
_CASTS = {_T.to, _T.type, _T.float, _T.double, _T.half, _T.bfloat16, _T.cpu, _T.cuda}
_DESCRIBE = {_T.__repr__, _T.__format__}

# id(tensor) -> (how errors name it, its class while it has values); entries leave with the tensor
_NAMES: dict[int, tuple[str, type]] = {}


class ReshardedParameterError(RuntimeError):
    """A sharded parameter was read or written between its unit's uses."""


def _found(args, kwargs) -> _StandIn | None:
    """The first stand-in among `args` and `kwargs` (lists and tuples searched too)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, _StandIn):
            return a
        if isinstance(a, list | tuple):
            inner = _found(a, {})
            if inner is not None:
                return inner
    return None


def _message(t: torch.Tensor, what: str) -> str:
    label = _NAMES.get(id(t), ("(a sharded parameter)", None))[0]
    return (
        f"parameter {label} is resharded: outside its unit's forward and backward its values are "
        f"shards spread over the ranks, so {what} cannot read or write it here. Read whole values "
        "with model.state_dict(); read or write them inside `with opt.gathered():` (every rank "
        "enters it; in-place writes land in the shards); or call the root module, model(x), whose "
        "hooks gather each unit (calling a child module directly skips the hooks of the units around it). "
        "A wrapper that needs whole parameters on every rank (DistributedDataParallel) cannot hold a "
        "model whose optimizer has shard_modules=: drop shard_modules= (under DDP the optimizer shards "
        "its state, ZeRO-1) or drop the wrapper"
    )


class _StandIn:
    """The mixin of every stand-in class (see the module's docstring)."""

    __slots__ = ()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t = _found(args, kwargs)
        if t is None:  # another stand-in class's turn
            return NotImplemented
        if func in _METADATA or getattr(func, "__name__", None) in _METADATA_NAMES or func in _LIKE:
            with revealed(t):
                return func(*args, **kwargs)
        if func in _DESCRIBE:
            label = _NAMES.get(id(t), ("",))[0]
            return f"resharded parameter {label}: {t.dtype}, shape {tuple(t.shape)}, no values on this rank"
        if func in _CASTS:
            with revealed(t):
                out = func(*args, **kwargs)
            if out is t:
                return t
            return _refuse(t, f"`.{func.__name__}()` (to {out.dtype} on {out.device}; cast it before)")
        if func is _T.detach:
            if _wrapper_reading():
                _refuse(t, "DistributedDataParallel's broadcast of the parameters")
            with revealed(t):
                out = func(*args, **kwargs)
            return _named_like(t, out)
        return _refuse(t, f"`{resolve_name(func) or getattr(func, '__name__', func)}`")


# modules of torch whose wrappers read every parameter whole when they are built (DDP's broadcast
# of rank 0's parameters detaches each first, then writes it in C++, where no stand-in is asked)
_WHOLE_READERS = ("torch.nn.parallel.distributed", "torch.distributed.utils")


def _wrapper_reading(depth: int = 6) -> bool:
    """Whether a wrapper's construction (DDP) is detaching the parameter, to write it outside Python."""
    frame = inspect.currentframe()
    for _ in range(depth):
        frame = frame.f_back if frame is not None else None
        if frame is None:
            return False
        if frame.f_globals.get("__name__") in _WHOLE_READERS:
            return True
    return False


def _refuse(t: torch.Tensor, what: str):
    raise ReshardedParameterError(_message(t, what))


def _forget_with(t: torch.Tensor) -> None:
    weakref.finalize(t, _NAMES.pop, id(t), None)


def _named_like(t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out` (read from stand-in `t`'s metadata) as a stand-in named as `t`."""
    _NAMES[id(out)] = (_NAMES.get(id(t), ("", _T))[0], type(out))
    _forget_with(out)
    out.__class__ = stand_in_class(type(out))
    return out


def _local_stand_in(self, *args, **kwargs):
    """A DTensor stand-in's `to_local()`: its local tensor as a stand-in too (the same shape
    and dtype, no values), so the runtime reads its metadata and users get the named error."""
    with revealed(self):
        out = self.to_local(*args, **kwargs)
    return _named_like(self, out)


def _refusing(name: str):
    def refuse(self, *args, **kwargs):
        return _refuse(self, f"`.{name}()`")

    refuse.__name__ = name
    return refuse


# DTensor methods that reach the local tensor without a torch function: `to_local()` gives a
# stand-in, the collectives over the values are refused (a DTensor is known by its attributes)
_DTENSOR = {
    "to_local": _local_stand_in,
    "full_tensor": _refusing("full_tensor"),
    "redistribute": _refusing("redistribute"),
}

_CLASSES: dict[type, type] = {}


def stand_in_class(cls: type) -> type:
    """The stand-in subclass of parameter class `cls` (made once)."""
    if issubclass(cls, _StandIn):
        return cls
    made = _CLASSES.get(cls)
    if made is None:
        body: dict = {"__slots__": ()}
        if all(hasattr(cls, a) for a in ("device_mesh", "placements", "to_local")):
            body.update(_DTENSOR)
        made = _CLASSES[cls] = type(f"Resharded{cls.__name__}", (_StandIn, cls), body)
    return made


def register(p: torch.Tensor, label: str) -> None:
    """Name `p` in errors and check that it can become a stand-in (ValueError otherwise)."""
    cls = type(p)
    try:
        p.__class__ = stand_in_class(cls)
        p.__class__ = cls
    except TypeError as e:
        raise ValueError(
            f"parameter {label} is a {cls.__name__}, whose instances cannot change class ({e}); a sharded "
            "unit turns each parameter into a stand-in between uses, so it cannot shard this one (keep it "
            "out of shard_modules' units, or use nn.Parameter)"
        ) from None
    if id(p) not in _NAMES:
        _forget_with(p)
    _NAMES[id(p)] = (label, cls)


def hide(p: torch.Tensor) -> None:
    """`p` becomes its stand-in (its `.data` already set to the stand-in's scalar)."""
    p.__class__ = stand_in_class(_NAMES[id(p)][1])


def show(p: torch.Tensor) -> None:
    """`p` is its own class again."""
    p.__class__ = _NAMES[id(p)][1]


@contextlib.contextmanager
def revealed(t: torch.Tensor) -> Iterator[None]:
    """`t` as its own class for a moment (the runtime reading metadata or a value set by hand)."""
    cls = type(t)
    if not isinstance(t, _StandIn):
        yield
        return
    t.__class__ = _NAMES.get(id(t), ("", _T))[1]
    try:
        yield
    finally:
        t.__class__ = cls


@contextlib.contextmanager
def revealed_all(ts: Sequence[torch.Tensor]) -> Iterator[None]:
    """Every stand-in among `ts` as its own class for a moment: one class flip each for a loop
    that reads their metadata (the step's checks), rather than one per torch function read."""
    hidden = [(t, type(t)) for t in ts if isinstance(t, _StandIn)]
    for t, _ in hidden:
        t.__class__ = _NAMES.get(id(t), ("", _T))[1]
    try:
        yield
    finally:
        for t, cls in hidden:
            t.__class__ = cls
