"""SOAP's functional core: Adam in the eigenbasis of Shampoo's factors, on one whole parameter.

No processes and no optimizer objects: a parameter's shape plan (`Plan`: which dimensions are
merged and which are rotated), the rotations, the factor update, the bases (by `eigh` at the start,
by one power iteration and a QR at each refresh), the Adam moments in the rotated space and the
update direction. Who computes which parameter is the owner layer's (`owners.plan`); the optimizer
is `soap.SOAP`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ._checks import check_at_least, check_betas, check_lr

DATA_FORMATS = ("channels_first", "channels_last")
FACTOR_DTYPES = (torch.float32, torch.bfloat16)
_TINY = 1e-30  # added to a factor's diagonal before eigh, and to the RMS of a normalized update


def merged_shape(shape: Sequence[int], max_dim: int) -> tuple[int, ...]:
    """`shape` with neighbouring dimensions multiplied together while their product stays at most
    `max_dim`, left to right; a dimension that would take a run above `max_dim` starts the next run
    (one above `max_dim` alone stays a dimension of its own)."""
    out: list[int] = []
    run = 1
    for n in shape:
        if run * n <= max_dim:
            run *= n
        elif run > 1:
            out.append(run)
            run = n
        else:
            out.append(n)
    if run > 1 or not out:
        out.append(run)
    return tuple(out)


@dataclass(frozen=True)
class Plan:
    """How SOAP sees one parameter of `shape`: as `view` (the merged dimensions, taken from the
    channels-first order of a 4-D `channels_last` tensor when merging), with a factor of side
    `sides[k]` for dimension k of `view`, or None where that dimension is not rotated (longer than
    `max_precond_dim`, or a 1-D parameter without `precondition_1d`)."""

    shape: tuple[int, ...]
    view: tuple[int, ...]
    sides: tuple[int | None, ...]
    channels_last: bool = False

    @staticmethod
    def of(shape: Sequence[int], group: dict) -> Plan:
        shape, max_dim = tuple(shape), group["max_precond_dim"]
        if len(shape) == 1:
            rotated = group["precondition_1d"] and 0 < shape[0] <= max_dim
            return Plan(shape, shape, (shape[0] if rotated else None,))
        last = group["merge_dims"] and group["data_format"] == "channels_last" and len(shape) == 4
        view = shape
        if group["merge_dims"]:
            view = merged_shape((shape[0], shape[3], shape[1], shape[2]) if last else shape, max_dim)
        empty = math.prod(shape) == 0  # nothing to rotate
        return Plan(shape, view, tuple(None if empty or n > max_dim else n for n in view), last)

    @property
    def rotated(self) -> bool:
        return any(s is not None for s in self.sides)

    @property
    def cost(self) -> float:
        """A refresh's work in multiply-adds: per factor of side d, `Qᵀ·GG·Q` and `GG·Q` (3 d^3) and
        a QR (about 4/3 d^3), and the first moment carried into the new basis (there and back: two
        products of the parameter with each basis); 1-D and unrotated parameters count their size."""
        n = math.prod(self.shape)
        sides = [d for d in self.sides if d is not None]
        return sum(13 * d**3 / 3 + 2 * n * d for d in sides) or float(n)

    def to_view(self, x: torch.Tensor) -> torch.Tensor:
        """A tensor of the parameter's shape (or flat) seen in `view`."""
        x = x.view(self.shape)
        return (x.permute(0, 3, 1, 2) if self.channels_last else x).reshape(self.view)

    def from_view(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse of `to_view`: a tensor of `view` in the parameter's shape."""
        if not self.channels_last:
            return y.reshape(self.shape)
        n, h, w, c = self.shape
        return y.reshape(n, c, h, w).permute(0, 2, 3, 1)


def rotate(x: torch.Tensor, bases: Sequence[torch.Tensor | None], back: bool = False) -> torch.Tensor:
    """`x` (of a plan's `view`) with every rotated dimension k taken into its basis `Q_k` (`x ×_k
    Q_kᵀ`), or with `back`, out of it (`x ×_k Q_k`). Each step contracts the leading dimension and
    appends the result last; after every dimension the order is the original one."""
    for q in bases:
        if q is None:
            x = x.movedim(0, -1)
        else:
            x = torch.tensordot(x, q, dims=([0], [1 if back else 0]))
    return x


def accumulate_(factors: Sequence[torch.Tensor | None], grad: torch.Tensor, beta: float) -> None:
    """`GG_k <- lerp(GG_k, G_(k) G_(k)ᵀ, 1 - beta)` for every factor, `G_(k)` being `grad` (of the
    plan's `view`) with dimension k as rows and every other one as columns. Factors stored in bf16
    are updated in fp32 and rounded back."""
    for k, factor in enumerate(factors):
        if factor is None:
            continue
        others = [j for j in range(grad.dim()) if j != k]
        outer = torch.tensordot(grad, grad, dims=(others, others))
        work = factor if factor.dtype == outer.dtype else factor.to(outer.dtype)
        work.lerp_(outer, 1 - beta)
        if work is not factor:
            factor.copy_(work)


def _finite_or_eye(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(m, True)` for a finite `m`, else `(I, False)`, on the device (no read of the answer)."""
    ok = torch.isfinite(m).all()
    return torch.where(ok, m, torch.eye(m.shape[0], dtype=m.dtype, device=m.device)), ok


def _device(factors: Sequence[torch.Tensor | None]) -> torch.device | None:
    return next((f.device for f in factors if f is not None), None)


def _eigenvectors(m: torch.Tensor) -> torch.Tensor | None:
    """Eigenvectors of `m + 1e-30 I` by descending eigenvalue, in fp32, else float64 (eigh may fail
    to converge in fp32), else None."""
    eye = torch.eye(m.shape[0], device=m.device)
    for dtype in (torch.float32, torch.float64):
        try:
            return torch.linalg.eigh(m.to(dtype) + _TINY * eye)[1].to(torch.float32).flip(1)
        except torch.linalg.LinAlgError:
            continue
    return None


def initial_bases_(
    bases: Sequence[torch.Tensor | None], factors: Sequence[torch.Tensor | None]
) -> torch.Tensor:
    """Every basis from its factor's eigenvectors (by descending eigenvalue), in place. A factor that
    is not finite, or whose eigenvectors are not (or whose eigh fails in fp32 and float64), keeps
    its basis. Returns how many were kept, as a 0-dim tensor on the factors' device (eigh's own
    error check is the one synchronisation)."""
    kept = None
    for q, factor in zip(bases, factors):
        if factor is None:
            continue
        m, ok = _finite_or_eye(factor.float())
        found = _eigenvectors(m)
        if found is None:
            found, ok = q.float(), torch.zeros_like(ok)
        ok = ok & torch.isfinite(found).all()
        q.copy_(torch.where(ok, found, q.float()))
        kept = (~ok).long() if kept is None else kept + (~ok).long()
    return kept if kept is not None else torch.zeros((), dtype=torch.long, device=_device(factors))


def refresh_bases_(
    bases: Sequence[torch.Tensor | None], factors: Sequence[torch.Tensor | None], exp_avg_sq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One power iteration per basis, in place: with `O = Q_k`, the estimated eigenvalues
    `diag(Oᵀ GG_k O)` sort O's columns (descending), `exp_avg_sq` (of the plan's `view`) is permuted
    the same way along dimension k, and `Q_k` becomes the Q of the QR of `GG_k O`. A factor or a
    result that is not finite keeps its basis, and `exp_avg_sq` its order. Returns the permuted
    `exp_avg_sq` and how many bases were kept, as a 0-dim tensor (nothing read back)."""
    kept = None
    for k, (q, factor) in enumerate(zip(bases, factors)):
        if factor is None:
            continue
        m, ok = _finite_or_eye(factor.float())
        o = q.float()
        order = torch.argsort(torch.diag(o.T @ m @ o), descending=True)
        found = torch.linalg.qr(m @ o[:, order]).Q
        ok = ok & torch.isfinite(found).all()
        order = torch.where(ok, order, torch.arange(len(order), device=order.device))
        q.copy_(torch.where(ok, found, o))
        exp_avg_sq = exp_avg_sq.index_select(k, order)
        kept = (~ok).long() if kept is None else kept + (~ok).long()
    return exp_avg_sq, kept if kept is not None else torch.zeros(
        (), dtype=torch.long, device=exp_avg_sq.device
    )


def adam_direction_(
    rotated_grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, group: dict
) -> torch.Tensor:
    """Adam's moments updated in the rotated space, in place, and `m / (sqrt(v) + eps)`:
    `m <- b1 m + (1 - b1) g`, `v <- b2 v + (1 - b2) g^2` (eps outside the root)."""
    beta1, beta2 = group["betas"]
    exp_avg.mul_(beta1).add_(rotated_grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).add_(rotated_grad.square(), alpha=1 - beta2)
    return exp_avg / exp_avg_sq.sqrt().add_(group["eps"])


def normalized(update: torch.Tensor) -> torch.Tensor:
    """`update / (1e-30 + RMS(update))` (`normalize_grads`)."""
    return update / (_TINY + update.square().mean().sqrt())


def step_size(group: dict, step: int) -> float:
    """`lr * sqrt(1 - b2^t) / (1 - b1^t)` at Adam step `t` (from 1), or `lr` without `correct_bias`."""
    lr = float(group["lr"])
    if not group["correct_bias"]:
        return lr
    beta1, beta2 = group["betas"]
    return lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)


def refreshes(group: dict, step: int) -> bool:
    """Whether the bases are refreshed after Adam step `step` (every `precondition_frequency`)."""
    return step > 0 and step % group["precondition_frequency"] == 0


def shampoo_beta(group: dict) -> float:
    """The factors' moving-average coefficient: `shampoo_beta`, or `betas[1]` when it is negative."""
    beta = group["shampoo_beta"]
    return group["betas"][1] if beta < 0 else beta


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_hyperparameters(group: dict) -> None:
    """Raise ValueError naming the argument for a hyperparameter out of range (the defaults, or a
    param group)."""
    check_lr(group["lr"])
    try:
        check_betas(group["betas"])
    except ValueError as e:
        raise ValueError(f"Invalid betas: {group['betas']!r} (need two numbers in [0, 1): {e})") from None
    beta = group["shampoo_beta"]
    if not (isinstance(beta, (int, float)) and not isinstance(beta, bool) and beta < 1 and beta == beta):
        raise ValueError(f"Invalid shampoo_beta: {beta!r} (need a number below 1; negative: betas[1])")
    check_at_least(group["eps"], 0.0, "Invalid eps: {!r} (need eps >= 0)")
    check_at_least(group["weight_decay"], 0.0, "Invalid weight_decay: {!r} (need weight_decay >= 0)")
    for name in ("precondition_frequency", "max_precond_dim"):
        if not _is_int(group[name]) or group[name] < 1:
            raise ValueError(f"Invalid {name}: {group[name]!r} (need an integer >= 1)")
    for name in ("merge_dims", "precondition_1d", "normalize_grads", "correct_bias"):
        if not isinstance(group[name], bool):
            raise ValueError(f"Invalid {name}: {group[name]!r} (need True or False)")
    if group["data_format"] not in DATA_FORMATS:
        raise ValueError(f"Invalid data_format: {group['data_format']!r} (expected one of {DATA_FORMATS})")
