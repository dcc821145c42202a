"""The sweep ``kernels.aot`` compiles: every launch the dispatcher can plan, over a grid of inputs.

The launchers plan each launch before running it (``*_launch`` in ``_ns_triton`` and
``_quant_triton``, the packed wire format's kernels included); here the same planning runs on
meta tensors (no memory, no GPU), so every tile size, ``num_warps``, ``num_stages`` and dtype
the dispatcher can choose appears, with the argument specializations (divisibility by 16, unit
strides, int64 sizes) a real launch would get.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from . import _ns_triton, _quant_triton
from ._triton_common import Launch
from .newton_schulz import DEFAULT_COEFFICIENTS
from .packed import packed_width
from .quant import MAX_TRITON_BLOCK

__all__ = [
    "NS_BATCH",
    "NS_LARGE",
    "NS_RAGGED",
    "NS_WIDTHS",
    "PACK_ROWS",
    "QUANT_DTYPES",
    "QUANT_LARGE",
    "Case",
    "cases",
]

NS_WIDTHS = (16, 32, 64, 128, 1024, 4096)
"""Matrix sides swept for Newton–Schulz: every tile the choice clamps to (16 to 128) and
the widths of real weights; every (m, n) pair is taken, so tall matrices too."""
NS_RAGGED = ((24, 40), (100, 300), (1000, 3000), (3000, 1000))
"""Sides that are not multiples of 16: masked tiles, arguments without divisibility hints."""
NS_BATCH = 4
NS_LARGE = ((2, 32768, 65536),)
"""A stack past 2**31 elements: its batch stride is passed as int64 (another specialization)."""
QUANT_DTYPES = (torch.float32, torch.bfloat16)
QUANT_LARGE = ((1, 2**31 + 1), (256, 2**32))
"""Flat shards past 2**31 elements: ``n`` (and ``nblocks`` at block size 1) are int64 arguments."""
PACK_ROWS = 4
"""Rows (ranks) of the packed sweep."""
_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int8: "i8"}


@dataclass(frozen=True)
class Case:
    """A planned launch (on meta tensors) and the input it came from."""

    role: str
    input: str
    launch: Launch


def _meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _ns_inputs() -> Iterator[torch.Tensor]:
    for m in NS_WIDTHS:
        for n in NS_WIDTHS:
            yield _meta(m, n)
    for w in (128, 1024, 4096):
        yield _meta(NS_BATCH, w, w)
        yield _meta(NS_BATCH, w, 4 * w)
    for m, n in NS_RAGGED:
        yield _meta(m, n)
        yield _meta(NS_BATCH, m, n)
    for shape in NS_LARGE:
        yield _meta(*shape)


def _quant_inputs() -> Iterator[tuple[int, int]]:
    """(block_size, n) for every tile the choice can make, ``block_size <= MAX_TRITON_BLOCK``:
    a power of two with whole blocks, and a smaller odd size with a partial last block; then
    ``QUANT_LARGE``."""
    block = 1
    while block <= MAX_TRITON_BLOCK:
        yield block, 64 * block
        if block > 2:
            yield block // 2 + 1, 64 * (block // 2 + 1) - 1
        block *= 2
    yield from QUANT_LARGE


def cases() -> Iterator[Case]:
    """Every launch the dispatcher plans for the input sweep, Newton–Schulz first."""
    for x in _ns_inputs():
        name = f"bf16 {tuple(x.shape)}"
        _, plan = _ns_triton.newton_schulz_launches(x, 5, DEFAULT_COEFFICIENTS, 1e-7)
        for launch in plan:
            if isinstance(launch, Launch):
                yield Case("newton_schulz", name, launch)
    hyper = dict(
        salt=1,
        decay=0.99,
        w1=0.1,
        beta2=0.999,
        w2=0.001,
        step_size=1e-3,
        bc2_sqrt=0.03,
        eps=1e-8,
        maximize=False,
    )
    for block_size, n in _quant_inputs():
        for dtype in QUANT_DTYPES:
            name = f"{_DTYPE[dtype]} n={n} block_size={block_size}"
            x = _meta(n, dtype=dtype)
            launch, q, scales = _quant_triton.quantize_launch(x, block_size)
            yield Case("quantize", name, launch)
            launch, _ = _quant_triton.dequantize_launch(q, scales, block_size, dtype)
            yield Case("dequantize", name, launch)
            p = _meta(n, dtype=torch.float32)
            launch = _quant_triton.adamw8bit_launch(p, x, q, scales, q, scales, block_size, **hyper)
            yield Case("adamw8bit", name, launch)
    yield from _packed_cases()


def _packed_cases() -> Iterator[Case]:
    """The packed wire format's kernels over the same sweep: ``PACK_ROWS`` rows of whole
    blocks where ``n`` divides into them, else one row with a partial last block (in fp32
    only: the dtypes are swept on whole blocks, the masks and unaligned sizes here); the row
    sum of ``PACK_ROWS`` rows of ``n`` elements (a loop over rows: one row is a constant there)."""
    for block_size, n in _quant_inputs():
        rows = PACK_ROWS if n % (PACK_ROWS * block_size) == 0 else 1
        packed = _meta(rows, packed_width(n // rows, block_size), dtype=torch.uint8)
        for dtype in QUANT_DTYPES if rows > 1 or n > 2**31 else QUANT_DTYPES[:1]:
            name = f"{_DTYPE[dtype]} n={n} rows={rows} block_size={block_size}"
            x = _meta(n, dtype=dtype)
            yield Case("pack", name, _quant_triton.pack_launch(x, packed, rows, block_size))
            yield Case("unpack", name, _quant_triton.unpack_launch(packed, x, rows, block_size))
        summed = _meta(PACK_ROWS, packed_width(n, block_size), dtype=torch.uint8)
        launch = _quant_triton.unpack_sum_launch(summed, _meta(n, dtype=torch.float32), PACK_ROWS, block_size)
        yield Case("unpack_sum", f"fp32 n={n} rows={PACK_ROWS} block_size={block_size}", launch)
