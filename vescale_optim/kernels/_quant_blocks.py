"""The device functions of block-wise int8 quantization, shared by every kernel of
``_quant_triton``: a block's absmax and its rounding, the stochastic rounding's dither, the
tile of whole blocks a program owns, and the scales of the packed wire format as bytes.

Each program owns ``ROWS`` whole blocks, laid out as a ``(ROWS, BLOCK)`` tile
(``BLOCK`` is ``block_size`` rounded up to a power of two; the padding and a partial
last block are masked and read as zero). A block's absmax is a row reduction, so the
scale never needs a second pass. The arithmetic mirrors ``quant``'s torch reference
op for op, with correctly rounded division and square root (``div_rn``, ``sqrt_rn``).

NaN and Inf propagate exactly as in the reference, without depending on the float max
and min instructions: ``tl.max`` / ``tl.maximum`` / ``tl.minimum`` compile to ``max.f32``
/ ``min.f32``, which return the other operand of a NaN where torch propagates it, so a
NaN gradient would quietly become a finite scale and finite codes. The absmax is an
integer max over the magnitude bits, the clamp propagates NaN (``max.NaN.f32``), and a
NaN's code is 0 by an explicit test (what the reference's cast gives; ``quantize_rows``).

In a packed row (``rows`` rows of ``[numel int8 codes | nblocks fp32 scales as 4
little-endian bytes]``, ``packed.pack_blockwise``) a program's tile lies in one row (program
``pid`` is tile ``pid % tiles`` of row ``pid // tiles``), so the row's bases are int64 scalars
and the tile's offsets int32. Scales go through bytes, since a row's scales start at any byte
(no 4-byte alignment).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "absmax",
    "dither",
    "fmix24",
    "load_scales",
    "quantize_rows",
    "rint",
    "row_tile",
    "store_scales",
    "tile",
    "tile_at",
    "unpack_rows",
]


@triton.jit
def rint(y):
    """Round to nearest, ties to even (``torch.round``), exact for ``|y| < 2**22``."""
    r = tl.floor(y)
    d = y - r
    odd = (r - 2.0 * tl.floor(0.5 * r)) != 0.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), r + 1.0, r)


@triton.jit
def fmix24(h):
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h >> 8


@triton.jit
def dither(block_scales, salt, BLOCK: tl.constexpr):
    """Offsets in [0, 1): hashed column offset + hashed (block scale, step) offset, mod 1."""
    cols = fmix24(tl.arange(0, BLOCK).to(tl.uint32) * 0x9E3779B1)
    rows = fmix24(block_scales.to(tl.uint32, bitcast=True) ^ salt)
    return ((rows[:, None] + cols[None, :]) & 0xFFFFFF).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def absmax(x):
    """``max |x|`` of each row, NaN when the row holds one (``torch.amax``), Inf when it
    holds an Inf: an int32 max over the bits with the sign cleared (non-negative floats
    order as their bits do, and every NaN lies above Inf), so it is exact and does not
    depend on whether the float max instruction drops NaN (compiled ``max.f32`` does)."""
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.max(bits, axis=1).to(tl.float32, bitcast=True)


@triton.jit
def quantize_rows(x, offsets, STOCHASTIC: tl.constexpr):
    """Codes (fp32, in [-127, 127]) and scales of each row of an fp32 tile, rounded
    stochastically with the dither ``offsets`` when ``STOCHASTIC``; see
    ``quant._quantize_rows`` for the ``STOCHASTIC`` (second-moment) rules.

    A row holding a NaN gets a NaN scale (its codes then do not matter: ``q * NaN`` is
    NaN), one holding an Inf an Inf scale; as in the reference, the clamp passes NaN
    through (``torch.clamp``) and a NaN's code is 0 (the reference's float -> int8 cast
    gives 0 for NaN on x86 and ARM, and PTX's ``cvt`` does too; here it is explicit, and
    tested on ``y``, so it holds whatever the clamp makes of a NaN)."""
    scale = tl.div_rn(absmax(x), 127.0)
    scale = (scale.to(tl.int32, bitcast=True) & -256).to(tl.float32, bitcast=True)
    divisor = tl.where(scale > 0.0, scale, 1.0)
    y = tl.div_rn(x, divisor[:, None])
    if STOCHASTIC:
        q = tl.floor(y + offsets)
    else:
        q = rint(y)
    q = tl.clamp(q, -127.0, 127.0, propagate_nan=tl.PropagateNan.ALL)
    if STOCHASTIC:
        q = tl.where((q == 0.0) & (x > 0.0), 1.0, q)
    return tl.where(y == y, q, 0.0), scale


@triton.jit
def tile(n, nblocks, block_size, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's ``(ROWS, BLOCK)`` tile: its first element and first block (int64
    scalars, so any ``n`` works) and int32 offsets and masks relative to them (int64
    vectors cost registers, enough to spill)."""
    return tile_at(tl.program_id(0), n, nblocks, block_size, ROWS, BLOCK)


@triton.jit
def tile_at(index, n, nblocks, block_size, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """``tile`` for tile number ``index`` of ``n`` elements in ``nblocks`` blocks."""
    first = index.to(tl.int64) * ROWS
    start = first * block_size
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    offs = rows[:, None] * block_size + cols[None, :]
    left = tl.minimum(n - start, ROWS * BLOCK).to(tl.int32)
    rows_left = tl.minimum(nblocks - first, ROWS).to(tl.int32)
    mask = (cols[None, :] < block_size) & (offs < left)
    return start, first, rows, offs, mask, rows < rows_left


@triton.jit
def store_scales(ptr, rows, scale, row_mask):
    """Scale ``rows[i]`` as 4 little-endian bytes at ``ptr + 4 * rows[i]`` (any alignment)."""
    bits = scale.to(tl.uint32, bitcast=True)
    byte = tl.arange(0, 4)
    values = (bits[:, None] >> (8 * byte[None, :]).to(tl.uint32)) & 0xFF
    tl.store(ptr + rows[:, None] * 4 + byte[None, :], values.to(tl.uint8), mask=row_mask[:, None])


@triton.jit
def load_scales(ptr, rows, row_mask):
    """The scales ``store_scales`` wrote (0.0 where masked)."""
    at = ptr + rows * 4
    bits = tl.load(at, mask=row_mask, other=0).to(tl.uint32)
    bits |= tl.load(at + 1, mask=row_mask, other=0).to(tl.uint32) << 8
    bits |= tl.load(at + 2, mask=row_mask, other=0).to(tl.uint32) << 16
    bits |= tl.load(at + 3, mask=row_mask, other=0).to(tl.uint32) << 24
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def row_tile(tiles, numel, nblocks, block_size, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's packed row (int64) and its tile there (``tile_at``)."""
    pid = tl.program_id(0)
    row = pid // tiles
    start, first, rows, offs, mask, row_mask = tile_at(
        pid - row * tiles, numel, nblocks, block_size, ROWS, BLOCK
    )
    return row.to(tl.int64), start, first, rows, offs, mask, row_mask


@triton.jit
def unpack_rows(p_ptr, numel, start, first, rows, offs, mask, row_mask):
    """fp32 values of a tile of the packed row at ``p_ptr``: ``q * s``, exact (see ``quant``)."""
    q = tl.load(p_ptr + start + offs, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    scale = load_scales(p_ptr + numel + 4 * first, rows, row_mask)
    return q * scale[:, None]
