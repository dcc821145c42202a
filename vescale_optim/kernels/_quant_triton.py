"""Triton kernels for block-wise int8 quantization and the fused 8-bit AdamW update, and
their launchers.

Each kernel is built from ``_quant_blocks``' device functions (a program's tile of whole
blocks, a block's absmax and rounding, NaN and Inf as the torch reference ``quant`` has them).
The launchers plan each launch (``*_launch``, which ``aot`` compiles ahead of time) before
running it.

The packed kernels (``pack``, ``unpack``, ``unpack_sum``) read and write the 8-bit wire
format of the unit collectives, ``rows`` rows of ``[numel int8 codes | nblocks fp32
scales as 4 little-endian bytes]`` (``packed.pack_blockwise``), with the same tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._quant_blocks import dither, quantize_rows, row_tile, store_scales, tile, unpack_rows
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
    start, first, rows, offs, mask, row_mask = tile(n, nblocks, block_size, ROWS, BLOCK)
    x_ptr += start
    q_ptr += start
    s_ptr += first
    x = upcast(tl.load(x_ptr + offs, mask=mask, other=0.0), INTERPRETED)
    q, scale = quantize_rows(x, 0.0, False)
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
    start, first, rows, offs, mask, row_mask = tile(n, nblocks, block_size, ROWS, BLOCK)
    q_ptr += start
    s_ptr += first
    out_ptr += start
    q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float32)
    scale = tl.load(s_ptr + rows, mask=row_mask, other=0.0)
    x = cast_rne(q * scale[:, None], out_ptr.dtype.element_ty, INTERPRETED)
    tl.store(out_ptr + offs, x, mask=mask)


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
    row, start, first, rows, offs, mask, row_mask = row_tile(tiles, numel, nblocks, block_size, ROWS, BLOCK)
    x_ptr += row * numel + start
    p_ptr += row * width
    x = upcast(tl.load(x_ptr + offs, mask=mask, other=0.0), INTERPRETED)
    q, scale = quantize_rows(x, 0.0, False)
    tl.store(p_ptr + start + offs, q.to(tl.int8).to(tl.uint8, bitcast=True), mask=mask)
    store_scales(p_ptr + numel + 4 * first, rows, scale, row_mask)


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
    row, start, first, rows, offs, mask, row_mask = row_tile(tiles, numel, nblocks, block_size, ROWS, BLOCK)
    p_ptr += row * width  # both bases before the loads: ptxas then spills nowhere (sm_90, BLOCK 8192)
    out_ptr += row * numel + start
    x = unpack_rows(p_ptr, numel, start, first, rows, offs, mask, row_mask)
    tl.store(out_ptr + offs, cast_rne(x, out_ptr.dtype.element_ty, INTERPRETED), mask=mask)


@triton.jit
def _unpack_sum_kernel(
    p_ptr, out_ptr, nrows, numel, nblocks, width, block_size, ROWS: tl.constexpr, BLOCK: tl.constexpr
):
    """fp32 sum over the ``nrows`` packed rows of a tile's dequantized values, in row order
    (row 0, then ``+=`` each next row: exactly the reference's sequence of fp32 adds; a
    contracted ``q * s + acc`` changes nothing, since ``q * s`` is exact)."""
    start, first, rows, offs, mask, row_mask = tile(numel, nblocks, block_size, ROWS, BLOCK)
    acc = unpack_rows(p_ptr, numel, start, first, rows, offs, mask, row_mask)
    for _ in range(1, nrows):
        p_ptr += width  # 64-bit pointer arithmetic: any rows * width
        acc += unpack_rows(p_ptr, numel, start, first, rows, offs, mask, row_mask)
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
    start, first, rows, offs, mask, row_mask = tile(n, nblocks, block_size, ROWS, BLOCK)
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
    q, scale = quantize_rows(exp_avg, 0.0, False)
    tl.store(qm_ptr + offs, q.to(tl.int8), mask=mask)
    tl.store(sm_ptr + rows, scale, mask=row_mask)
    q, scale = quantize_rows(root, dither(sv, salt, BLOCK), True)
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
