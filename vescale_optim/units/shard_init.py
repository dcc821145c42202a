"""Initialise this rank's TP shard of a DTensor parameter without its whole tensor.

`materialize` initialises a module whose DTensor parameters are on the meta device by running
its `reset_parameters()` (or a `param_init_fn`) as on the unparallelised model, and each rank
must end with its shard of the whole tensor that initialisation would have made. While it
runs, each such parameter is stood in for by a `ShardStandIn`: a parameter of the whole shape
on the meta device (no memory) that carries the place of this rank's shard in the whole. The
initialisation's writes to it reach the shard:

- a random fill (`uniform_`, `normal_`) draws the *whole* tensor's random stream, a chunk at a
  time into a small scratch buffer, and keeps the part of each chunk that falls in the shard.
  So the random state moves on exactly as after the whole draw, and the kept values are
  bitwise the whole draw's: the CPU generator gives `uniform_` element by element, and
  `normal_` (for 16 elements or more) fills uniforms, turns groups of 16 into normals and
  redraws the last 16 when the count is not a multiple of 16, which chunks of multiples of 16,
  the last one at least 16 long, reproduce. On CUDA (`cuda_draw`) only the chunks that hold the
  shard are drawn, each chunk a whole number of the kernel's loop iterations drawn with the
  generator's offset set to where the whole draw's kernel reaches it, and the offset is left
  where the whole draw leaves it; the whole's minimum and maximum, when asked, are replayed
  chunk by chunk. Where `cuda_draw`'s once-per-process calibration does not prove torch's layout
  for the device, dtype and fill, the parameter is drawn whole into a scratch buffer freed once
  the shard is kept (one parameter's whole size at a time), with a warning.
- a constant fill, a copy from a real tensor (broadcast, then cut to the shard), and the
  element-wise ops that round alike in CPU kernels' vector and scalar paths (`mul_`, `add_`
  without `alpha`, `clamp_`, `erfinv_`, `sqrt_`, ...) apply to the shard itself.
- comparing the whole with a number right after a random fill (the test of a rejection
  sampler, as `nn.init.trunc_normal_` makes) is answered from the whole draw's minimum and
  maximum, for `.any()` and `|` alone.

Anything else that touches a stand-in, such as a write through a view (`w[0].zero_()`), an op
reading its values (`orthogonal_`'s QR, `torch.where`), a random op of another kind, raises
`NeedsWhole` (and is remembered, should the initialisation catch it); `materialize` then rewinds
the random states (every generator the initialisation used, `GeneratorWatch`) and initialises
that module with whole tensors, as the values must stay bitwise those of the model built
normally. The stand-in
answers `device` with the units' device and `is_meta` with False, as the whole tensor would.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from . import cuda_draw
from .op_names import names
from .tensor_parallel import is_dtensor

#: The CPU draw's chunk, in elements (a multiple of 16): its scratch buffer holds at most twice this.
CHUNK = 1 << 16

# torch.nn.init functions that hand a tensor argument's class the call itself: they run as they
# are, and the writes in their bodies reach the stand-in's own methods.
_INIT_ENTRIES = {f"torch.nn.init.{n}" for n in ("uniform_", "normal_", "constant_", "kaiming_uniform_")}
_METADATA = names(
    "dim ndimension size numel nelement stride is_contiguous is_floating_point is_complex element_size"
    " __hash__ __len__ shape.__get__ ndim.__get__ dtype.__get__ layout.__get__ requires_grad.__get__"
    " grad_fn.__get__ grad.__get__ is_leaf.__get__"
)
_VIEWS = names(
    "__getitem__ view view_as reshape reshape_as flatten unflatten select narrow transpose t permute"
    " unsqueeze squeeze expand expand_as unbind split chunk T.__get__ mT.__get__"
)
_ALIASES = {"data.__get__", "detach"}  # the whole tensor itself: writable as the stand-in
_RANDOM = {"uniform_", "normal_"}
_DEFINING = {"fill_", "zero_", "copy_"}
_ELEMENTWISE = names(
    "mul_ div_ add_ sub_ clamp_ clamp_min_ clamp_max_ clip_ neg_ abs_ sqrt_ erfinv_ floor_ ceil_ trunc_"
    " round_ masked_fill_"
)
_WRITES = _RANDOM | _DEFINING | _ELEMENTWISE
_OPERATORS = {"__imul__": "mul_", "__iadd__": "add_", "__isub__": "sub_", "__itruediv__": "div_"}  # w *= s
# comparisons with a number, answered from the whole's (minimum, maximum): which one, and how
_COMPARE = {
    **dict.fromkeys(("__lt__", "lt"), (0, torch.lt)),
    **dict.fromkeys(("__le__", "le"), (0, torch.le)),
    **dict.fromkeys(("__gt__", "gt"), (1, torch.gt)),
    **dict.fromkeys(("__ge__", "ge"), (1, torch.ge)),
}


class NeedsWhole(Exception):
    """An initialisation did something to a DTensor parameter's stand-in that its shard alone
    cannot reproduce bitwise: its module is initialised again with whole tensors."""


class Attempt:
    """One module's initialisation on stand-ins: the random states it started from (the default
    CPU generator, the CUDA one of `device`, and every other generator it uses, as first seen by a
    fill or by `GeneratorWatch`) to rewind to when it turns out to need whole tensors."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.generators: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        self.reason: str | None = None  # why whole tensors are needed, once something did

    def saw(self, generator: torch.Generator | None) -> None:
        if generator is not None and id(generator) not in self.generators:
            self.generators[id(generator)] = (generator, generator.get_state())

    def needs_whole(self, reason: str) -> NeedsWhole:
        self.reason = self.reason or reason
        return NeedsWhole(reason)

    def rewind(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        for generator, state in self.generators.values():
            generator.set_state(state)


class GeneratorWatch(TorchFunctionMode):
    """Active while a module's initialisation runs on stand-ins: every generator handed to a
    torch function (for any tensor, a plain parameter's too) is noted by `attempt` before it
    draws, so that a rewind restores it and the whole initialisation draws what it drew."""

    def __init__(self, attempt: Attempt):
        super().__init__()
        self.attempt = attempt

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in [*args, *kwargs.values()]:
            if isinstance(a, torch.Generator):
                self.attempt.saw(a)
        return func(*args, **kwargs)


class ShardTarget:
    """Where a stand-in's writes go: the box at `origin` (of `shard`'s shape) of the whole
    tensor of `shape`; `shard` None draws what the whole tensor would and keeps nothing (a
    parameter initialised before, by a module sharing it)."""

    def __init__(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        origin: tuple[int, ...],
        shard: torch.Tensor | None,
        attempt: Attempt,
        chunk: int | None = CHUNK,
        cuda_chunk_bytes: int | None = cuda_draw.CHUNK_BYTES,
    ):
        self.name, self.shape, self.dtype, self.origin = name, tuple(shape), dtype, tuple(origin)
        self.shard, self.attempt = shard, attempt
        self.device = attempt.device
        # the CPU's chunk in elements; on CUDA the chunk's bytes (`cuda_draw`); None: whole
        self.chunk = chunk if self.device.type == "cpu" else None
        self.cuda_chunk_bytes = cuda_chunk_bytes if self.device.type == "cuda" else None
        self.written = False  # by a fill or a copy: an initialisation that skips it is named
        # the whole's (minimum, maximum) after a fill, when asked (CUDA replays the whole draw then)
        self.bounds: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None

    def box(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of `t` broadcast to the whole shape (a view)."""
        out = t.broadcast_to(self.shape)
        for d, (o, n) in enumerate(zip(self.origin, self.shard.shape)):
            out = out.narrow(d, o, n)
        return out

    def meets(self, start: int, stop: int) -> bool:
        """Whether the shard holds any of the whole's flat elements `[start, stop)`."""
        if self.shard is None:
            return False
        for origin, sizes in flat_boxes(self.shape, start, stop):
            spans = zip(origin, sizes, self.origin, self.shard.shape)
            if all(max(b, o) < min(b + s, o + m) for b, s, o, m in spans):
                return True
        return False

    def keep(self, part: torch.Tensor, start: int, stop: int) -> None:
        """The shard's elements of `part` (the whole's flat `[start, stop)`) copied into it."""
        if self.shard is not None:
            keep(part, start, stop, self.shape, self.origin, self.shard)

    def draw(self, name: str, args: tuple, kwargs: dict) -> None:
        """The random fill `name` of the whole tensor, chunk by chunk; the shard's part kept."""
        self.attempt.saw(kwargs.get("generator"))
        n = math.prod(self.shape)
        self.written, self.bounds = True, None
        if n == 0:
            return
        if self.cuda_chunk_bytes is not None:  # only the shard's chunks, where proven (`cuda_draw`)
            bounds = cuda_draw.shard_sized(
                name, args, kwargs, n, self.dtype, self.device, self.meets, self.keep, self.cuda_chunk_bytes
            )
            if bounds is not None:
                self.bounds = bounds
                return
        spans = list(spans_of(n, self.chunk or n))
        scratch = torch.empty(max(b - a for a, b in spans), dtype=self.dtype, device=self.device)
        low = high = None
        for start, stop in spans:
            part = scratch[: stop - start]
            getattr(part, name)(*args, **kwargs)
            self.keep(part, start, stop)
            lo, hi = torch.aminmax(part)
            low = lo if low is None else torch.minimum(low, lo)
            high = hi if high is None else torch.maximum(high, hi)
        self.bounds = lambda: (low, high)


def spans_of(n: int, chunk: int) -> Iterator[tuple[int, int]]:
    """`[start, stop)` chunks of `range(n)`: `chunk` long, the last one between `chunk` and
    `2 * chunk - 1` (or all of `n` when shorter), so that no chunk is shorter than `chunk`."""
    count = max(1, n // chunk)
    for k in range(count):
        yield k * chunk, n if k == count - 1 else (k + 1) * chunk


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> Iterator[tuple[tuple, tuple]]:
    """Boxes `(origin, sizes)` that together hold the elements `[start, stop)` of a contiguous
    tensor of `shape` in flat order (at most two per dimension, and one more)."""
    if start >= stop:
        return
    if not shape:
        yield (), ()
        return
    row = math.prod(shape[1:])
    first_full, end_full = -(-start // row), stop // row
    if first_full > end_full:  # inside one row
        i = start // row
        for o, s in flat_boxes(shape[1:], start - i * row, stop - i * row):
            yield (i, *o), (1, *s)
        return
    if start < first_full * row:
        i = first_full - 1
        for o, s in flat_boxes(shape[1:], start - i * row, row):
            yield (i, *o), (1, *s)
    if end_full > first_full:
        yield (first_full,) + (0,) * (len(shape) - 1), (end_full - first_full, *shape[1:])
    if end_full * row < stop:
        for o, s in flat_boxes(shape[1:], 0, stop - end_full * row):
            yield (end_full, *o), (1, *s)


def keep(
    part: torch.Tensor,
    start: int,
    stop: int,
    shape: tuple[int, ...],
    origin: tuple[int, ...],
    shard: torch.Tensor,
) -> None:
    """Copy the elements of `part` (the whole tensor's flat `[start, stop)`) that fall in the box
    at `origin` of `shard`'s shape into `shard`."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    for box_origin, box_sizes in flat_boxes(shape, start, stop):
        low = [max(b, o) for b, o in zip(box_origin, origin)]
        high = [min(b + s, o + n) for b, s, o, n in zip(box_origin, box_sizes, origin, shard.shape)]
        if any(h <= lo for lo, h in zip(low, high)):
            continue
        sizes = [h - lo for lo, h in zip(low, high)]
        at = sum(lo * s for lo, s in zip(low, strides)) - start
        src = part.as_strided(sizes, strides, part.storage_offset() + at)
        dst = shard
        for d, (lo, o, s) in enumerate(zip(low, origin, sizes)):
            dst = dst.narrow(d, lo - o, s)
        dst.copy_(src)


class AnyOnly:
    """A stand-in compared with a number right after a random fill: read by `.any()`, combined
    by `|` (a rejection sampler's test); any other use needs the whole tensor."""

    def __init__(self, hit: bool, attempt: Attempt):
        self.hit, self.attempt = hit, attempt

    def __or__(self, other: object) -> AnyOnly:
        if not isinstance(other, AnyOnly):
            raise self.attempt.needs_whole("a comparison of a stand-in combined with something else")
        return AnyOnly(self.hit or other.hit, self.attempt)

    __ror__ = __or__

    def any(self) -> torch.Tensor:
        return torch.tensor(self.hit, device=self.attempt.device)

    def __bool__(self) -> bool:
        raise self.attempt.needs_whole("a comparison of a stand-in read as a bool")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        for a in [*args, *(kwargs or {}).values()]:
            if isinstance(a, AnyOnly):
                raise a.attempt.needs_whole(f"a comparison of a stand-in passed to {func}")
        return NotImplemented


class ShardStandIn(nn.Parameter):
    """A DTensor parameter while its module's initialisation runs (module docstring): the whole
    shape on the meta device; `_target` holds where writes go, `_writable` is False for a view."""

    _target: ShardTarget
    _writable = False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        full = torch.overrides.resolve_name(func) or getattr(func, "__qualname__", repr(func))
        if full in _INIT_ENTRIES:
            return super().__torch_function__(func, types, args, kwargs)
        name = full.removeprefix("torch.Tensor.")
        me = args[0] if args and isinstance(args[0], cls) else None
        operands = [a for a in _flat([*args[1:], *kwargs.values()]) if isinstance(a, cls)]
        if me is None or operands:
            target = (me or operands[0])._target
            raise target.attempt.needs_whole(f"{full} takes {target.name}'s values")
        target = me._target
        if name in _WRITES or name in _OPERATORS:
            return _write(me, _OPERATORS.get(name, name), args[1:], kwargs)
        if name in _METADATA:
            return super().__torch_function__(func, types, args, kwargs)
        if name == "device.__get__":
            return target.device
        if name in ("is_meta.__get__", "is_cuda.__get__", "is_cpu.__get__"):
            return name.split(".")[0] == f"is_{target.device.type}"
        if name == "requires_grad_":
            super().__torch_function__(func, types, args, kwargs)
            return me
        if name == "new_tensor":  # only the dtype is read
            return super().__torch_function__(func, types, args, {"device": target.device, **kwargs})
        if name in _ALIASES or name in _VIEWS:
            out = super().__torch_function__(func, types, args, kwargs)
            return _derived(out, target, writable=me._writable and name in _ALIASES)
        if name in _COMPARE and me._writable and target.bounds is not None and _is_number(args[1:]):
            side, compare = _COMPARE[name]
            extreme = target.bounds()[side]
            if not bool(extreme.isnan()):
                return AnyOnly(bool(compare(extreme, args[1])), target.attempt)
        raise target.attempt.needs_whole(f"{full} on {target.name}")


def _is_number(rest: tuple) -> bool:
    return len(rest) == 1 and isinstance(rest[0], (int, float)) and not isinstance(rest[0], bool)


def _flat(items) -> Iterator[object]:
    for a in items:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a


def _derived(out, target: ShardTarget, writable: bool):
    """A view of a stand-in as a stand-in of the same target (tuples of them for `split`)."""
    if isinstance(out, (list, tuple)):
        return type(out)(_derived(o, target, writable) for o in out)
    if not isinstance(out, torch.Tensor):
        return out
    view = out.as_subclass(ShardStandIn)
    view._target, view._writable = target, writable
    return view


def _write(me: ShardStandIn, name: str, args: tuple, kwargs: dict) -> ShardStandIn:
    """The in-place op `name` on the whole tensor, done on this rank's shard (module docstring)."""
    target = me._target
    if not me._writable:
        raise target.attempt.needs_whole(f"{name} on a view of {target.name}")
    tensors = [a for a in _flat([*args, *kwargs.values()]) if isinstance(a, torch.Tensor)]
    if any(isinstance(t, ShardStandIn) or t.is_meta or is_dtensor(t) for t in tensors):
        raise target.attempt.needs_whole(f"{name} of {target.name} with a stand-in, meta or DTensor operand")
    if kwargs.get("alpha", 1) != 1:  # a fused multiply-add rounds apart in vector and scalar kernels
        raise target.attempt.needs_whole(f"{name} with alpha on {target.name}")
    if name in _RANDOM:
        if tensors:
            raise target.attempt.needs_whole(f"{name} of {target.name} with tensor arguments")
        target.draw(name, args, kwargs)
        return me
    if target.shard is not None:

        def cut(a):
            return target.box(a) if isinstance(a, torch.Tensor) and a.dim() > 0 else a

        getattr(target.shard, name)(*map(cut, args), **{k: cut(v) for k, v in kwargs.items()})
    target.bounds = None
    target.written = target.written or name in _DEFINING
    return me


def _method(name: str):
    def write(self: ShardStandIn, *args, **kwargs) -> ShardStandIn:
        return _write(self, name, args, kwargs)

    write.__name__ = write.__qualname__ = name
    write.__doc__ = f"`Tensor.{name}` on the whole tensor, done on this rank's shard."
    return write


for _name in sorted(_WRITES):  # the class's own methods: nn.init bodies call these directly
    setattr(ShardStandIn, _name, _method(_name))


def stand_in(target: ShardTarget, requires_grad: bool) -> ShardStandIn:
    """A parameter of `target`'s whole shape on the meta device whose writes reach `target`."""
    out = ShardStandIn(torch.empty(target.shape, dtype=target.dtype, device="meta"), requires_grad)
    out._target, out._writable = target, True
    return out
