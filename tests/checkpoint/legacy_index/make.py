"""How the checkpoint fixture in this folder was made: a checkpoint of vescale_optim 0.1.0
as written before optimizer state was keyed by parameter name (commit d9ef7fb, when
`opt.sharded_state_dict()` keyed state by parameter index: `optim.state.0.exp_avg`, and
saved the param groups as one list with index lists).

Two ranks train a tiny model for 3 steps with `vo.AdamW` (two param groups, ZeRO-3 units)
and `vo.CheckpointManager` saves `step-3/`; rank 0 then writes `expected.pt`: the model's
full state dict and the optimizer's full `state_dict()` at that step. The test
(`tests/checkpoint/test_pipeline_checkpoints.py`) loads `step-3/` with the current code and
checks it restores exactly that. Regenerating it needs that old code:

    git worktree add /tmp/old d9ef7fb && cd /tmp/old && \\
        PYTHONPATH=$PWD python tests/checkpoint/legacy_index/make.py OUT_DIR
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

import vescale_optim as vo
from vescale_optim.local_world import run_local

STEP = 3


def model_and_optimizer():
    """The fixture's model and optimizer, the same in the writer and the reader."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    weights, biases = [model[0].weight, model[2].weight], [model[0].bias, model[2].bias]
    groups = [{"params": weights, "lr": 1e-2}, {"params": biases, "lr": 2e-2, "weight_decay": 0.0}]
    opt = vo.AdamW(groups, shard_modules=[model[0], model[2], model])
    return model, opt


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)


def write(directory: str) -> None:
    model, opt = model_and_optimizer()
    for step in range(STEP):
        x, y = batch(step, dist.get_rank())
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    vo.CheckpointManager(directory, model, opt).save(STEP)
    expected = {"model": opt.full_model_state_dict(), "optim": opt.state_dict()}
    if dist.get_rank() == 0:
        torch.save(expected, f"{directory}/expected.pt")


if __name__ == "__main__":
    run_local(write, 2, sys.argv[1], timeout=120)
