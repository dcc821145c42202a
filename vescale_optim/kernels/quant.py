"""Block-wise int8 quantization and the fused 8-bit AdamW update.

Format: a tensor is flattened and cut into blocks of ``block_size`` elements (the last
block may be partial). Each block has one fp32 scale ``s = absmax / 127`` and stores
``q = round(x / s)`` in int8, clamped to ``[-127, 127]``; ``x ≈ q * s``. The scale's
low 8 mantissa bits are cleared, so ``127 * s`` and every ``q * s`` are exact in fp32:
this makes ``dequantize ∘ quantize`` exactly idempotent and costs a relative 2⁻¹⁶ of
precision in ``s``, far below the int8 step.

The torch functions below are the reference; ``_quant_triton`` computes the same
numbers on CUDA (and in the Triton interpreter for tests).

The packed 8-bit wire format of the unit collectives lives in ``packed``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ._dispatch import resolve_backend, triton_module

__all__ = ["adamw8bit_update_", "dequantize_blockwise", "quantize_blockwise"]

QMAX = 127
MAX_TRITON_BLOCK = 8192
_CHUNK_ELEMENTS = 1 << 20
_MASK32 = 0xFFFFFFFF
_COL_MIX, _STEP_MIX, _FMIX1, _FMIX2 = 0x9E3779B1, 0x27D4EB2F, 0x85EBCA6B, 0xC2B2AE35


def quantize_blockwise(x: Tensor, block_size: int = 256, backend: str = "auto") -> tuple[Tensor, Tensor]:
    """Quantize ``x`` to ``(q, scales)``: flat int8 codes and one fp32 scale per block.

    ``q`` has ``x.numel()`` elements, ``scales`` has ``ceil(numel / block_size)``.
    Rounding is to nearest (ties to even), so ``|x - q * s| <= s / 2`` in every block.
    """
    _check_block_size(block_size)
    if not x.is_floating_point():
        raise ValueError(f"quantize_blockwise expects a floating-point tensor, got {x.dtype}")
    flat = x.reshape(-1)
    if _backend(backend, x, block_size) == "triton" and flat.numel() > 0:
        return triton_module("_quant_triton", x).quantize(flat.contiguous(), block_size)
    rows = _as_rows(flat.float(), block_size)
    q, scales = _quantize_rows(rows)
    return _unpad(q, flat.numel()), scales


def dequantize_blockwise(
    q: Tensor,
    scales: Tensor,
    block_size: int = 256,
    backend: str = "auto",
    shape: tuple[int, ...] | torch.Size | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Return ``q * scale`` of its block, as ``dtype``, flat or reshaped to ``shape``."""
    _check_block_size(block_size)
    n = q.numel()
    if q.dtype != torch.int8:
        raise ValueError(f"q must be an int8 tensor, got {q.dtype}")
    _check_flat("scales", scales, math.ceil(n / block_size), torch.float32)
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    if shape is not None and math.prod(shape) != n:
        raise ValueError(f"shape {tuple(shape)} has {math.prod(shape)} elements, q has {n}")
    if _backend(backend, q, block_size) == "triton" and n > 0:
        x = triton_module("_quant_triton", q).dequantize(q.reshape(-1), scales, block_size, dtype)
    else:
        x = _unpad(_as_rows(q.reshape(-1), block_size).float() * scales[:, None], n).to(dtype)
    return x if shape is None else x.reshape(shape)


def adamw8bit_update_(
    param_fp32: Tensor,
    grad: Tensor,
    q_exp_avg: Tensor,
    s_exp_avg: Tensor,
    q_exp_avg_sq: Tensor,
    s_exp_avg_sq: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    maximize: bool = False,
    block_size: int = 256,
    backend: str = "auto",
) -> None:
    """One AdamW step on a flat fp32 parameter with block-quantized moments, in place.

    Block by block: dequantize both moments, apply ``torch.optim.AdamW``'s math
    (``p *= 1 - lr*wd``; ``m = lerp(m, g, 1-β1)``; ``v = β2 v + (1-β2) g²``;
    ``p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)``) and requantize, so the moments
    never exist in fp32 all at once. ``step`` is the step number after this update
    (1 for the first), as in torch's bias corrections.

    The first moment is stored as ``quantize_blockwise(m)``. The second moment is
    stored as ``sqrt(v)`` in the same format (codes in ``[0, 127]``), so
    ``v = (q * s)²``: the square root spans a ``127²`` range of ``v`` per block instead
    of ``127`` (absmax int8 on ``v`` itself zeroes most of a block and blows up
    ``m / sqrt(v)``), and its error lands directly on Adam's denominator. Two rounding
    rules apply to ``sqrt(v)`` only:

    - it is rounded stochastically (unbiased): ``v`` moves by about ``(1 - β2)`` per
      step, far less than one code, so round-to-nearest would freeze it. The dither
      hashes the step, the position inside the block and the block's previous scale:
      deterministic, identical in the torch reference and the Triton kernel, and
      independent of where the block sits in memory (so of the sharding);
    - a positive ``sqrt(v)`` never gets code 0 (it takes one step instead): a zero
      denominator would turn a small surviving ``m`` into an ``m / eps`` blow-up,
      while over-estimating a tiny ``v`` only shrinks that element's update.
    """
    n = _check_update_tensors(param_fp32, grad, q_exp_avg, s_exp_avg, q_exp_avg_sq, s_exp_avg_sq, block_size)
    _check_update_hyper(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step)
    if n == 0:
        return
    hyper = _kernel_scalars(lr, beta1, beta2, eps, weight_decay, step, maximize)
    args = (param_fp32, grad.contiguous(), q_exp_avg, s_exp_avg, q_exp_avg_sq, s_exp_avg_sq)
    if _backend(backend, param_fp32, block_size) == "triton":
        triton_module("_quant_triton", param_fp32).adamw8bit(*args, block_size, **hyper)
    else:
        _adamw8bit_torch(*args, block_size, **hyper)


def _check_update_tensors(
    param_fp32: Tensor,
    grad: Tensor,
    q_exp_avg: Tensor,
    s_exp_avg: Tensor,
    q_exp_avg_sq: Tensor,
    s_exp_avg_sq: Tensor,
    block_size: int,
) -> int:
    """The number of elements of `adamw8bit_update_`'s flat tensors, once their shapes,
    dtypes and devices are checked."""
    _check_block_size(block_size)
    n = param_fp32.numel()
    nblocks = math.ceil(n / block_size)
    _check_flat("param_fp32", param_fp32, n, torch.float32)
    if grad.ndim != 1 or grad.numel() != n or not grad.is_floating_point():
        raise ValueError(
            f"grad must be a flat floating-point tensor of {n} elements, "
            f"got {grad.dtype} of shape {tuple(grad.shape)}"
        )
    _check_flat("q_exp_avg", q_exp_avg, n, torch.int8)
    _check_flat("q_exp_avg_sq", q_exp_avg_sq, n, torch.int8)
    _check_flat("s_exp_avg", s_exp_avg, nblocks, torch.float32)
    _check_flat("s_exp_avg_sq", s_exp_avg_sq, nblocks, torch.float32)
    tensors = (grad, q_exp_avg, s_exp_avg, q_exp_avg_sq, s_exp_avg_sq)
    if any(t.device != param_fp32.device for t in tensors):
        raise ValueError("all tensors of adamw8bit_update_ must be on param_fp32's device")
    return n


def _check_update_hyper(
    *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int
) -> None:
    """torch's AdamW ranges for the hyperparameters; a step counted from 1."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an integer >= 1, got {step!r}")
    if not lr >= 0.0 or not eps >= 0.0 or not weight_decay >= 0.0:
        raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"betas must be in [0, 1), got ({beta1}, {beta2})")


def _kernel_scalars(
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int, maximize: bool
) -> dict:
    """The update's scalars as both implementations take them: the decay, the moments'
    weights and torch's bias corrections folded into per-step constants, and the dither's salt."""
    return dict(
        salt=(step * _STEP_MIX) & 0x7FFFFFFF,
        decay=1.0 - lr * weight_decay,
        w1=1.0 - beta1,
        beta2=beta2,
        w2=1.0 - beta2,
        step_size=lr / (1.0 - beta1**step),
        bc2_sqrt=math.sqrt(1.0 - beta2**step),
        eps=eps,
        maximize=maximize,
    )


def _adamw8bit_torch(
    p: Tensor,
    g: Tensor,
    qm: Tensor,
    sm: Tensor,
    qv: Tensor,
    sv: Tensor,
    block_size: int,
    *,
    decay: float,
    w1: float,
    beta2: float,
    w2: float,
    step_size: float,
    bc2_sqrt: float,
    eps: float,
    maximize: bool,
    salt: int,
) -> None:
    """Reference: torch.optim.AdamW's single-tensor ops, a chunk of blocks at a time."""
    n, bs = p.numel(), block_size
    chunk = max(1, _CHUNK_ELEMENTS // bs)
    for b0 in range(0, sm.numel(), chunk):
        b1 = min(sm.numel(), b0 + chunk)
        lo, hi = b0 * bs, min(n, b1 * bs)
        grad = _as_rows(g[lo:hi].float(), bs)
        if maximize:
            grad = -grad
        exp_avg = _as_rows(qm[lo:hi], bs).float() * sm[b0:b1, None]
        dither = _dither(sv[b0:b1], bs, salt)
        exp_avg_sq = (_as_rows(qv[lo:hi], bs).float() * sv[b0:b1, None]).square_()
        exp_avg.lerp_(grad, w1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=w2)
        root = exp_avg_sq.sqrt_()
        denom = (root / bc2_sqrt).add_(eps)
        param = p[lo:hi]
        param.mul_(decay)
        param.addcdiv_(_unpad(exp_avg, hi - lo), _unpad(denom, hi - lo), value=-step_size)
        q, sm[b0:b1] = _quantize_rows(exp_avg)
        qm[lo:hi] = _unpad(q, hi - lo)
        q, sv[b0:b1] = _quantize_rows(root, dither)
        qv[lo:hi] = _unpad(q, hi - lo)


def _scale(absmax: Tensor) -> Tensor:
    """``absmax / 127`` with the low 8 mantissa bits cleared (see the module docstring)."""
    return (absmax / QMAX).view(torch.int32).bitwise_and_(-256).view(torch.float32)


def _quantize_rows(rows: Tensor, dither: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Quantize each row of a ``(blocks, block_size)`` fp32 tensor to nearest; with a
    ``dither`` in ``[0, 1)``, round ``floor(y + dither)`` and keep positive values off
    code 0 (the ``sqrt(v)`` rules of ``adamw8bit_update_``)."""
    scales = _scale(rows.abs().amax(dim=1))
    y = rows / torch.where(scales > 0, scales, 1.0)[:, None]
    q = y.round_() if dither is None else y.add_(dither).floor_()
    q = q.clamp_(-QMAX, QMAX)
    if dither is not None:
        q = torch.where((q == 0) & (rows > 0), 1.0, q)
    return q.to(torch.int8), scales


def _mul32(h: Tensor, c: int) -> Tensor:
    """``h * c mod 2**32`` for int64 ``h`` in ``[0, 2**32)``, without int64 overflow."""
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _fmix24(h: Tensor) -> Tensor:
    """murmur3's 32-bit finalizer on int64 ``h`` in ``[0, 2**32)``; the top 24 bits."""
    h = h ^ (h >> 16)
    h = _mul32(h, _FMIX1)
    h ^= h >> 13
    h = _mul32(h, _FMIX2)
    h ^= h >> 16
    return h >> 8


def _dither(scales: Tensor, block_size: int, salt: int) -> Tensor:
    """Offsets in ``[0, 1)`` for stochastic rounding, one row per block: a hashed
    per-column offset plus a hashed offset of (block scale bits, step ``salt``), mod 1.
    For a fixed element the offset is uniform and changes every step; hashing only
    columns and blocks keeps the per-element cost at an add."""
    cols = _fmix24(_mul32(torch.arange(block_size, device=scales.device), _COL_MIX))
    rows = _fmix24((scales.view(torch.int32).to(torch.int64) & _MASK32) ^ salt)
    return ((rows[:, None] + cols[None, :]) & 0xFFFFFF).float() * 2.0**-24


def _as_rows(flat: Tensor, block_size: int) -> Tensor:
    """View a flat tensor as ``(blocks, block_size)``, zero-padding a partial last block."""
    pad = -flat.numel() % block_size
    if pad:
        flat = F.pad(flat, (0, pad))
    return flat.view(-1, block_size)


def _unpad(rows: Tensor, n: int) -> Tensor:
    flat = rows.reshape(-1)
    return flat if flat.numel() == n else flat[:n].clone()


def _as_row_blocks(rows: Tensor, block_size: int) -> Tensor:
    """``(rows, numel)`` as ``(rows * blocks, block_size)``, each row's partial last block
    zero-padded."""
    pad = -rows.shape[1] % block_size
    if pad:
        rows = F.pad(rows, (0, pad))
    return rows.reshape(-1, block_size)


def _unpad_rows(blocks: Tensor, rows: int, numel: int) -> Tensor:
    """The ``(rows, numel)`` elements of ``_as_row_blocks``'s blocks."""
    return blocks.view(rows, blocks.numel() // rows)[:, :numel]


def _backend(backend: str, x: Tensor, block_size: int) -> str:
    if backend == "auto" and block_size > MAX_TRITON_BLOCK:
        return "torch"
    chosen = resolve_backend(backend, x)
    if chosen == "triton" and block_size > MAX_TRITON_BLOCK:
        raise ValueError(f"the Triton kernels support block_size <= {MAX_TRITON_BLOCK}")
    return chosen


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")


def _check_flat(name: str, t: Tensor, numel: int, dtype: torch.dtype) -> None:
    if t.dtype != dtype or t.ndim != 1 or t.numel() != numel or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous 1-D {dtype} tensor of {numel} elements, "
            f"got {t.dtype} of shape {tuple(t.shape)}"
        )
