"""The packed 8-bit wire format of the unit collectives (``wire``'s "q8" codec): ``rows`` equal
pieces of a flat tensor, each quantized on its own (blocks counted from the piece's
start), as a ``[rows, width]`` uint8 tensor whose row ``r`` holds piece ``r``'s int8 codes
(``numel`` bytes), then its fp32 scales as little-endian bytes (``4 * ceil(numel /
block_size)``); ``width = packed_width(numel, block_size)``. When each piece is a whole
number of blocks the codes and scales are exactly ``quantize_blockwise`` of the whole.

The torch functions below are the reference (built on ``quant``'s blockwise quantizer);
``_quant_triton`` packs, unpacks and sums in one kernel each on CUDA.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._dispatch import triton_module
from .quant import _as_row_blocks, _as_rows, _backend, _check_block_size, _quantize_rows, _unpad, _unpad_rows

__all__ = ["pack_blockwise", "packed_width", "unpack_blockwise", "unpack_sum_blockwise"]


def packed_width(numel: int, block_size: int) -> int:
    """Bytes of one packed row of ``numel`` elements: its codes and one fp32 scale per block."""
    return numel + 4 * -(-numel // block_size)


def pack_blockwise(
    x: Tensor, rows: int, block_size: int = 256, out: Tensor | None = None, backend: str = "auto"
) -> Tensor:
    """Quantize ``x`` (flattened, cut into ``rows`` equal pieces) blockwise straight into the
    packed ``[rows, width]`` uint8 layout (see the module docstring), into ``out`` if given
    (a contiguous uint8 tensor of ``rows * width`` bytes, e.g. a collective's send buffer).

    Each piece's codes and scales are ``quantize_blockwise``'s of the piece, bit for bit;
    Triton writes them in one kernel, no intermediate codes or scales. Returns ``out``
    viewed as ``[rows, width]``.
    """
    _check_block_size(block_size)
    _check_rows(rows)
    if not x.is_floating_point():
        raise ValueError(f"pack_blockwise expects a floating-point tensor, got {x.dtype}")
    if x.numel() % rows:
        raise ValueError(f"x has {x.numel()} elements, not a multiple of rows={rows}")
    numel = x.numel() // rows
    width = packed_width(numel, block_size)
    if out is None:
        out = torch.empty(rows, width, dtype=torch.uint8, device=x.device)
    _check_buffer("out", out, rows * width, torch.uint8, x.device)
    out = out.view(rows, width)
    flat = x.reshape(-1)
    if _backend(backend, x, block_size) == "triton":
        if numel > 0:
            triton_module("_quant_triton", x).pack(flat.contiguous(), out, rows, block_size)
        return out
    q, scales = _quantize_rows(_as_row_blocks(flat.float().view(rows, numel), block_size))
    out[:, :numel].copy_(_unpad_rows(q, rows, numel).view(torch.uint8))
    out[:, numel:].copy_(scales.view(rows, -1).view(torch.uint8))
    return out


def unpack_blockwise(
    packed: Tensor,
    rows: int,
    block_size: int = 256,
    dtype: torch.dtype | None = None,
    out: Tensor | None = None,
    backend: str = "auto",
) -> Tensor:
    """The values ``pack_blockwise`` packed into ``packed`` (``rows`` rows), dequantized
    (``q * scale``, then cast to ``dtype`` as ``dequantize_blockwise`` does) into flat
    ``out`` if given (contiguous, ``rows * numel`` elements of any float dtype: e.g. a
    unit's full buffer; ``dtype``, if given too, must be its dtype), else into a new flat
    ``dtype`` (default fp32) tensor.
    Without ``out``, ``numel`` follows from the width, so each row must be whole blocks.
    Triton: one kernel, straight from the packed bytes."""
    _check_block_size(block_size)
    _check_rows(rows)
    numel = _packed_numel(packed, rows, block_size, None if out is None else out.numel())
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    if out is None:
        out = torch.empty(rows * numel, dtype=dtype or torch.float32, device=packed.device)
    _check_buffer("out", out, rows * numel, dtype, packed.device)
    packed = packed.view(rows, packed.numel() // rows)
    if _backend(backend, packed, block_size) == "triton":
        if numel > 0:
            triton_module("_quant_triton", packed).unpack(packed, out, rows, block_size)
        return out
    codes = _as_row_blocks(packed[:, :numel].view(torch.int8), block_size)
    scales = _packed_scales(packed[:, numel:])
    out.view(rows, numel).copy_(_unpad_rows(codes.float() * scales[:, None], rows, numel))
    return out


def unpack_sum_blockwise(
    packed: Tensor, rows: int, block_size: int = 256, out: Tensor | None = None, backend: str = "auto"
) -> Tensor:
    """The fp32 sum over the ``rows`` rows of ``packed``'s dequantized values (flat, one
    row's ``numel`` elements; into fp32 ``out`` if given): row 0, then each next row added
    in order, one rounding each, so every backend gives the same bits (NaN and Inf as
    fp32 addition makes them). Triton: one kernel, no dequantized rows in memory."""
    _check_block_size(block_size)
    _check_rows(rows)
    numel = _packed_numel(packed, rows, block_size, None if out is None else out.numel() * rows)
    if out is None:
        out = torch.empty(numel, dtype=torch.float32, device=packed.device)
    _check_buffer("out", out, numel, torch.float32, packed.device)
    packed = packed.view(rows, packed.numel() // rows)
    if _backend(backend, packed, block_size) == "triton":
        if numel > 0:
            triton_module("_quant_triton", packed).unpack_sum(packed, out, rows, block_size)
        return out
    for r in range(rows):
        codes = _as_rows(packed[r, :numel].view(torch.int8), block_size)
        row = _unpad(codes.float() * _packed_scales(packed[r, numel:])[:, None], numel)
        if r == 0:
            out.copy_(row)
        else:
            out.add_(row)
    return out


def _packed_scales(scale_bytes: Tensor) -> Tensor:
    """The fp32 scales of packed scale bytes, flat (copied: in the packed rows they need not
    be 4-byte aligned)."""
    flat = torch.empty(scale_bytes.shape, dtype=torch.uint8, device=scale_bytes.device).copy_(scale_bytes)
    return flat.view(-1).view(torch.float32)


def _packed_numel(packed: Tensor, rows: int, block_size: int, total: int | None) -> int:
    """Elements a row of ``packed`` holds: ``total / rows`` (the output's size) when known,
    else what its width gives for whole blocks; checks ``packed`` against it."""
    if packed.dtype != torch.uint8 or not packed.is_contiguous() or packed.numel() % rows:
        raise ValueError(
            f"packed must be a contiguous uint8 tensor of rows={rows} equal rows, "
            f"got {packed.dtype} of shape {tuple(packed.shape)}"
        )
    width = packed.numel() // rows
    if total is None:
        numel, rem = divmod(width * block_size, block_size + 4)
        if rem or numel % block_size:
            raise ValueError(
                f"a packed row of {width} bytes is no whole number of {block_size}-element blocks "
                "(pass out= to give the number of elements)"
            )
    elif total % rows:
        raise ValueError(f"out has {total} elements, not a multiple of rows={rows}")
    else:
        numel = total // rows
    if packed_width(numel, block_size) != width:
        raise ValueError(
            f"a packed row of {numel} elements in {block_size}-element blocks has "
            f"{packed_width(numel, block_size)} bytes, packed has {width}"
        )
    return numel


def _check_rows(rows: int) -> None:
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be a positive integer, got {rows!r}")


def _check_buffer(name: str, t: Tensor, numel: int, dtype: torch.dtype | None, device: torch.device) -> None:
    """``t`` is a contiguous buffer of ``numel`` elements of ``dtype`` (any float when None) on ``device``."""
    ok = t.dtype == dtype if dtype is not None else t.is_floating_point()
    if not ok or t.numel() != numel or not t.is_contiguous() or t.device != device:
        want = dtype if dtype is not None else "floating-point"
        raise ValueError(
            f"{name} must be a contiguous {want} tensor of {numel} elements on {device}, "
            f"got {t.dtype} of shape {tuple(t.shape)} on {t.device}"
        )
