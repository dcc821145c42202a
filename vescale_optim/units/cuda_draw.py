"""CUDA random fills drawn a chunk at a time, bitwise those of the whole tensor's draw.

`shard_init` keeps a rank's shard of a tensor's random fill; on CUDA this module draws only the
chunks that hold the shard, so the scratch buffer is one chunk (about `CHUNK_BYTES`), never the
whole parameter, and the values and the generator's offset after are those of the whole draw.

How torch lays a contiguous tensor of n elements over Philox streams, as its recent source reads
(aten/src/ATen/native/cuda/DistributionTemplates.h: `calc_execution_policy`,
`distribution_nullary_kernel`, `distribution_elementwise_grid_stride_kernel`,
`uniform_and_transform`, `normal_and_transform`; aten/src/ATen/TensorIterator.cpp:
`SplitUntil32Bit`, `split`). Older releases took the increment with U = 4 for double too; the
self-check below refutes whatever a release does otherwise.

- blocks of B = 256 threads, a grid of G(n) = min(S * (T // 256), ceil(n / 256)) blocks, S the
  device's multiprocessors and T its most threads per multiprocessor
  (`torch.cuda.get_device_properties`: `multi_processor_count`, `max_threads_per_multi_processor`);
- thread t (t < B * G) starts curand's Philox at (seed, subsequence t, offset o), o the generator's
  offset as the launch takes it, and its loop iteration k takes one 128-bit Philox counter
  (4 units of the offset): `curand_uniform4` / `curand_normal4` give U = 4 values (float, half,
  bfloat16: their math is float), `curand_uniform2_double` / `curand_normal2_double` U = 2
  (double); value ii < U goes to element k * B*G*U + ii * B*G + t;
- the launch moves the generator's offset on by ceil(n / (B*G*U)) * 4.

So once G is saturated (G(n) = S * (T // 256)), the elements [c * P, (c + 1) * P) with
P = B * G * U (`Geometry.period`) are iteration c of every thread, and a launch of m >= P
elements at offset o + 4 * c draws, in its first entries, what the whole launch draws from
element c * P on. A chunk is a multiple of P; a tensor no longer than a chunk is drawn whole.

A tensor that 32-bit indexing cannot address (more than 2^31 - 1 elements or bytes) is drawn
thus: the whole count's increment is taken first (unused), then the tensor is halved (the first
half floor(n / 2) elements) until every piece can be, and the pieces are launched in flat order,
each as a tensor of its own that takes its own increment in turn (`Geometry.pieces`).

This is torch's kernels' inside, not its API: each (device, dtype, fill) is checked once per
process before its first use (`shard_sized`): a calibration tensor of two periods and a tail,
drawn whole and chunk by chunk from one state on a generator of its own, must agree bitwise, the
offset after included; the first tensor that needs pieces is checked likewise on a calibration
tensor just over 2^31 bytes (2 GiB once, freed at once). When a check fails, or the device does
not tell its geometry, the caller draws the whole parameter (its whole size, one parameter at a
time) and a warning says why, once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

BLOCK = 256  # threads per block of the fills' launches
INDEX_LIMIT = 2**31 - 1  # the most elements, and bytes, a launch indexes in 32 bits
OFFSET_PER_ITERATION = 4  # each loop iteration takes one Philox counter: 4 units of the offset
CHUNK_BYTES = 32 << 20  # the scratch buffer's size, about (a whole number of periods)
FILLS = ("uniform_", "normal_")
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_SEED = 20250917  # the calibrations' own generator's seed


@dataclass(frozen=True)
class Geometry:
    """How a fill's launches lay a contiguous tensor's elements over Philox streams (module
    docstring): `blocks` the saturated grid, `unroll` the values of one Philox counter."""

    blocks: int
    unroll: int
    element_size: int
    block: int = BLOCK
    index_limit: int = INDEX_LIMIT

    @property
    def period(self) -> int:
        """Elements of one loop iteration of a saturated launch."""
        return self.block * self.blocks * self.unroll

    def increment(self, n: int) -> int:
        """How far a launch of `n` elements moves the generator's offset on."""
        grid = min(self.blocks, -(-n // self.block))
        return -(-n // (self.block * grid * self.unroll)) * OFFSET_PER_ITERATION

    def fits(self, n: int) -> bool:
        """Whether one launch indexes `n` elements (and their bytes) in 32 bits."""
        return n <= self.index_limit and 1 + (n - 1) * self.element_size <= self.index_limit

    def pieces(self, n: int, start: int = 0) -> list[tuple[int, int]]:
        """The launches of a fill of `n` elements as `(start, count)`, in launch order."""
        if self.fits(n):
            return [(start, n)]
        half = n // 2
        return self.pieces(half, start) + self.pieces(n - half, start + half)

    def chunk(self, target_bytes: int = CHUNK_BYTES) -> int:
        """Elements of a chunk: whole periods, about `target_bytes`, one launch's worth at most."""
        periods = max(1, target_bytes // (self.period * self.element_size))
        while periods > 1 and not self.fits(periods * self.period):
            periods -= 1
        return periods * self.period


class Launch(NamedTuple):
    """One launch of a chunked fill: `length` elements drawn at the generator's offset `offset`,
    whose first `stop - start` are the whole draw's elements `[start, stop)`."""

    start: int
    stop: int
    length: int
    offset: int


def plan(
    geometry: Geometry, n: int, base: int, chunk: int, needed: Callable[[int, int], bool]
) -> tuple[list[Launch], int]:
    """The launches that draw the chunks of a fill of `n` elements for which `needed(start, stop)`
    holds, the whole fill taking the generator at offset `base`; and its offset after the whole
    fill. `chunk` is a multiple of the period that one launch indexes."""
    if chunk % geometry.period or not geometry.fits(chunk):
        raise ValueError(f"a chunk of {chunk} elements is no whole number of periods of {geometry}")
    pieces = geometry.pieces(n)
    offset = base + (geometry.increment(n) if len(pieces) > 1 else 0)
    launches = []
    for start, count in pieces:
        if count <= chunk:  # the piece's own launch
            if needed(start, start + count):
                launches.append(Launch(start, start + count, count, offset))
        else:  # saturated: a chunk at j * chunk is iteration j * chunk / period on
            for at in range(0, count, chunk):
                stop = start + min(at + chunk, count)
                if needed(start + at, stop):
                    iteration = at // geometry.period
                    launches.append(
                        Launch(start + at, stop, chunk, offset + OFFSET_PER_ITERATION * iteration)
                    )
        offset += geometry.increment(count)
    return launches, offset


def run(
    launches: list[Launch],
    draw: Callable[[int, int], torch.Tensor],
    keep: Callable[[torch.Tensor, int, int], None],
) -> None:
    """Each launch drawn (`draw(length, offset)` fills and returns `length` elements at `offset`)
    and its part of the whole handed to `keep(part, start, stop)`."""
    for launch in launches:
        part = draw(launch.length, launch.offset)
        keep(part[: launch.stop - launch.start], launch.start, launch.stop)


def geometry_of(device: torch.device, dtype: torch.dtype) -> Geometry | None:
    """`device`'s geometry for fills of `dtype` (None when its properties do not tell)."""
    props = torch.cuda.get_device_properties(device)
    sms = getattr(props, "multi_processor_count", 0)
    threads = getattr(props, "max_threads_per_multi_processor", 0)
    if sms <= 0 or threads < BLOCK or dtype not in DTYPES:
        return None
    return Geometry(sms * (threads // BLOCK), 2 if dtype == torch.float64 else 4, dtype.itemsize)


class Fill(NamedTuple):
    """A random fill as the initialisation asked for it: `getattr(t, name)(*args, **kwargs)` on a
    tensor `t` of `dtype` on `device`, drawing from `generator` (`kwargs`' own, or the device's)."""

    name: str
    args: tuple
    kwargs: dict
    dtype: torch.dtype
    device: torch.device
    generator: torch.Generator

    def drawer(self, launches: list[Launch]) -> Callable[[int, int], torch.Tensor]:
        """`draw(length, offset)` for `run`: the fill of the first `length` elements of one
        scratch buffer (the longest launch's), the generator set to `offset` first."""
        scratch = torch.empty(
            max((launch.length for launch in launches), default=0), dtype=self.dtype, device=self.device
        )

        def draw(length: int, offset: int) -> torch.Tensor:
            self.generator.set_offset(offset)
            part = scratch[:length]
            getattr(part, self.name)(*self.args, **self.kwargs)
            return part

        return draw


class Bounds:
    """The whole fill's (minimum, maximum), replayed chunk by chunk from the generator's state
    `state` (where the fill started) when first asked (a rejection sampler's test), then kept;
    the generator is left as it was when asked."""

    def __init__(self, fill: Fill, state: torch.Tensor, n: int, geometry: Geometry, chunk: int):
        self.fill, self.state, self.n, self.geometry, self.chunk = fill, state, n, geometry, chunk
        self.found: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.found is None:
            generator = self.fill.generator
            now = generator.get_state()
            generator.set_state(self.state)
            low: list[torch.Tensor] = []
            high: list[torch.Tensor] = []

            def extremes(part: torch.Tensor, start: int, stop: int) -> None:
                lo, hi = torch.aminmax(part)
                low.append(torch.minimum(low.pop(), lo) if low else lo)
                high.append(torch.maximum(high.pop(), hi) if high else hi)

            try:
                launches, _ = plan(self.geometry, self.n, generator.get_offset(), self.chunk, _everything)
                run(launches, self.fill.drawer(launches), extremes)
            finally:
                generator.set_state(now)
            self.found = (low[0], high[0])
        return self.found


def _everything(start: int, stop: int) -> bool:
    return True


def shard_sized(
    name: str,
    args: tuple,
    kwargs: dict,
    n: int,
    dtype: torch.dtype,
    device: torch.device,
    needed: Callable[[int, int], bool],
    keep: Callable[[torch.Tensor, int, int], None],
    chunk_bytes: int = CHUNK_BYTES,
) -> Bounds | None:
    """The fill `name` of a tensor of `n` elements of `dtype` on the CUDA `device`, drawn chunk by
    chunk where `needed(start, stop)`, `keep(part, start, stop)` taking each; the generator left
    where the whole fill leaves it. Returns the whole's bounds (replayed when asked), or None,
    having drawn nothing, where the chunked draw is not proven for this device, dtype and fill:
    the caller then draws the whole tensor."""
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    index = device.index
    geometry = geometry_of(device, dtype) if name in FILLS else None
    if geometry is None:
        _refuse(
            (device, dtype, name, False),
            "the device does not tell its geometry, or the fill or dtype is not one proven",
        )
        return None
    if not _proven(device, dtype, name, geometry, split=not geometry.fits(n)):
        return None
    chunk = geometry.chunk(chunk_bytes)
    fill = Fill(
        name, args, kwargs, dtype, device, kwargs.get("generator") or torch.cuda.default_generators[index]
    )
    state = fill.generator.get_state()
    launches, final = plan(geometry, n, fill.generator.get_offset(), chunk, needed)
    try:
        run(launches, fill.drawer(launches), keep)
    except BaseException:
        fill.generator.set_state(state)
        raise
    fill.generator.set_offset(final)
    return Bounds(fill, state, n, geometry, chunk)


_VERDICTS: dict[tuple, str | None] = {}  # (device, dtype, fill, in pieces) -> None, or why not proven


def _proven(device: torch.device, dtype: torch.dtype, name: str, geometry: Geometry, split: bool) -> bool:
    """Whether chunked fills `name` of `dtype` on `device` (`split`: of tensors drawn in pieces)
    passed their calibration, run the first time it is asked in this process."""
    key = (device, dtype, name, split)
    if key not in _VERDICTS:
        try:
            reason = _calibrate(device, dtype, name, geometry, split)
        except Exception as e:  # a missing API, no memory for the calibration: not proven
            reason = f"the calibration raised {type(e).__name__}: {e}"
        if reason is None:
            _VERDICTS[key] = None
        else:
            _refuse(key, reason)
    return _VERDICTS[key] is None


def _refuse(key: tuple, reason: str) -> None:
    """Remember that `key` is drawn whole, and warn once."""
    if key in _VERDICTS:
        return
    _VERDICTS[key] = reason
    device, dtype, name, split = key
    warnings.warn(
        f"vescale_optim: {name} of {dtype} on {device}{' (over 2^31 bytes)' if split else ''} cannot be "
        f"drawn shard-sized bitwise as the whole parameter ({reason}); each such DTensor parameter is "
        f"drawn whole while it is initialised: its whole size in device memory on every rank, one "
        f"parameter at a time",
        RuntimeWarning,
        stacklevel=2,
    )


def _calibrate(
    device: torch.device, dtype: torch.dtype, name: str, geometry: Geometry, split: bool
) -> str | None:
    """None when a tensor drawn chunk by chunk equals its whole draw bitwise, offsets included;
    else what differed. `split`: a tensor just over 32-bit indexing, drawn in pieces."""
    generator = torch.Generator(device=device)
    generator.manual_seed(_SEED)
    generator.set_offset(8)
    state = generator.get_state()
    if split:
        first = (geometry.index_limit - 1) // geometry.element_size + 2  # the first count that splits
        n, chunk = first + geometry.period // 3, geometry.chunk()
    else:
        n, chunk = 2 * geometry.period + geometry.period // 3 + 5, geometry.period
    whole = torch.empty(n, dtype=dtype, device=device)
    getattr(whole, name)(generator=generator)
    after = generator.get_offset()
    launches, final = plan(geometry, n, 8, chunk, _everything)
    if final != after:
        return f"a fill of {n} elements moved the offset from 8 to {after}, not {final}"
    generator.set_state(state)
    differ: list[int] = []

    def compare(part: torch.Tensor, start: int, stop: int) -> None:
        if not differ and not torch.equal(part, whole[start:stop]):
            differ.append(start)

    run(
        launches, Fill(name, (), {"generator": generator}, dtype, device, generator).drawer(launches), compare
    )
    return f"the chunk from element {differ[0]} of {n} drew other values" if differ else None
