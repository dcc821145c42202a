"""Newton–Schulz orthogonalization, the inner loop of Muon.

``newton_schulz`` runs the quintic iteration of ``torch.optim.Muon`` on a matrix or a
stack of matrices. The torch reference below is that iteration, batched; the Triton
path (``_ns_triton``) computes the same numbers with a symmetric ``X @ X.T`` and a
fused polynomial step.

The coefficients are one ``(a, b, c)`` for every step (torch's), a sequence of triples,
one per step, or a name: ``"polar_express"`` is Polar Express (Amsel, Persson, Musco and
Gower, 2025, arXiv 2505.16932): five steps with the triples its construction gives for
``num_iters=5``, safety factor ``2e-2`` and cushion ``2``, the input scaled by
``1 / max(1.02 ||X||_F, eps)`` so that its top singular value starts below one.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Real

import torch
from torch import Tensor

from ._dispatch import resolve_backend, triton_module

DEFAULT_COEFFICIENTS = (3.4445, -4.775, 2.0315)
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
NAMED_COEFFICIENTS = {"polar_express": (POLAR_EXPRESS, 1.02)}  # name -> (triples, norm scale)

Triple = tuple[float, float, float]

__all__ = ["POLAR_EXPRESS", "newton_schulz", "ns_schedule"]


def _is_triple(c) -> bool:
    return (
        isinstance(c, tuple | list)
        and len(c) == 3
        and all(isinstance(v, Real) and not isinstance(v, bool) for v in c)
    )


def ns_schedule(coefficients, steps: int) -> tuple[tuple[Triple, ...], float]:
    """The per-step triples and the norm scale of ``coefficients``: a triple repeated
    ``steps`` times (scale 1), a sequence of triples (its own length, scale 1) or a name of
    ``NAMED_COEFFICIENTS``. ValueError for anything else."""
    if isinstance(coefficients, str):
        if coefficients not in NAMED_COEFFICIENTS:
            raise ValueError(
                f"unknown ns_coefficients name {coefficients!r}; expected one of {sorted(NAMED_COEFFICIENTS)}"
            )
        return NAMED_COEFFICIENTS[coefficients]
    if _is_triple(coefficients):
        return (tuple(float(c) for c in coefficients),) * steps, 1.0
    if isinstance(coefficients, tuple | list) and coefficients and all(_is_triple(t) for t in coefficients):
        return tuple(tuple(float(c) for c in t) for t in coefficients), 1.0
    raise ValueError(
        "coefficients must be three floats (a, b, c), a sequence of such triples (one per step) or "
        f"one of {sorted(NAMED_COEFFICIENTS)}; got {coefficients!r}"
    )


def newton_schulz(
    x: Tensor,
    steps: int = 5,
    coefficients: Triple | Sequence[Triple] | str = DEFAULT_COEFFICIENTS,
    eps: float = 1e-7,
    backend: str = "auto",
) -> Tensor:
    """Approximately orthogonalize ``x`` (``U S Vᵀ -> U S' Vᵀ``, ``S'`` near 1), in bf16.

    ``x`` has shape ``(..., m, n)``; leading dimensions are a batch and every matrix is
    normalized by its own Frobenius norm. Per matrix this is exactly the iteration in
    ``torch.optim.Muon``: cast to bf16, transpose if tall, divide by
    ``max(‖X‖_F, eps)``, then ``steps`` times ``X <- a X + (b A + c A²) X`` with
    ``A = X Xᵀ``, and transpose back. With a sequence of triples (or a name, see
    ``ns_schedule``) step ``k`` takes the ``k``-th triple and ``steps`` is ignored.
    ``backend`` is ``"auto"`` (Triton for CUDA tensors, torch otherwise), ``"torch"`` or
    ``"triton"``.
    """
    if x.ndim < 2:
        raise ValueError(f"newton_schulz expects a (..., m, n) tensor, got shape {tuple(x.shape)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    schedule, scale = ns_schedule(coefficients, steps)
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")
    if x.is_complex() or not x.is_floating_point():
        raise ValueError(f"newton_schulz expects a real floating-point tensor, got {x.dtype}")
    use_triton = resolve_backend(backend, x) == "triton"
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    if use_triton:
        return triton_module("_ns_triton", x).newton_schulz_triton(
            x, len(schedule), schedule, eps, scale=scale
        )
    return _newton_schulz_torch(x, schedule, scale, eps)


def as_stack(x: Tensor, eps: float, scale: float = 1.0) -> tuple[Tensor, bool]:
    """Shared prologue: the normalized bf16 matrix ``(p, q)`` or stack ``(B, p, q)`` with
    ``p <= q`` (divided by ``max(scale * ‖X‖_F, eps)``), and whether the matrices were
    transposed to get there."""
    m, n = x.shape[-2:]
    X = x.bfloat16() if x.ndim <= 3 else x.reshape(-1, m, n).bfloat16()
    tall = m > n
    if tall:
        X = X.mT
    # one matrix: a 0-dim norm, which torch divides by on its fast scalar path (a (1, 1) tensor
    # broadcasts, ~4x slower on CPU); the quotient is the same
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=X.ndim > 2)
    if scale != 1.0:  # torch's own path multiplies by nothing
        norm = norm * scale
    return X / norm.clamp(min=eps), tall


def _newton_schulz_torch(x: Tensor, schedule: Sequence[Triple], scale: float, eps: float) -> Tensor:
    """The iteration one matrix at a time: a batched matmul rounds differently from a
    single one on CPU, and a matrix's result must not depend on which others share its
    batch (that changes with the world size in Muon)."""
    if x.ndim > 2:
        flat = x.reshape(-1, *x.shape[-2:])
        return torch.stack([_newton_schulz_torch(m, schedule, scale, eps) for m in flat]).reshape(x.shape)
    X, tall = as_stack(x, eps, scale)
    for a, b, c in schedule:
        A = X @ X.mT
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.addmm(X, B, X, beta=a)
    if tall:
        X = X.mT
    return X
