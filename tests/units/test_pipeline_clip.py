"""Clipping across pipeline stages on a pp2 x dp2 gloo world: each stage's optimizer holds part
of the model, and the norm must be the whole model's on every rank, as one-process torch's
`clip_grad_norm_` gives it on the mean gradient. Two ways: `opt.clip_grad_norm_(pp_mesh=)`, and
torch's own utilities with the documented extra step (the stage's norm to the power p summed
over the pp group), as torchtitan does."""

import math

import pytest
import torch
import torch.distributed as dist
from _pipeline import Layout, Reference, batch, build

LAYOUT = Layout(pp=2, dp=2, microbatches=2)
MAX_NORM = 0.05  # below every step's norm: the clip changes the update


def _torch_clip(rank, norm_type: float) -> torch.Tensor:
    """torch's utilities over this stage's parameters, the stage norms combined over pp."""
    params = list(rank.part.parameters())
    total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
    total = total.clone()  # an ordinary tensor: the stage's norm, reduced over its dp ranks
    pp = rank.world["pp"].get_group()
    if math.isinf(norm_type):
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp)
    else:
        total = total**norm_type
        dist.all_reduce(total, group=pp)
        total = total ** (1.0 / norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, total)
    return total


def _train(kind: str, zero: int, how: str, norm_type: float, steps: int):
    rank = build(kind, LAYOUT, zero)
    norms = []
    for step in range(steps):
        rank.forward_backward(*batch(step, rank.dp_rank, LAYOUT.dp))
        if how == "ours":
            norms.append(rank.opt.clip_grad_norm_(MAX_NORM, norm_type, pp_mesh=rank.world["pp"]))
        else:
            norms.append(_torch_clip(rank, norm_type))
        rank.opt.step()
        rank.opt.zero_grad()
    return [float(n) for n in norms], {
        k: v.clone() for k, v in rank.opt.full_model_state_dict(rank.part).items()
    }


def _reference(kind: str, norm_type: float, used: list[float]):
    """torch's norms of the whole model's mean gradients, and the parameters after clipping
    by `used` (the norms the stages found: Muon's bf16 Newton-Schulz turns a last-bit
    difference in the clip coefficient, from summing in another order, into ~lr * 2^-8)."""
    ref = Reference(kind)
    norms = []
    for step, total in enumerate(used):
        ref.backward_mean(step, LAYOUT)
        params = list(ref.model.parameters())
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)))
        torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, torch.tensor(total))
        for opt in ref.opts:
            opt.step()
        ref.model.zero_grad()
    return norms, ref.params()


@pytest.mark.parametrize(
    "kind, zero, how, norm_type",
    [
        ("adamw", 3, "ours", 2.0),
        ("adamw", 2, "torch", 2.0),
        ("muon", 3, "ours", math.inf),
        ("muon", 2, "ours", 2.0),
        ("muon", 3, "torch", 2.0),
    ],
)
def test_a_stage_clips_by_the_whole_models_norm(world, kind, zero, how, norm_type):
    steps = 2
    runs = world(4).run(_train, kind, zero, how, norm_type, steps, timeout=120)
    want_norms, want = _reference(kind, norm_type, runs[0][0])
    assert min(want_norms) > MAX_NORM  # every step clips
    for norms, params in runs:
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(want_norms), rtol=1e-5, atol=0)
        for name, value in params.items():
            torch.testing.assert_close(value, want[name], rtol=0, atol=1e-5, msg=name)
    one_stage = [sum(p.numel() for p in params.values()) for _, params in runs]
    assert len(set(one_stage)) == 2  # the two stages hold different parts
