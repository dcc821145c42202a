"""The Muon tests' shared cases: seeded parameters of many shapes (tall, wide, square, tiny, a 3-D
stack, a 4-D conv), per-rank gradients and their mean, torch.optim.Muon (+ AdamW) as the reference
on them, and NorMuon written out from its paper for the tests that hold `normuon=True` to it."""

from __future__ import annotations

import torch
from _reference import mean_of

# tall, wide, square, tiny, a 3-D stack of 3 wide matrices, a 4-D conv, and two repeats
MUON_SHAPES = [(12, 5), (4, 10), (8, 8), (2, 3), (3, 4, 6), (6, 2, 3, 3), (8, 8), (12, 5)]
ADAM_SHAPES = [(7,), (5, 3)]
STEPS = 3


def make_params() -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """Muon's parameters (MUON_SHAPES) and the AdamW group's (ADAM_SHAPES), seeded."""
    g = torch.Generator().manual_seed(0)
    muon = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in MUON_SHAPES]
    adam = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ADAM_SHAPES]
    return muon, adam


def grad(shape, step: int, rank: int, i: int) -> torch.Tensor:
    """Rank `rank`'s gradient of parameter `i` at `step` (each rank's of another scale)."""
    g = torch.Generator().manual_seed(7919 * step + 101 * rank + i)
    return torch.randn(shape, generator=g) * (1 + rank)


def mean_grad(shape, step: int, world: int, i: int) -> torch.Tensor:
    return mean_of(grad(shape, step, r, i) for r in range(world))


def hyper(adjust, nesterov) -> dict:
    return dict(lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust)


def reference(
    world: int, adjust, nesterov, steps: int = STEPS
) -> tuple[list[torch.Tensor], torch.optim.Muon]:
    """torch.optim.Muon on every matrix (3-D stacks slice by slice, 4-D viewed as 2-D), AdamW on
    the rest, fed the mean gradient of `world` ranks: the parameters after `steps`, and the Muon."""
    muon, adam = make_params()
    mats, owners = [], []
    for i, p in enumerate(muon):
        if p.ndim == 3:
            for s in range(p.shape[0]):
                mats.append(torch.nn.Parameter(p.detach()[s].clone()))
                owners.append((i, s))
        else:
            mats.append(torch.nn.Parameter(p.detach().reshape(p.shape[0], -1).clone()))
            owners.append((i, None))
    adam = [torch.nn.Parameter(p.detach().clone()) for p in adam]
    mopt = torch.optim.Muon(mats, **hyper(adjust, nesterov))
    aopt = torch.optim.AdamW(adam, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)
    for t in range(steps):
        full = [mean_grad(p.shape, t, world, i) for i, p in enumerate(muon)]
        for m, (i, s) in zip(mats, owners):
            m.grad = (full[i][s] if s is not None else full[i].reshape(m.shape)).clone()
        for j, p in enumerate(adam):
            p.grad = mean_grad(p.shape, t, world, len(muon) + j)
        mopt.step()
        aopt.step()
    out = []
    for i, p in enumerate(muon):
        pieces = [m.detach() for m, (k, _) in zip(mats, owners) if k == i]
        out.append(torch.stack(pieces) if p.ndim == 3 else pieces[0].reshape(p.shape))
    return out + [p.detach() for p in adam], mopt


def n_matrices() -> int:
    """How many matrices Muon orthogonalizes per step (a 3-D stack is that many)."""
    return sum(s[0] if len(s) == 3 else 1 for s in MUON_SHAPES)


def normuon_reference(o: torch.Tensor, v: torch.Tensor, beta2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """NorMuon (arXiv 2510.05491, Algorithm 1): per-neuron second moment, row normalization,
    then back to O's Frobenius norm."""
    o = o.float()
    v = beta2 * v + (1 - beta2) * (o * o).mean(dim=1)
    on = o / (v.sqrt() + 1e-8)[:, None]
    return on * (o.norm() / on.norm().clamp(min=1e-8)), v
