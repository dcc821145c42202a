"""Newton–Schulz orthogonalization, the inner loop of Muon.

``newton_schulz`` runs the quintic iteration of ``torch.optim.Muon`` on a matrix or a
stack of matrices. The torch reference below is that iteration, batched; the Triton
path (``_ns_triton``) computes the same numbers with a symmetric ``X @ X.T`` and a
fused polynomial step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._dispatch import resolve_backend, triton_module

DEFAULT_COEFFICIENTS = (3.4445, -4.775, 2.0315)

__all__ = ["newton_schulz"]


def newton_schulz(
    x: Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = DEFAULT_COEFFICIENTS,
    eps: float = 1e-7,
    backend: str = "auto",
) -> Tensor:
    """Approximately orthogonalize ``x`` (``U S Vᵀ -> U S' Vᵀ``, ``S'`` near 1), in bf16.

    ``x`` has shape ``(..., m, n)``; leading dimensions are a batch and every matrix is
    normalized by its own Frobenius norm. Per matrix this is exactly the iteration in
    ``torch.optim.Muon``: cast to bf16, transpose if tall, divide by
    ``max(‖X‖_F, eps)``, then ``steps`` times ``X <- a X + (b A + c A²) X`` with
    ``A = X Xᵀ``, and transpose back. ``backend`` is ``"auto"`` (Triton for CUDA
    tensors, torch otherwise), ``"torch"`` or ``"triton"``.
    """
    if x.ndim < 2:
        raise ValueError(f"newton_schulz expects a (..., m, n) tensor, got shape {tuple(x.shape)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if len(coefficients) != 3:
        raise ValueError(f"coefficients must be three floats (a, b, c), got {coefficients!r}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")
    if x.is_complex() or not x.is_floating_point():
        raise ValueError(f"newton_schulz expects a real floating-point tensor, got {x.dtype}")
    coefficients = tuple(float(c) for c in coefficients)
    use_triton = resolve_backend(backend, x) == "triton"
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    if use_triton:
        return triton_module("_ns_triton", x).newton_schulz_triton(x, steps, coefficients, eps)
    return _newton_schulz_torch(x, steps, coefficients, eps)


def as_stack(x: Tensor, eps: float) -> tuple[Tensor, bool]:
    """Shared prologue: the normalized bf16 matrix ``(p, q)`` or stack ``(B, p, q)`` with
    ``p <= q``, and whether the matrices were transposed to get there."""
    m, n = x.shape[-2:]
    X = x.bfloat16() if x.ndim <= 3 else x.reshape(-1, m, n).bfloat16()
    tall = m > n
    if tall:
        X = X.mT
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
    return X / norm.clamp(min=eps), tall


def _newton_schulz_torch(
    x: Tensor, steps: int, coefficients: tuple[float, float, float], eps: float
) -> Tensor:
    """The iteration one matrix at a time: a batched matmul rounds differently from a
    single one on CPU, and a matrix's result must not depend on which others share its
    batch (that changes with the world size in Muon)."""
    if x.ndim > 2:
        flat = x.reshape(-1, *x.shape[-2:])
        return torch.stack([_newton_schulz_torch(m, steps, coefficients, eps) for m in flat]).reshape(x.shape)
    a, b, c = coefficients
    X, tall = as_stack(x, eps)
    for _ in range(steps):
        A = X @ X.mT
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.addmm(X, B, X, beta=a)
    if tall:
        X = X.mT
    return X
