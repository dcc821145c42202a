"""Muon over a tensor-parallel model (dp2 x tp2 on 4 gloo ranks): torch's TP plan on
world["tp"], vo.Muon on world["dp"]; each full matrix (its Colwise row blocks or Rowwise column
blocks from both TP ranks) orthogonalized once in the whole world, the same numbers as one
process running torch.optim.Muon (+ AdamW for the norms) on the mean gradient."""

import pytest
import torch
from _reference import mean_grad_reference
from test_tensor_parallel import PLAN, _batch, _build, _full, _loss, _world
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import vescale_optim as vo

pytestmark = pytest.mark.slow

STEPS = 3
MUON = dict(lr=0.02, weight_decay=0.1)
ADAM = dict(lr=0.01, weight_decay=0.05)


def _groups(model):
    mats = [p for p in model.parameters() if p.ndim == 2]
    return mats, [p for p in model.parameters() if p.ndim != 2]


def reference(dp=2):
    """One process: torch.optim.Muon on the matrices, AdamW on the norms, mean gradient over dp."""
    model = _build()
    mats, vecs = _groups(model)
    muon = torch.optim.Muon(mats, **MUON)
    adam = torch.optim.AdamW(vecs, betas=(0.9, 0.95), eps=1e-8, **ADAM)
    for t in range(STEPS):
        mean_grad_reference(model.parameters(), dp, lambda r, t=t: _loss(model, *_batch(t, r)).backward())
        muon.step()
        adam.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(zero3):
    world = _world()
    model = parallelize_module(_build(), world["tp"], PLAN)
    mats, vecs = _groups(model)
    units = dict(shard_modules=[*(getattr(model, n) for n in PLAN), model]) if zero3 else {}
    opt = vo.Muon([{"params": mats}, {"params": vecs, "use_muon": False, **ADAM}], mesh=world["dp"],
                  **units, **MUON)  # fmt: skip
    dp_rank = world["dp"].get_local_rank()
    counts = []
    for t in range(STEPS):
        _loss(model, *_batch(t, dp_rank)).backward()
        opt.step()
        opt.zero_grad()
        counts.append(opt.step_stats["ns_matrices"])
    assert all(isinstance(p, DTensor) for p in mats)
    return _full(model.state_dict()), counts


@pytest.mark.parametrize("zero3", [False, True])
def test_dp2_tp2_muon_equals_one_process_each_matrix_once(world, zero3):
    want = reference()
    results = world(4).run(_train, zero3)
    n = sum(1 for p in _build().parameters() if p.ndim == 2)
    for t in range(STEPS):  # every full matrix orthogonalized exactly once in the world, each step
        assert sum(counts[t] for _, counts in results) == n
    for got, _ in results:
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=2e-4, msg=k)
