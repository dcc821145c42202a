"""Loss scaling: `ShardedGradScaler` skips a step on every rank when any rank overflows and
keeps one scale everywhere; the plain `torch.amp.GradScaler`, whose skip is per rank, is
refused on more than one rank instead of hanging (and works in one process)."""

import math

import pytest
import torch
import torch.distributed as dist
from _reference import mean_grad_reference
from _small_model import small_loss, small_model
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

import vescale_optim as vo

STEPS, OVERFLOW = 3, 1  # at step 1 one rank's gradient overflows


def _scaled(kind):
    distributed = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    model = small_model()
    opt = vo.AdamW(model.parameters(), lr=0.01)
    make = ShardedGradScaler if kind == "sharded" else torch.amp.GradScaler
    scaler = make("cpu", init_scale=2.0**10)
    scales = []
    for t in range(STEPS):
        opt.zero_grad()
        scaler.scale(small_loss(model, t, rank)).backward()
        if t == OVERFLOW and rank == world - 1:  # an overflowing gradient replaces this rank's
            model[0].weight.grad = torch.full_like(model[0].weight, math.inf)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return [p.detach().clone() for p in model.parameters()], scales


def _check(results, world):
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for t in range(STEPS):
        mean_grad_reference(model.parameters(), world, lambda r, t=t: small_loss(model, t, r).backward())
        if t != OVERFLOW:  # skipped on every rank
            opt.step()
    for params, scales in results:
        assert scales == [2.0**10, 2.0**9, 2.0**9]  # backed off once, the same on every rank
        for got, want in zip(params, model.parameters()):
            # W=2: the sum of two gradients does not depend on their order (a + b == b + a)
            # and the scale is a power of two, so only the AdamW math's rounding is left
            torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-7)


def test_sharded_grad_scaler_skips_on_every_rank_and_keeps_one_scale(world):
    _check(world(2).run(_scaled, "sharded", timeout=60), 2)


def test_plain_grad_scaler_works_in_one_process():
    _check([_scaled("plain")], 1)


def _plain_refused():
    with pytest.raises(RuntimeError, match="decides per rank whether to skip step"):
        _scaled("plain")


def test_plain_grad_scaler_is_refused_on_every_rank_instead_of_hanging(world):
    world(2).run(_plain_refused, timeout=60)
