"""A plain single-process Shampoo, written for clarity rather than speed: loops over
parameters and tiles, one `torch.linalg.eigh` per factor. The tests hold the sharded
optimizer to it."""

from __future__ import annotations

import math

import torch

DEFAULTS = dict(
    lr=1e-2,
    betas=(0.9, 0.999),
    epsilon=1e-12,
    weight_decay=0.0,
    max_preconditioner_dim=1024,
    precondition_frequency=1,
    start_preconditioning_step=None,  # None: precondition_frequency
    grafting="adam",
    grafting_epsilon=1e-8,
    root_dtype=torch.float32,
)


def tile_slices(rows: int, cols: int, d: int) -> dict[tuple[int, int], tuple[slice, slice]]:
    """Tiles of at most d x d of a rows x cols matrix: blocks of d, the last one shorter."""
    return {
        (i, j): (slice(r, min(r + d, rows)), slice(c, min(c + d, cols)))
        for i, r in enumerate(range(0, rows, d))
        for j, c in enumerate(range(0, cols, d))
    }


def inverse_fourth_root(factor: torch.Tensor, epsilon: float, dtype: torch.dtype) -> torch.Tensor:
    eigenvalues, eigenvectors = torch.linalg.eigh(factor.to(dtype))
    powers = (eigenvalues.clamp(min=0) + epsilon) ** -0.25
    return (eigenvectors @ torch.diag(powers) @ eigenvectors.T).to(factor.dtype)


class ReferenceShampoo:
    def __init__(self, params_or_groups, **defaults):
        groups = list(params_or_groups)
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.param_groups = [{**DEFAULTS, **defaults, **g} for g in groups]
        self.state: dict[torch.Tensor, dict] = {}

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                self._step_param(p, group)

    def _step_param(self, p: torch.Tensor, group: dict) -> None:
        beta1, beta2 = group["betas"]
        if p.grad is None:  # as torch: a parameter without a gradient takes no step
            return
        grad = p.grad
        state = self.state.setdefault(p, {"step": 0, "exp_avg": torch.zeros_like(p)})
        state["step"] += 1
        t = state["step"]

        # momentum
        state["exp_avg"] = beta1 * state["exp_avg"] + (1 - beta1) * grad
        mhat = state["exp_avg"] / (1 - beta1**t)

        # grafting update
        grafting = group["grafting"]
        if grafting == "adam":
            v = state.get("exp_avg_sq", torch.zeros_like(p))
            v = v + grad * grad if beta2 == 1 else beta2 * v + (1 - beta2) * grad * grad
            state["exp_avg_sq"] = v
            correction = 1.0 if beta2 == 1 else 1 - beta2**t
            graft = mhat / (v.sqrt() / math.sqrt(correction) + group["grafting_epsilon"])
        elif grafting == "adagrad":
            v = state.get("sum", torch.zeros_like(p)) + grad * grad
            state["sum"] = v
            graft = mhat / (v.sqrt() + group["grafting_epsilon"])
        else:
            graft = mhat.clone()

        update = graft
        if p.dim() >= 2 and p.numel() > 0:
            update = self._precondition(p, grad, mhat, graft, state, group)

        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.sub_(group["lr"] * update)

    def _precondition(self, p, grad, mhat, graft, state, group) -> torch.Tensor:
        beta2 = group["betas"][1]
        t = state["step"]
        rows, cols = p.shape[0], p.numel() // p.shape[0]
        g2, m2, a2 = grad.reshape(rows, cols), mhat.reshape(rows, cols), graft.reshape(rows, cols)
        update = a2.clone()
        freq = group["precondition_frequency"]
        start = freq if group["start_preconditioning_step"] is None else group["start_preconditioning_step"]
        for (i, j), (rs, cs) in tile_slices(rows, cols, group["max_preconditioner_dim"]).items():
            G = g2[rs, cs]
            h, w = G.shape
            L = state.get(f"L_{i}_{j}", torch.zeros(h, h))
            R = state.get(f"R_{i}_{j}", torch.zeros(w, w))
            if beta2 == 1:
                L, R = L + G @ G.T, R + G.T @ G
            else:
                L, R = beta2 * L + (1 - beta2) * G @ G.T, beta2 * R + (1 - beta2) * G.T @ G
            state[f"L_{i}_{j}"], state[f"R_{i}_{j}"] = L, R
            if t >= start and (t - start) % freq == 0:
                correction = 1.0 if beta2 == 1 else 1 - beta2**t
                eps, dtype = group["epsilon"], group["root_dtype"]
                state[f"L_inv_root_{i}_{j}"] = inverse_fourth_root(L / correction, eps, dtype)
                state[f"R_inv_root_{i}_{j}"] = inverse_fourth_root(R / correction, eps, dtype)
            if t >= start:
                D = state[f"L_inv_root_{i}_{j}"] @ m2[rs, cs] @ state[f"R_inv_root_{i}_{j}"]
                if group["grafting"] is not None:
                    norm = D.norm()
                    D = D * (a2[rs, cs].norm() / norm) if norm > 0 else torch.zeros_like(D)
                update[rs, cs] = D
        return update.reshape(p.shape)
