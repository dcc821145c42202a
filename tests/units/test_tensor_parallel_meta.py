"""A tensor-parallel model built on the meta device (4 gloo ranks): torch's TP plan applied to the
meta model (DTensor parameters on the meta device), then vo.AdamW with a unit per projection on
world["dp"], which materialises it. Each TP rank's shard equals that rank's shard of the
unparallelised model built normally under rank 0's seed, at dp2 x tp2, dp1 x tp4 and dp4 x tp1
(the values do not depend on the TP size), a rotary buffer too; a few steps later the model
equals one process running torch.optim.AdamW on the mean gradient. vo.Muon (AdamW groups for
the norms) materialises it the same way and then equals torch.optim.Muon + AdamW. A parameter
that nothing initialises is named on every rank."""

import pytest
import torch
from _tp import (
    ADAMW,
    DIM,
    HEAD,
    MUON,
    PLAN,
    PROJECTIONS,
    STEPS,
    LlamaBlock,
    full,
    mean_grad,
    mesh,
    placements,
    train,
)
from _tp import MUON_ADAM as ADAM
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import vescale_optim as vo

pytestmark = pytest.mark.slow


class RotaryEmbedding(nn.Module):
    """Rotary position embedding over `HEAD` features: a buffer its `reset_parameters()` computes
    afresh and assigns (as torchtitan's `freqs_cis`), so on the meta device it waits for it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.empty(HEAD // 2))
        self.reset_parameters()

    def reset_parameters(self):
        self.inv_freq = 1.0 / 10000 ** (torch.arange(0, HEAD, 2, device=self.inv_freq.device).float() / HEAD)

    def forward(self, x):  # [batch, heads, seq, HEAD]
        angle = torch.arange(x.shape[-2], dtype=x.dtype)[:, None] * self.inv_freq[None]
        cos, sin = angle.cos(), angle.sin()
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class RopeBlock(LlamaBlock):
    """The TP tests' Llama-like block with rotary queries and keys; every parameter and buffer
    comes from its module's own initialisation (norms at ones and zeros)."""

    def __init__(self):
        super().__init__()
        self.rope = RotaryEmbedding()

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (w(h).view(b, t, -1, HEAD).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        att = torch.nn.functional.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True)
        x = x + self.wo(att.transpose(1, 2).reshape(b, t, -1))
        h = self.norm2(x)
        return x + self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h))


def reference(dp, steps=STEPS, muon=False):
    """One process: the block built normally under seed 0 (the state then), and after `steps`
    of torch.optim.AdamW on the mean gradient over `dp` ranks' batches (with `muon`,
    torch.optim.Muon on the matrices and AdamW on the norms, on one thread as each rank runs:
    CPU bf16 matmuls round by how threads block them)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if muon else threads)
    try:
        torch.manual_seed(0)
        model = RopeBlock()
        built = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if muon:
            mats, norms = _muon_groups(model)
            adam = torch.optim.AdamW(norms, betas=(0.9, 0.95), eps=1e-8, **ADAM)
            opts = [torch.optim.Muon(mats, **MUON), adam]
        else:
            opts = [torch.optim.AdamW(model.parameters(), **ADAMW)]
        for t in range(steps):
            mean_grad(model, t, dp)
            for opt in opts:
                opt.step()
        return built, {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def _muon_groups(model):
    """The matrices (Muon's) and the norms' vectors (AdamW's)."""
    params = list(model.parameters())
    return [p for p in params if p.ndim == 2], [p for p in params if p.ndim != 2]


def _meta_model(world, block=RopeBlock):
    """`block` built on the meta device under this rank's own seed (rank 0's is the reference's),
    then tensor-parallelised there: DTensor parameters on the meta device."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0 if rank == 0 else 100 + rank)
    with torch.device("meta"):
        model = block()
    model = parallelize_module(model, world["tp"], PLAN)
    assert isinstance(model.wq.weight, DTensor) and model.wq.weight.is_meta
    return model


def _normal_model(world):
    """The block built normally under seed 0 on every rank, then tensor-parallelised."""
    torch.manual_seed(0)
    return parallelize_module(RopeBlock(), world["tp"], PLAN)


def _train_meta(shape, steps=STEPS, muon=False, meta=True):
    """dp x tp of `shape` from the meta device (or built normally, `meta=False`): the whole model
    state after construction and after `steps` of vo.AdamW (ZeRO-3, a unit per projection and the
    root's); with `muon`, of vo.Muon on the matrices with an AdamW group for the norms."""
    world = mesh(*shape)
    model = _meta_model(world) if meta else _normal_model(world)
    before = placements(model)
    units = [*(getattr(model, n) for n in PROJECTIONS), model]
    if muon:
        mats, norms = _muon_groups(model)
        groups = [{"params": mats}, {"params": norms, "use_muon": False, **ADAM}]
        opt = vo.Muon(groups, mesh=world["dp"], shard_modules=units, **MUON)
    else:
        opt = vo.AdamW(model.parameters(), mesh=world["dp"], shard_modules=units, **ADAMW)
    assert placements(model) == before  # DTensors with their TP placements, off the meta device
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    built = full(model.state_dict())
    train(model, opt, world["dp"].get_local_rank(), range(steps))
    assert placements(model) == before
    return built, full(model.state_dict())


SHAPES = [((2, 2), False), ((1, 4), False), ((4, 1), False), ((2, 2), True), ((1, 4), True)]


@pytest.mark.parametrize(
    "shape, muon", SHAPES, ids=[f"dp{d}xtp{t}" + ("-muon" if m else "") for (d, t), m in SHAPES]
)
def test_meta_dtensors_equal_the_model_built_normally_then_one_process(world, shape, muon):
    """With Muon, also bitwise the same TP model built normally and trained alike: bf16 Newton–Schulz
    of this block's gradients is ill-conditioned (a relative 1e-6 of noise in the reference's
    gradients moves it by up to 1e-3 in 3 steps; the TP shards' gradients round that differently),
    so the one-process comparison takes that measured floor."""
    want_built, want = reference(dp=shape[0], muon=muon)
    assert "rope.inv_freq" in want_built
    tolerance = dict(rtol=0, atol=2e-3) if muon else dict(rtol=1e-5, atol=1e-6)
    runs = world(4).run(_train_meta, shape, STEPS, muon)
    normal = world(4).run(_train_meta, shape, STEPS, muon, False) if muon else [None] * len(runs)
    for (built, got), same in zip(runs, normal):
        assert built.keys() == want_built.keys()
        for k in want_built:  # the same random draws, whole, whatever the TP size
            assert torch.equal(built[k], want_built[k]), k
        for k in want:
            torch.testing.assert_close(got[k], want[k], **tolerance, msg=k)
            assert same is None or torch.equal(got[k], same[1][k]), k


class Skips(nn.Linear):
    """Its `reset_parameters()` leaves the weight alone."""

    def reset_parameters(self):
        pass


def _uninitialised():
    world = mesh()

    class Broken(RopeBlock):
        def __init__(self):
            super().__init__()
            self.wk = Skips(DIM, DIM, bias=False)

    model = _meta_model(world, Broken)
    units = [*(getattr(model, n) for n in PROJECTIONS), model]
    try:
        vo.AdamW(model.parameters(), mesh=world["dp"], shard_modules=units, **ADAMW)
    except ValueError as e:
        return str(e)
    return None


def test_a_meta_dtensor_nothing_initialises_is_named_on_every_rank(world):
    for got in world(4).run(_uninitialised, timeout=60):
        assert got is not None and "wk.weight was not initialised by reset_parameters()" in got, got
