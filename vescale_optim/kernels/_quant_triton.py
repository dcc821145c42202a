"""Triton kernels for block-wise int8 quantization and the fused 8-bit AdamW update.

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
NaN's code is 0 by an explicit test (what the reference's cast gives; ``_quantize_rows``).

The packed kernels (``pack``, ``unpack``, ``unpack_sum``) read and write the 8-bit wire
format of the unit collectives, ``rows`` rows of ``[numel int8 codes | nblocks fp32
scales as 4 little-endian bytes]`` (``packed.pack_blockwise``), with the same tiles: a
program's tile lies in one row (program ``pid`` is tile ``pid % tiles`` of row
``pid // tiles``), so the row's bases are int64 scalars and the tile's offsets int32.
Scales go through bytes, since a row's scales start at any byte (no 4-byte alignment).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._triton_common import INTERPRET, Launch, cast_rne, device_of, upcast

__all__ = [
    "INTERPRET",
    "adamw8bit",
    "adamw8bit_launch",
    "block_config",
    "dequantize",
    "dequantize_launch",
    "pack",
    "pack_launch",
    "quantize",
    "quantize_launch",
    "unpack",
    "unpack_launch",
    "unpack_sum",
    "unpack_sum_launch",
]

_TILE_ELEMENTS = 2048


@triton.jit
def _rint(y):
    """Round to nearest, ties to even (``torch.round``), exact for ``|y| < 2**22``."""
    r = tl.floor(y)
    d = y - r
    odd = (r - 2.0 * tl.floor(0.5 * r)) != 0.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), r + 1.0, r)


@triton.jit
def _fmix24(h):
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h >> 8


@triton.jit
def _dither(block_scales, salt, BLOCK: tl.constexpr):
    """Offsets in [0, 1): hashed column offset + hashed (block scale, step) offset, mod 1."""
    cols = _fmix24(tl.arange(0, BLOCK).to(tl.uint32) * 0x9E3779B1)
    rows = _fmix24(block_scales.to(tl.uint32, bitcast=True) ^ salt)
    return ((rows[:, None] + cols[None, :]) & 0xFFFFFF).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _absmax(x):
    """``max |x|`` of each row, NaN when the row holds one (``torch.amax``), Inf when it
    holds an Inf: an int32 max over the bits with the sign cleared (non-negative floats
    order as their bits do, and every NaN lies above Inf), so it is exact and does not
    depend on whether the float max instruction drops NaN (compiled ``max.f32`` does)."""
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.max(bits, axis=1).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_rows(x, dither, STOCHASTIC: tl.constexpr):
    """Codes (fp32, in [-127, 127]) and scales of each row of an fp32 tile; see
    ``quant._quantize_rows`` for the ``STOCHASTIC`` (second-moment) rules.

    A row holding a NaN gets a NaN scale (its codes then do not matter: ``q * NaN`` is
    NaN), one holding an Inf an Inf scale; as in the reference, the clamp passes NaN
    through (``torch.clamp``) and a NaN's code is 0 (the reference's float -> int8 cast
    gives 0 for NaN on x86 and ARM, and PTX's ``cvt`` does too; here it is explicit, and
    tested on ``y``, so it holds whatever the clamp makes of a NaN)."""
    scale = tl.div_rn(_absmax(x), 127.0)
    scale = (scale.to(tl.int32, bitcast=True) & -256).to(tl.float32, bitcast=True)
    divisor = tl.where(scale > 0.0, scale, 1.0)
    y = tl.div_rn(x, divisor[:, None])
    if STOCHASTIC:
        q = tl.floor(y + dither)
    else:
        q = _rint(y)
    q = tl.clamp(q, -127.0, 127.0, propagate_nan=tl.PropagateNan.ALL)
    if STOCHASTIC:
        q = tl.where((q == 0.0) & (x > 0.0), 1.0, q)
    return tl.where(y == y, q, 0.0), scale


@triton.jit
def _tile(n, nblocks, block_size, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's ``(ROWS, BLOCK)`` tile: its first element and first block (int64
    scalars, so any ``n`` works) and int32 offsets and masks relative to them (int64
    vectors cost registers, enough to spill)."""
    return _tile_at(tl.program_id(0), n, nblocks, block_size, ROWS, BLOCK)


@triton.jit
def _tile_at(tile, n, nblocks, block_size, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """``_tile`` for tile number ``tile`` of ``n`` elements in ``nblocks`` blocks."""
    first = tile.to(tl.int64) * ROWS
    start = first * block_size
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    offs = rows[:, None] * block_size + cols[None, :]
    left = tl.minimum(n - start, ROWS * BLOCK).to(tl.int32)
    rows_left = tl.minimum(nblocks - first, ROWS).to(tl.int32)
    mask = (cols[None, :] < block_size) & (offs < left)
    return start, first, rows, offs, mask, rows < rows_left


@triton.jit
def _quantize_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    n,
    nblocks,
    block_size,
    INTERPRETED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    start, first, rows, offs, mask, row_mask = _tile(n, nblocks, block_size, ROWS, BLOCK)
    x_ptr += start
    q_ptr += start
    s_ptr += first
    x = upcast(tl.load(x_ptr + offs, mask=mask, other=0.0), INTERPRETED)
    q, scale = _quantize_rows(x, 0.0, False)
    tl.store(q_ptr + offs, q.to(tl.int8), mask=mask)
    tl.store(s_ptr + rows, scale, mask=row_mask)


@triton.jit
def _dequantize_kernel(
    q_ptr,
    s_ptr,
    out_ptr,
    n,
    nblocks,
    block_size,
    INTERPRETED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    start, first, rows, offs, mask, row_mask = _tile(n, nblocks, block_size, ROWS, BLOCK)
    q_ptr += start
    s_ptr += first
    out_ptr += start
    q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float32)
    scale = tl.load(s_ptr + rows, mask=row_mask, other=0.0)
    x = cast_rne(q * scale[:, None], out_ptr.dtype.element_ty, INTERPRETED)
    tl.store(out_ptr + offs, x, mask=mask)


@triton.jit
def _store_scales(ptr, rows, scale, row_mask):
    """Scale ``rows[i]`` as 4 little-endian bytes at ``ptr + 4 * rows[i]`` (any alignment)."""
    bits = scale.to(tl.uint32, bitcast=True)
    byte = tl.arange(0, 4)
    values = (bits[:, None] >> (8 * byte[None, :]).to(tl.uint32)) & 0xFF
    tl.store(ptr + rows[:, None] * 4 + byte[None, :], values.to(tl.uint8), mask=row_mask[:, None])


@triton.jit
def _load_scales(ptr, rows, row_mask):
    """The scales ``_store_scales`` wrote (0.0 where masked)."""
    at = ptr + rows * 4
    bits = tl.load(at, mask=row_mask, other=0).to(tl.uint32)
    bits |= tl.load(at + 1, mask=row_mask, other=0).to(tl.uint32) << 8
    bits |= tl.load(at + 2, mask=row_mask, other=0).to(tl.uint32) << 16
    bits |= tl.load(at + 3, mask=row_mask, other=0).to(tl.uint32) << 24
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _row_tile(tiles, numel, nblocks, block_size, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's packed row (int64) and its tile there (``_tile_at``)."""
    pid = tl.program_id(0)
    row = pid // tiles
    start, first, rows, offs, mask, row_mask = _tile_at(
        pid - row * tiles, numel, nblocks, block_size, ROWS, BLOCK
    )
    return row.to(tl.int64), start, first, rows, offs, mask, row_mask


@triton.jit
def _unpack_rows(p_ptr, numel, start, first, rows, offs, mask, row_mask):
    """fp32 values of a tile of the packed row at ``p_ptr``: ``q * s``, exact (see ``quant``)."""
    q = tl.load(p_ptr + start + offs, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    scale = _load_scales(p_ptr + numel + 4 * first, rows, row_mask)
    return q * scale[:, None]


@triton.jit
def _pack_kernel(
    x_ptr,
    p_ptr,
    numel,
    nblocks,
    width,
    tiles,
    block_size,
    INTERPRETED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Quantize a tile of row ``row`` of ``x`` (``numel`` elements a row) straight into the
    packed ``[rows, width]`` bytes: codes at the tile's elements, scales after the codes."""
    row, start, first, rows, offs, mask, row_mask = _row_tile(tiles, numel, nblocks, block_size, ROWS, BLOCK)
    x_ptr += row * numel + start
    p_ptr += row * width
    x = upcast(tl.load(x_ptr + offs, mask=mask, other=0.0), INTERPRETED)
    q, scale = _quantize_rows(x, 0.0, False)
    tl.store(p_ptr + start + offs, q.to(tl.int8).to(tl.uint8, bitcast=True), mask=mask)
    _store_scales(p_ptr + numel + 4 * first, rows, scale, row_mask)


@triton.jit
def _unpack_kernel(
    p_ptr,
    out_ptr,
    numel,
    nblocks,
    width,
    tiles,
    block_size,
    INTERPRETED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Dequantize a tile of packed row ``row`` into ``out[row * numel:]`` in ``out``'s dtype."""
    row, start, first, rows, offs, mask, row_mask = _row_tile(tiles, numel, nblocks, block_size, ROWS, BLOCK)
    p_ptr += row * width  # both bases before the loads: ptxas then spills nowhere (sm_90, BLOCK 8192)
    out_ptr += row * numel + start
    x = _unpack_rows(p_ptr, numel, start, first, rows, offs, mask, row_mask)
    tl.store(out_ptr + offs, cast_rne(x, out_ptr.dtype.element_ty, INTERPRETED), mask=mask)


@triton.jit
def _unpack_sum_kernel(
    p_ptr, out_ptr, nrows, numel, nblocks, width, block_size, ROWS: tl.constexpr, BLOCK: tl.constexpr
):
    """fp32 sum over the ``nrows`` packed rows of a tile's dequantized values, in row order
    (row 0, then ``+=`` each next row: exactly the reference's sequence of fp32 adds; a
    contracted ``q * s + acc`` changes nothing, since ``q * s`` is exact)."""
    start, first, rows, offs, mask, row_mask = _tile(numel, nblocks, block_size, ROWS, BLOCK)
    acc = _unpack_rows(p_ptr, numel, start, first, rows, offs, mask, row_mask)
    for _ in range(1, nrows):
        p_ptr += width  # 64-bit pointer arithmetic: any rows * width
        acc += _unpack_rows(p_ptr, numel, start, first, rows, offs, mask, row_mask)
    tl.store(out_ptr + start + offs, acc, mask=mask)


@triton.jit(do_not_specialize=["salt"])
def _adamw8bit_kernel(
    p_ptr,
    g_ptr,
    qm_ptr,
    sm_ptr,
    qv_ptr,
    sv_ptr,
    n,
    nblocks,
    block_size,
    sign,
    salt,
    decay,
    w1,
    beta2,
    w2,
    step_size,
    bc2_sqrt,
    eps,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One fused 8-bit AdamW step; ``sign`` is -1.0 to maximize (exact, and one kernel for both)."""
    start, first, rows, offs, mask, row_mask = _tile(n, nblocks, block_size, ROWS, BLOCK)
    p_ptr += start
    g_ptr += start
    qm_ptr += start
    qv_ptr += start
    sm_ptr += first
    sv_ptr += first
    grad = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * sign
    sm = tl.load(sm_ptr + rows, mask=row_mask, other=0.0)
    exp_avg = tl.load(qm_ptr + offs, mask=mask, other=0).to(tl.float32) * sm[:, None]
    exp_avg = exp_avg + w1 * (grad - exp_avg)
    sv = tl.load(sv_ptr + rows, mask=row_mask, other=0.0)
    root = tl.load(qv_ptr + offs, mask=mask, other=0).to(tl.float32) * sv[:, None]
    exp_avg_sq = root * root * beta2 + w2 * grad * grad
    root = tl.sqrt_rn(exp_avg_sq)
    denom = tl.div_rn(root, bc2_sqrt) + eps
    param = tl.load(p_ptr + offs, mask=mask, other=0.0) * decay
    param = param + tl.div_rn(-step_size * exp_avg, denom)
    tl.store(p_ptr + offs, param, mask=mask)
    q, scale = _quantize_rows(exp_avg, 0.0, False)
    tl.store(qm_ptr + offs, q.to(tl.int8), mask=mask)
    tl.store(sm_ptr + rows, scale, mask=row_mask)
    q, scale = _quantize_rows(root, _dither(sv, salt, BLOCK), True)
    tl.store(qv_ptr + offs, q.to(tl.int8), mask=mask)
    tl.store(sv_ptr + rows, scale, mask=row_mask)


def block_config(block_size: int) -> dict:
    """Tile shape and warps of every kernel here for ``block_size``-element blocks (the one
    place they are chosen): ``ROWS`` blocks of ``BLOCK`` lanes, at least 2048 elements a
    program. Tiles above 2048 take 8 warps, not 16: 512 threads leave 128 registers each,
    and the fused update spills there."""
    block = triton.next_power_of_2(block_size)
    rows = max(1, _TILE_ELEMENTS // block)
    return dict(ROWS=rows, BLOCK=block, num_warps=4 if rows * block <= _TILE_ELEMENTS else 8)


def _grid(n: int, block_size: int, config: dict) -> tuple[tuple[int], int]:
    nblocks = triton.cdiv(n, block_size)
    return (triton.cdiv(nblocks, config["ROWS"]),), nblocks


def quantize_launch(flat: Tensor, block_size: int) -> tuple[Launch, Tensor, Tensor]:
    """The launch of ``quantize`` and the codes and scales it will write."""
    n = flat.numel()
    config = block_config(block_size)
    grid, nblocks = _grid(n, block_size, config)
    q = torch.empty(n, dtype=torch.int8, device=flat.device)
    scales = torch.empty(nblocks, dtype=torch.float32, device=flat.device)
    args = (flat, q, scales, n, nblocks, block_size)
    return Launch(_quantize_kernel, grid, args, dict(INTERPRETED=INTERPRET, **config)), q, scales


def quantize(flat: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Triton ``quantize_blockwise`` of a contiguous flat tensor."""
    launch, q, scales = quantize_launch(flat, block_size)
    with device_of(flat):
        launch()
    return q, scales


def dequantize_launch(
    q: Tensor, scales: Tensor, block_size: int, dtype: torch.dtype
) -> tuple[Launch, Tensor]:
    """The launch of ``dequantize`` and the tensor it will write."""
    n = q.numel()
    config = block_config(block_size)
    grid, nblocks = _grid(n, block_size, config)
    out = torch.empty(n, dtype=dtype, device=q.device)
    args = (q, scales, out, n, nblocks, block_size)
    return Launch(_dequantize_kernel, grid, args, dict(INTERPRETED=INTERPRET, **config)), out


def dequantize(q: Tensor, scales: Tensor, block_size: int, dtype: torch.dtype) -> Tensor:
    """Triton ``dequantize_blockwise`` of contiguous flat codes into a new ``dtype`` tensor."""
    launch, out = dequantize_launch(q, scales, block_size, dtype)
    with device_of(q):
        launch()
    return out


def _row_grid(rows: int, numel: int, block_size: int, config: dict) -> tuple[tuple[int], int, int]:
    """Grid of the packed kernels (``tiles`` tiles in each of ``rows`` rows), blocks a row, tiles a row."""
    nblocks = triton.cdiv(numel, block_size)
    tiles = triton.cdiv(nblocks, config["ROWS"])
    return (rows * tiles,), nblocks, tiles


def pack_launch(flat: Tensor, out: Tensor, rows: int, block_size: int) -> Launch:
    """The launch of ``pack``: ``flat`` (``rows`` equal rows) into ``out`` (``[rows, width]`` bytes)."""
    numel = flat.numel() // rows
    config = block_config(block_size)
    grid, nblocks, tiles = _row_grid(rows, numel, block_size, config)
    args = (flat, out, numel, nblocks, out.numel() // rows, tiles, block_size)
    return Launch(_pack_kernel, grid, args, dict(INTERPRETED=INTERPRET, **config))


def pack(flat: Tensor, out: Tensor, rows: int, block_size: int) -> None:
    """Triton ``pack_blockwise`` of a contiguous flat tensor into contiguous ``out``: one kernel."""
    launch = pack_launch(flat, out, rows, block_size)
    with device_of(flat):
        launch()


def unpack_launch(packed: Tensor, out: Tensor, rows: int, block_size: int) -> Launch:
    """The launch of ``unpack``: packed ``[rows, width]`` bytes into flat ``out``."""
    numel = out.numel() // rows
    config = block_config(block_size)
    grid, nblocks, tiles = _row_grid(rows, numel, block_size, config)
    args = (packed, out, numel, nblocks, packed.numel() // rows, tiles, block_size)
    return Launch(_unpack_kernel, grid, args, dict(INTERPRETED=INTERPRET, **config))


def unpack(packed: Tensor, out: Tensor, rows: int, block_size: int) -> None:
    """Triton ``unpack_blockwise`` into contiguous ``out`` (any float dtype): one kernel."""
    launch = unpack_launch(packed, out, rows, block_size)
    with device_of(packed):
        launch()


def unpack_sum_launch(packed: Tensor, out: Tensor, rows: int, block_size: int) -> Launch:
    """The launch of ``unpack_sum``: the fp32 row sum of packed ``[rows, width]`` bytes into ``out``."""
    numel = out.numel()
    config = block_config(block_size)
    grid, nblocks = _grid(numel, block_size, config)
    args = (packed, out, rows, numel, nblocks, packed.numel() // rows, block_size)
    return Launch(_unpack_sum_kernel, grid, args, config)


def unpack_sum(packed: Tensor, out: Tensor, rows: int, block_size: int) -> None:
    """Triton ``unpack_sum_blockwise`` into contiguous fp32 ``out``: one kernel."""
    launch = unpack_sum_launch(packed, out, rows, block_size)
    with device_of(packed):
        launch()


def adamw8bit_launch(
    p: Tensor,
    g: Tensor,
    qm: Tensor,
    sm: Tensor,
    qv: Tensor,
    sv: Tensor,
    block_size: int,
    *,
    salt: int,
    decay: float,
    w1: float,
    beta2: float,
    w2: float,
    step_size: float,
    bc2_sqrt: float,
    eps: float,
    maximize: bool,
) -> Launch:
    """The launch of ``adamw8bit``."""
    n = p.numel()
    config = block_config(block_size)
    grid, nblocks = _grid(n, block_size, config)
    args = (
        p,
        g,
        qm,
        sm,
        qv,
        sv,
        n,
        nblocks,
        block_size,
        -1.0 if maximize else 1.0,
        salt,
        decay,
        w1,
        beta2,
        w2,
        step_size,
        bc2_sqrt,
        eps,
    )
    return Launch(_adamw8bit_kernel, grid, args, config)


def adamw8bit(
    p: Tensor, g: Tensor, qm: Tensor, sm: Tensor, qv: Tensor, sv: Tensor, block_size: int, **hyper
) -> None:
    """Triton ``adamw8bit_update_``: one fused pass, each block read and written once;
    ``hyper`` as in ``adamw8bit_launch``."""
    launch = adamw8bit_launch(p, g, qm, sm, qv, sv, block_size, **hyper)
    with device_of(p):
        launch()
