"""Sequence parallelism next to tensor parallelism (dp2 x tp2 on 4 gloo ranks): torch's TP plan
with SequenceParallel on the norms and PrepareModuleInput on attention and the MLP, vo.AdamW on
world["dp"]. The norm weights are DTensors replicated over TP whose gradients arrive Partial
(each TP rank's sequence shard): they are summed over TP as DTensor does, so every TP rank holds
the same norm weights, equal to one process running torch.optim.AdamW (or torch.optim.Muon on
the matrices and AdamW on the norms) on the mean gradient."""

import pytest
import torch
from _tp import (
    ADAMW,
    MUON,
    SP_PLAN,
    SP_SEQ,
    SP_TP,
    STEPS,
    SequenceParallelBlock,
    build,
    full,
    local,
    mean_grad,
    mesh,
    train_sequence_parallel,
)
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import parallelize_module

import vescale_optim as vo

pytestmark = pytest.mark.slow

NORMS = ("norm1.weight", "norm2.weight", "norm2.bias")


def _optimizers(model, muon):
    """torch's optimizers for the reference: AdamW on everything, or Muon on the matrices and
    AdamW on the norms."""
    if not muon:
        return [torch.optim.AdamW(model.parameters(), **ADAMW)]
    mats = [p for p in model.parameters() if p.ndim == 2]
    vecs = [p for p in model.parameters() if p.ndim != 2]
    return [torch.optim.Muon(mats, **MUON), torch.optim.AdamW(vecs, **ADAMW)]


def _ours(model, muon, mesh, units):
    if not muon:
        return vo.AdamW(model.parameters(), mesh=mesh, **units, **ADAMW)
    mats = [p for p in model.parameters() if p.ndim == 2]
    vecs = [p for p in model.parameters() if p.ndim != 2]
    groups = [{"params": mats}, {"params": vecs, "use_muon": False, **ADAMW}]
    return vo.Muon(groups, mesh=mesh, **units, **MUON)


def reference(muon=False, clip=None):
    model = build(SequenceParallelBlock)
    opts = _optimizers(model, muon)
    for t in range(STEPS):
        mean_grad(model, t, 2, SP_SEQ)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for opt in opts:
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(zero3, muon, clip=None):
    world = mesh(2, SP_TP)
    model = parallelize_module(build(SequenceParallelBlock), world["tp"], SP_PLAN)
    units = dict(shard_modules=[model.attn, model.mlp, model]) if zero3 else {}
    opt = _ours(model, muon, world["dp"], units)
    train_sequence_parallel(model, opt, world, range(STEPS), clip)
    placements = {n: tuple(p.placements) for n, p in model.named_parameters() if n in NORMS}
    with opt.gathered():  # ZeRO-3 parameters are shards between uses
        norms = {n: local(model.get_parameter(n)).detach().clone() for n in NORMS}
    return full(model.state_dict()), norms, placements


@pytest.mark.parametrize(
    "zero3, muon, clip",
    [(False, False, None), (True, False, 0.05), (False, True, None)],
    ids=["adamw", "adamw-zero3-clipped", "muon"],
)
def test_sequence_parallel_norms_sum_over_tp_and_equal_one_process(world, zero3, muon, clip):
    want = reference(muon, clip)
    results = world(4).run(_train, zero3, muon, clip)
    for got, norms, placements in results:
        assert all(pl == (Replicate(),) for pl in placements.values()), placements
        for k in want:  # Muon's Newton-Schulz rounds as in tests/units/test_tensor_parallel_muon.py
            atol = 2e-4 if muon else 1e-6
            torch.testing.assert_close(got[k], want[k], rtol=0 if muon else 1e-5, atol=atol, msg=k)
        for n in NORMS:  # the local norm weights themselves, the same on every TP rank
            torch.testing.assert_close(norms[n], results[0][1][n], rtol=0, atol=0, msg=n)
