"""Triton kernels for Newton–Schulz: symmetric ``X Xᵀ`` and the fused polynomial step.

One iteration ``X <- a X + (b A + c A²) X`` with ``A = X Xᵀ`` is three launches over
a stack of equal-shape matrices, each on a 1-D grid of ``matrices * tiles`` programs
(program ``pid`` computes tile ``pid % tiles`` of matrix ``pid // tiles``): grid axis 0
takes up to 2**31 - 1 programs where axes 1 and 2 stop at 65535, which a stack of small
matrices (or a 32768-square one in 128-wide tiles) would pass:

1. ``A = X Xᵀ`` — symmetric, so only tiles ``i <= j`` are computed and each off-diagonal
   tile is also stored transposed (about half the FLOPs of a plain matmul);
2. ``B = b A + c A Aᵀ`` — the same symmetric kernel (``A`` is symmetric, so
   ``A² = A Aᵀ``) with the ``b A`` term fused into its epilogue;
3. ``X' = a X + B X`` — a tiled matmul with the ``a X`` term fused into its epilogue;
   the last step writes straight into the output, transposed back if the input was tall.

Inputs are bf16 and accumulation is fp32, like cuBLAS, so each launch rounds to bf16
exactly where the torch reference does. The Triton interpreter mis-computes bf16
arithmetic and truncates fp32 -> bf16 casts, so under ``TRITON_INTERPRET=1`` operands
are upcast to fp32 right after loading (exact: bf16 values are fp32 values and
products of two bf16 are exact in fp32) and results are rounded to nearest-even by
hand before the cast; compiled kernels feed bf16 to the tensor cores and round in
hardware.

Element offsets are int64 (indices widened before they meet a stride): one matrix may
hold more than 2**31 elements, and a stack certainly may. Masks compare the int32
indices, so only the address arithmetic is wider.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._triton_common import INTERPRET, Launch, cast_rne, device_of
from .newton_schulz import Triple, as_stack, ns_schedule

__all__ = [
    "INTERPRET",
    "newton_schulz_launches",
    "newton_schulz_triton",
    "poly",
    "poly_config",
    "poly_launch",
    "syrk",
    "syrk_config",
    "syrk_launch",
]


@triton.jit
def _syrk_kernel(
    l_ptr,
    c_ptr,
    out_ptr,
    tiles_ptr,
    P,
    K,
    num_tiles,
    stride_lb,
    stride_lr,
    stride_lk,
    stride_cb,
    stride_cr,
    stride_cc,
    stride_ob,
    stride_or,
    stride_oc,
    alpha,
    beta,
    HAS_C: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """OUT = alpha * L Lᵀ (+ beta * C) for a symmetric C; tiles (i <= j) from ``tiles_ptr``,
    ``num_tiles`` of them per matrix."""
    pid = tl.program_id(0)
    bid = (pid // num_tiles).to(tl.int64)
    pid = pid % num_tiles
    ti, tj = tl.load(tiles_ptr + 2 * pid), tl.load(tiles_ptr + 2 * pid + 1)  # the tile's block row, column
    ri = ti * BLOCK + tl.arange(0, BLOCK)
    rj = tj * BLOCK + tl.arange(0, BLOCK)
    rk = tl.arange(0, BLOCK_K)
    ri64, rj64, rk64 = ri.to(tl.int64), rj.to(tl.int64), rk.to(tl.int64)
    l_ptr += bid * stride_lb
    a_ptrs = l_ptr + ri64[:, None] * stride_lr + rk64[None, :] * stride_lk
    b_ptrs = l_ptr + rj64[None, :] * stride_lr + rk64[:, None] * stride_lk
    k_step = tl.cast(BLOCK_K, tl.int64) * stride_lk
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(ri[:, None] < P) & (rk[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(rj[None, :] < P) & (rk[:, None] < k_left), other=0.0)
        if INTERPRETED:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += k_step
        b_ptrs += k_step
    mask = (ri[:, None] < P) & (rj[None, :] < P)
    out = alpha * acc
    if HAS_C:
        c_ptr += bid * stride_cb
        c = tl.load(c_ptr + ri64[:, None] * stride_cr + rj64[None, :] * stride_cc, mask=mask)
        out += beta * c.to(tl.float32)
    out = cast_rne(out, tl.bfloat16, INTERPRETED)
    out_ptr += bid * stride_ob
    tl.store(out_ptr + ri64[:, None] * stride_or + rj64[None, :] * stride_oc, out, mask=mask)
    mirror = out_ptr + ri64[:, None] * stride_oc + rj64[None, :] * stride_or
    tl.store(mirror, out, mask=mask & (ti != tj))


@triton.jit
def _poly_kernel(
    b_ptr,
    x_ptr,
    out_ptr,
    P,
    Q,
    stride_bb,
    stride_br,
    stride_bc,
    stride_xb,
    stride_xr,
    stride_xc,
    stride_ob,
    stride_or,
    stride_oc,
    a_coef,
    INTERPRETED: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """OUT = a * X + B X for B of shape (P, P) and X of shape (P, Q)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(P, BLOCK_M)
    num_n = tl.cdiv(Q, BLOCK_N)
    bid = (pid // (num_m * num_n)).to(tl.int64)
    pid = pid % (num_m * num_n)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_size = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % group_size
    pid_n = (pid % (GROUP_M * num_n)) // group_size
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rm64, rn64, rk64 = rm.to(tl.int64), rn.to(tl.int64), rk.to(tl.int64)
    b_ptr += bid * stride_bb
    x_ptr += bid * stride_xb
    b_ptrs = b_ptr + rm64[:, None] * stride_br + rk64[None, :] * stride_bc
    x_ptrs = x_ptr + rk64[:, None] * stride_xr + rn64[None, :] * stride_xc
    b_step = tl.cast(BLOCK_K, tl.int64) * stride_bc
    x_step = tl.cast(BLOCK_K, tl.int64) * stride_xr
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(P, BLOCK_K)):
        k_left = P - k * BLOCK_K
        b = tl.load(b_ptrs, mask=(rm[:, None] < P) & (rk[None, :] < k_left), other=0.0)
        x = tl.load(x_ptrs, mask=(rk[:, None] < k_left) & (rn[None, :] < Q), other=0.0)
        if INTERPRETED:
            b = b.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(b, x, acc)
        b_ptrs += b_step
        x_ptrs += x_step
    mask = (rm[:, None] < P) & (rn[None, :] < Q)
    x = tl.load(x_ptr + rm64[:, None] * stride_xr + rn64[None, :] * stride_xc, mask=mask)
    out = a_coef * x.to(tl.float32) + acc
    out_ptr += bid * stride_ob
    out_ptrs = out_ptr + rm64[:, None] * stride_or + rn64[None, :] * stride_oc
    tl.store(out_ptrs, cast_rne(out, tl.bfloat16, INTERPRETED), mask=mask)


_ALIGN = 16


@functools.lru_cache(maxsize=64)
def _upper_tiles(num_tiles: int, device: torch.device) -> Tensor:
    """Interleaved (i, j) pairs of the tiles with i <= j, row by row."""
    return torch.triu_indices(num_tiles, num_tiles, device=device).T.contiguous().int()


def _pow2_clamp(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(n)))


def syrk_config(P: int, K: int, block: int | None = None, block_k: int | None = None) -> dict:
    """Tiles, warps and stages of ``syrk`` on ``(P, K)`` matrices (the one place they are chosen)."""
    block = block or _pow2_clamp(P, 16, 128)
    block_k = block_k or _pow2_clamp(K, 16, 64)
    return dict(BLOCK=block, BLOCK_K=block_k, num_warps=8 if block >= 128 else 4, num_stages=3)


def poly_config(
    P: int, Q: int, block_m: int | None = None, block_n: int | None = None, block_k: int | None = None
) -> dict:
    """Tiles, warps and stages of ``poly`` for ``B (P, P)`` times ``X (P, Q)``."""
    block_m = block_m or _pow2_clamp(P, 16, 128)
    block_n = block_n or _pow2_clamp(Q, 16, 128)
    block_k = block_k or _pow2_clamp(P, 16, 64)
    return dict(
        GROUP_M=8,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=8 if block_m * block_n >= 128 * 128 else 4,
        num_stages=3,
    )


def syrk_launch(
    L: Tensor,
    out: Tensor,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    C: Tensor | None = None,
    block: int | None = None,
    block_k: int | None = None,
) -> Launch:
    """The launch of ``syrk`` (see there), planned but not run."""
    nb, P, K = L.shape
    config = syrk_config(P, K, block, block_k)
    tiles = _upper_tiles(triton.cdiv(P, config["BLOCK"]), L.device)
    c = out if C is None else C
    num_tiles = tiles.shape[0]
    args = (L, c, out, tiles, P, K, num_tiles, *L.stride(), *c.stride(), *out.stride(), alpha, beta)
    return Launch(
        _syrk_kernel, (num_tiles * nb,), args, dict(HAS_C=C is not None, INTERPRETED=INTERPRET, **config)
    )


def syrk(
    L: Tensor,
    out: Tensor,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    C: Tensor | None = None,
    block: int | None = None,
    block_k: int | None = None,
) -> Tensor:
    """``out = alpha * L Lᵀ (+ beta * C)`` for stacks ``L (B, P, K)``, symmetric ``C (B, P, P)``."""
    syrk_launch(L, out, alpha=alpha, beta=beta, C=C, block=block, block_k=block_k)()
    return out


def poly_launch(
    B: Tensor,
    X: Tensor,
    out: Tensor,
    *,
    a: float,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> Launch:
    """The launch of ``poly`` (see there), planned but not run."""
    nb, P, Q = X.shape
    config = poly_config(P, Q, block_m, block_n, block_k)
    grid = (triton.cdiv(P, config["BLOCK_M"]) * triton.cdiv(Q, config["BLOCK_N"]) * nb,)
    args = (B, X, out, P, Q, *B.stride(), *X.stride(), *out.stride(), a)
    return Launch(_poly_kernel, grid, args, dict(INTERPRETED=INTERPRET, **config))


def poly(
    B: Tensor,
    X: Tensor,
    out: Tensor,
    *,
    a: float,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> Tensor:
    """``out = a * X + B X`` for stacks ``B (B, P, P)`` and ``X (B, P, Q)``; ``out`` may be
    any strided view of shape ``(B, P, Q)`` that does not overlap ``X``."""
    poly_launch(B, X, out, a=a, block_m=block_m, block_n=block_n, block_k=block_k)()
    return out


def newton_schulz_launches(
    x: Tensor,
    steps: int,
    coefficients: Triple | Sequence[Triple] | str,
    eps: float,
    *,
    scale: float | None = None,
    block: int | None = None,
    block_k: int | None = None,
) -> tuple[Tensor, list[Callable[[], object]]]:
    """Normalize ``x`` and plan ``newton_schulz_triton``: the (not yet written) bf16 output
    and what fills it, in order — the kernel launches, then a copy out of the padding.

    Sides that are not multiples of 16 are zero-padded up to one: zero rows and columns
    stay zero through the iteration and add exact zeros to every sum, so the result is
    unchanged, while every size and stride the kernels see is divisible by 16 (vector
    loads; without it the 128-wide tiles spill registers).

    ``coefficients`` are ``newton_schulz``'s (one triple, one per step, or a name): step
    ``k`` launches with its own ``(a, b, c)``; ``scale`` overrides the schedule's norm scale.
    """
    schedule, own_scale = ns_schedule(coefficients, steps)
    steps = len(schedule)
    X, tall = as_stack(x, eps, own_scale if scale is None else scale)
    X = X.reshape(-1, *X.shape[-2:])
    nb, p, q = X.shape
    P, Q = -(-p // _ALIGN) * _ALIGN, -(-q // _ALIGN) * _ALIGN
    padded = (p, q) != (P, Q)
    out = torch.empty((nb, *x.shape[-2:]), dtype=torch.bfloat16, device=x.device)
    final = out.mT if tall else out
    if padded:
        X = torch.nn.functional.pad(X, (0, Q - q, 0, P - p))
    else:
        X = X.contiguous()
    A = torch.empty((nb, P, P), dtype=torch.bfloat16, device=x.device)
    Bm = torch.empty_like(A)
    spare = torch.empty_like(X) if steps > 1 or padded else None
    tiles = dict(block_m=block, block_n=block, block_k=block_k)
    plan: list[Callable[[], object]] = []
    for step, (a, b, c) in enumerate(schedule):
        dest = final if step == steps - 1 and not padded else spare
        plan += [
            syrk_launch(X, A, block=block, block_k=block_k),
            syrk_launch(A, Bm, alpha=c, beta=b, C=A, block=block, block_k=block_k),
            poly_launch(Bm, X, dest, a=a, **tiles),
        ]
        X, spare = dest, X
    if padded:
        plan.append(functools.partial(final.copy_, X[:, :p, :q]))
    return out.reshape(x.shape), plan


def newton_schulz_triton(
    x: Tensor,
    steps: int,
    coefficients: Triple | Sequence[Triple] | str,
    eps: float,
    *,
    scale: float | None = None,
    block: int | None = None,
    block_k: int | None = None,
) -> Tensor:
    """Newton–Schulz on a ``(..., m, n)`` tensor with the Triton kernels; returns bf16.

    ``block`` and ``block_k`` override the tile sizes (tests use small tiles to exercise
    masks and the mirrored stores on small matrices).
    """
    out, plan = newton_schulz_launches(x, steps, coefficients, eps, scale=scale, block=block, block_k=block_k)
    with device_of(x):
        for launch in plan:
            launch()
    return out
