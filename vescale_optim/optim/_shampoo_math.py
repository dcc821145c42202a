"""Shampoo's functional core: the global tiling and the math on flat tensors and on stacks
of equal-shaped tiles. No processes, no optimizer state objects; who owns which tile is the
owner layer's (`owners.plan`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..shard.comm import host_to_device
from ._checks import check_at_least, check_betas, check_lr

GRAFTINGS = ("adam", "adagrad", "sgd", None)


@dataclass(frozen=True)
class Tile:
    """Rows `[r0, r1)` and columns `[c0, c1)` of parameter `param` seen as `[shape[0], rest]`."""

    param: int
    bi: int
    bj: int
    r0: int
    r1: int
    c0: int
    c1: int

    @property
    def h(self) -> int:
        return self.r1 - self.r0

    @property
    def w(self) -> int:
        return self.c1 - self.c0

    @property
    def cost(self) -> int:
        """Root work: one eigendecomposition per factor, ~ side^3."""
        return self.h**3 + self.w**3

    @property
    def key(self) -> str:
        return f"{self.bi}_{self.bj}"


def matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
    """`(shape[0], prod(shape[1:]))` for a tensor Shampoo preconditions, else None."""
    if len(shape) < 2 or math.prod(shape) == 0:
        return None
    return shape[0], math.prod(shape[1:])


def tiles_of(
    shape: Sequence[int], max_dim: int, param: int = 0, first: tuple[int, int] = (0, 0)
) -> list[Tile]:
    """Row-major tiles of at most `max_dim` per side: blocks of `max_dim`, the last shorter;
    their indices start at `first` (a TP shard's tiles keep the full tensor's indices)."""
    ms = matrix_shape(shape)
    if ms is None:
        return []
    m, n = ms
    return [
        Tile(param, first[0] + bi, first[1] + bj, r0, min(r0 + max_dim, m), c0, min(c0 + max_dim, n))
        for bi, r0 in enumerate(range(0, m, max_dim))
        for bj, c0 in enumerate(range(0, n, max_dim))
    ]


def stripe_granule(shape: Sequence[int], max_dim: int) -> int:
    """Layout granule of a parameter: a stripe of `max_dim` rows when stripes divide the rows
    (the whole matrix when it has at most `max_dim` rows), else `gcd(rows, max_dim)` rows,
    so rank boundaries still fall on stripe boundaries when they can."""
    ms = matrix_shape(shape)
    if ms is None:
        return 1
    m, n = ms
    return m * n if m <= max_dim else math.gcd(m, max_dim) * n


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_hyperparameters(group: dict) -> None:
    """Raise ValueError for a hyperparameter out of range (in the defaults, where
    `start_preconditioning_step` may still be None, or in a param group)."""
    d = group["max_preconditioner_dim"]
    if not _is_int(d) or d < 1:
        raise ValueError(f"Invalid max_preconditioner_dim: {d!r} (need an integer >= 1)")
    if group["grafting"] not in GRAFTINGS:
        raise ValueError(f"Invalid grafting: {group['grafting']!r} (expected one of {GRAFTINGS})")
    check_lr(group["lr"])
    check_betas(group["betas"], last_may_be_one=True)
    for name in ("epsilon", "grafting_epsilon", "weight_decay"):
        check_at_least(group[name], 0.0, f"Invalid {name}: {{!r}}")
    freq, start = group["precondition_frequency"], group["start_preconditioning_step"]
    if not _is_int(freq) or freq < 1:
        raise ValueError(f"Invalid precondition_frequency: {freq!r} (need an integer >= 1)")
    if start is not None and (not _is_int(start) or start < freq):
        raise ValueError(
            f"Invalid start_preconditioning_step: {start!r} (need an integer >= precondition_frequency "
            f"= {freq}: the first roots, built from `start` steps of gradients, are applied for "
            "`precondition_frequency` steps)"
        )
    if group["root_dtype"] not in (torch.float32, torch.float64):
        raise ValueError(f"Invalid root_dtype: {group['root_dtype']!r} (torch.float32 or torch.float64)")


def bias_correction(beta: float, step: int) -> float:
    return 1.0 if beta == 1 else 1.0 - beta**step


def schedule(group: dict, step: int) -> tuple[bool, bool]:
    """(apply, refresh) at `step`: preconditioned updates from `start_preconditioning_step`
    on, roots recomputed there and every `precondition_frequency` steps after."""
    start, freq = group["start_preconditioning_step"], group["precondition_frequency"]
    apply = step >= start
    return apply, apply and (step - start) % freq == 0


def grafting_step_(
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    second: torch.Tensor | None,
    out: torch.Tensor,
    *,
    step: int,
    beta1: float,
    beta2: float,
    eps: float,
    grafting: str | None,
) -> None:
    """Element-wise part of a step on flat tensors, in place; the grafting update goes to `out`.

    m <- b1*m + (1-b1)*g;  mhat = m / (1 - b1^t)
    adam:    v <- b2*v + (1-b2)*g^2 (v + g^2 if b2 == 1);  out = mhat / (sqrt(v)/sqrt(1-b2^t) + eps)
    adagrad: v <- v + g^2;  out = mhat / (sqrt(v) + eps)
    sgd / None: out = mhat
    """
    exp_avg.lerp_(grad, 1 - beta1)
    torch.div(exp_avg, bias_correction(beta1, step), out=out)
    if grafting in ("adam", "adagrad"):
        if grafting == "adam" and beta2 != 1:
            second.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        else:
            second.addcmul_(grad, grad)
        bc = bias_correction(beta2, step) if grafting == "adam" else 1.0
        out.div_((second.sqrt() / math.sqrt(bc)).add_(eps))


def update_factors_(left: torch.Tensor, right: torch.Tensor, grad: torch.Tensor, beta2: float) -> None:
    """L <- b2*L + (1-b2)*G@G.T and R <- b2*R + (1-b2)*G.T@G on stacks `[K, h, w]`
    (plain sums when b2 == 1)."""
    beta, alpha = (1.0, 1.0) if beta2 == 1 else (beta2, 1.0 - beta2)
    left.baddbmm_(grad, grad.mT, beta=beta, alpha=alpha)
    right.baddbmm_(grad.mT, grad, beta=beta, alpha=alpha)


def _inverse_fourth_root(factor: torch.Tensor, epsilon: float, dtype: torch.dtype) -> torch.Tensor:
    eye = torch.eye(factor.shape[-1], dtype=dtype, device=factor.device)
    lam, q = torch.linalg.eigh(factor.to(dtype) + epsilon * eye)
    lam = lam.clamp_min(epsilon).sqrt_().rsqrt_()
    return ((q * lam.unsqueeze(-2)) @ q.mT).to(factor.dtype)


def _try_root(factor: torch.Tensor, epsilon: float, dtype: torch.dtype) -> torch.Tensor | None:
    """The root in `dtype`, else in float64 (eigh can fail to converge in fp32 on factors
    with many equal eigenvalues, e.g. embedding tiles with unused rows), else None. Whether
    eigh converged is known on the host without a read of ours (eigh raises)."""
    for dt in dict.fromkeys((dtype, torch.float64)):
        try:
            return _inverse_fourth_root(factor, epsilon, dt)
        except torch.linalg.LinAlgError:
            continue
    return None


def inverse_roots_(
    roots: torch.Tensor, factors: torch.Tensor, *, step: int, beta2: float, epsilon: float, dtype: torch.dtype
) -> torch.Tensor:
    """roots <- (F/(1-b2^t))^(-1/4) for a stack `[K, d, d]`, by `torch.linalg.eigh` in `dtype`:
    F = Q diag(lam) Q.T,  root = Q diag((max(lam, 0) + epsilon)^(-1/4)) Q.T
    (computed as the eigendecomposition of F + epsilon*I).

    A tile whose factor is not finite (it is replaced by the identity before eigh, so that
    one tile cannot fail the stack), whose root is not finite, or whose eigendecomposition
    fails in `dtype` and in float64, keeps its root. Returns how many did, as a 0-dim tensor
    on the factors' device: nothing is read back here (the caller reads one count per
    refresh); only eigh's own error check synchronises on CUDA, and the fallback tile by tile
    runs only after the stack failed to converge in both dtypes."""
    scaled = factors / bias_correction(beta2, step)
    finite = torch.isfinite(scaled).flatten(1).all(1)
    eye = torch.eye(scaled.shape[-1], dtype=scaled.dtype, device=scaled.device)
    safe = torch.where(finite[:, None, None], scaled, eye)
    root = _try_root(safe, epsilon, dtype)
    if root is None:  # rare: the stack did not converge in either dtype; tile by tile
        tiles = [_try_root(safe[k], epsilon, dtype) for k in range(len(safe))]
        finite = finite & host_to_device([t is not None for t in tiles], torch.bool, finite.device)
        root = torch.stack([roots[k] if t is None else t for k, t in enumerate(tiles)])
    ok = finite & torch.isfinite(root).flatten(1).all(1)
    roots.copy_(torch.where(ok[:, None, None], root.to(roots.dtype), roots))
    return (~ok).sum()


def precondition(
    left_root: torch.Tensor, mhat: torch.Tensor, right_root: torch.Tensor, graft: torch.Tensor | None
) -> torch.Tensor:
    """D = L^(-1/4) @ mhat @ R^(-1/4) per tile; with a grafting update A, D * |A|_F / |D|_F
    (zero where D is zero)."""
    d = left_root @ mhat @ right_root
    if graft is None:
        return d
    dn = torch.linalg.vector_norm(d.flatten(1), dim=1)
    an = torch.linalg.vector_norm(graft.flatten(1), dim=1)
    scale = torch.where(dn > 0, an / dn.clamp_min(torch.finfo(d.dtype).tiny), torch.zeros_like(dn))
    return d * scale[:, None, None]
