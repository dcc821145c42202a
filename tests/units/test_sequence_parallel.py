"""Sequence parallelism next to tensor parallelism (dp2 x tp2 on 4 gloo ranks): torch's TP plan
with SequenceParallel on the norms and PrepareModuleInput on attention and the MLP, vo.AdamW on
world["dp"]. The norm weights are DTensors replicated over TP whose gradients arrive Partial
(each TP rank's sequence shard): they are summed over TP as DTensor does, so every TP rank holds
the same norm weights, equal to one process running torch.optim.AdamW (or torch.optim.Muon on
the matrices and AdamW on the norms) on the mean gradient."""

import pytest
import torch
from _reference import mean_grad_reference
from test_tensor_parallel import _batch, _build  # the same seeded norms and batches
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import vescale_optim as vo

pytestmark = pytest.mark.slow

DIM, HIDDEN, HEAD, STEPS, BATCH, SEQ, TP = 16, 32, 4, 3, 2, 6, 2
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MUON = dict(lr=0.02, weight_decay=0.1)
GATHER = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
PLAN = {
    "norm1": SequenceParallel(),
    "norm2": SequenceParallel(),
    "attn": GATHER,
    "mlp": GATHER,
    **{f"attn.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")},
    **{f"mlp.{n}": ColwiseParallel() for n in ("w1", "w3")},
    "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
    "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
}
NORMS = ("norm1.weight", "norm2.weight", "norm2.bias")


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, h):
        b, t, _ = h.shape
        q, k, v = (w(h).view(b, t, -1, HEAD).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(att.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, h):
        return self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h))


class Block(nn.Module):
    """A Llama-like block (as tests/units/test_tensor_parallel.py's, with attention and MLP as
    modules of their own for PrepareModuleInput); under the plan its residual stream is each TP
    rank's sequence shard."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(DIM), nn.LayerNorm(DIM)
        self.attn, self.mlp = Attention(), MLP()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


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
    model = _build(Block)
    opts = _optimizers(model, muon)
    loss = lambda r, t: torch.nn.functional.mse_loss(model(*_batch(t, r, SEQ)[:1]), _batch(t, r, SEQ)[1])  # noqa: E731
    for t in range(STEPS):
        mean_grad_reference(model.parameters(), 2, lambda r, t=t: loss(r, t).backward())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for opt in opts:
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _train(zero3, muon, clip=None):
    world = init_device_mesh("cpu", (2, TP), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(_build(Block), world["tp"], PLAN)
    units = dict(shard_modules=[model.attn, model.mlp, model]) if zero3 else {}
    opt = _ours(model, muon, world["dp"], units)
    dp, tp = world["dp"].get_local_rank(), world["tp"].get_local_rank()
    cut = slice(tp * SEQ // TP, (tp + 1) * SEQ // TP)  # this TP rank's sequence shard
    for t in range(STEPS):
        x, y = (z[:, cut] for z in _batch(t, dp, SEQ))
        # each TP rank's loss over its shard; their sum over TP is the whole mean squared error
        (torch.nn.functional.mse_loss(model(x), y) / TP).backward()
        if clip is not None:  # torch's own: replicated norms (Partial grads summed over TP) count once
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    placements = {n: tuple(p.placements) for n, p in model.named_parameters() if n in NORMS}
    state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    with opt.gathered():  # ZeRO-3 parameters are shards between uses
        norms = {n: _local(model.get_parameter(n)).detach().clone() for n in NORMS}
    return {k: v.detach().clone() for k, v in state.items()}, norms, placements


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
