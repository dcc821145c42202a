"""torch's clip_grad_norm_ over a tensor-parallel model costs at most two all-reduces whatever
its depth (one over the data-parallel group for every term, one over the TP group for the terms
of TP shards), and its norm is one process's on the mean gradient (dp2 x tp2 on 4 gloo ranks)."""

import pytest
import torch
from _reference import mean_grad_reference
from _tp import PLAN, batch, build, loss, mesh
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

import vescale_optim as vo
from vescale_optim.shard.handle import traced

CLIP = 0.05


def _model(layers: int) -> nn.Sequential:
    """`layers` blocks of the TP tests, one after the other (`_tp.build` seeds each alike: the same
    weights in every block)."""
    return nn.Sequential(*(build() for _ in range(layers)))


def _loss(model, t, dp_rank):
    return loss(model, *batch(t, dp_rank))


def _reference(layers: int, dp: int = 2) -> torch.Tensor:
    """torch's clip_grad_norm_ of the unparallelised model's mean gradient over the dp ranks."""
    model = _model(layers)
    mean_grad_reference(model.parameters(), dp, lambda r: _loss(model, 0, r).backward())
    return torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)


def _clip(layers: int, zero3: bool):
    """The collectives torch's clip_grad_norm_ issues on the TP model's gradients (foreach and
    not), and the norm it returns."""
    world = mesh()
    model = _model(layers)
    plan = {f"{i}.{name}": style for i in range(layers) for name, style in PLAN.items()}
    model = parallelize_module(model, world["tp"], plan)
    # a unit per block (ZeRO-3), or a bucket per parameter (ZeRO-2): many units either way
    extra = dict(shard_modules=[*model, model]) if zero3 else dict(bucket_cap_numel=1)
    opt = vo.AdamW(model.parameters(), mesh=world["dp"], lr=1e-2, **extra)
    assert len(opt.runtime.units) >= layers
    _loss(model, 0, world["dp"].get_local_rank()).backward()
    traces, norms = [], []
    for foreach in (False, True):
        with traced() as trace:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=foreach))
        traces.append([kind for kind in trace if "all-reduce" in kind])
        for p in model.parameters():  # undo the clipping: the second call sees the same gradients
            p.grad.mul_(1 / min(1.0, CLIP / (norms[-1].item() + 1e-6)))
    return traces, norms


@pytest.mark.parametrize("zero3", [False, True], ids=["zero2", "zero3"])
def test_clip_grad_norm_under_tp_is_two_all_reduces_at_any_depth(world, zero3):
    counts = {}
    for layers in (2, 4):
        want = _reference(layers)
        for traces, norms in world(4).run(_clip, layers, zero3, timeout=120):
            counts.setdefault(layers, set()).update(len(t) for t in traces)
            for norm in norms:
                torch.testing.assert_close(norm, want, rtol=1e-5, atol=1e-7)
    assert counts[2] == counts[4] and max(counts[2]) <= 2, counts
