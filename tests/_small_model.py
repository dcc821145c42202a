"""The small model of the single-unit tests (amp, misuse, host syncs, no_sync agreement): a seeded
two-layer MLP, and each rank's loss at a step on inputs of its own."""

from __future__ import annotations

import torch


def small_model() -> torch.nn.Sequential:
    """Linear(6, 8), Tanh, Linear(8, 3) under seed 0."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def small_loss(model: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s loss at `step`: the mean square of the output on seeded inputs."""
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
    return model(x).square().mean()
