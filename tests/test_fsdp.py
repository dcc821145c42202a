"""Fully sharded training (`shard_modules`) equals one process fed the mean gradient:
AdamW vs torch.optim.AdamW, Muon vs torch.optim.Muon (+ AdamW), Shampoo vs the plain
reference, on a GPT-like model with tied embeddings, at W 1-4, resharding after forward
or not, accumulating (both ways), with activation checkpointing, built on the meta
device, and in bf16 over fp32 shards."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from _shampoo_reference import ReferenceShampoo
from _tiny_gpt import TinyGPT, batch, build, loss_fn

import vescale_optim as vo

STEPS = 3
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MUON = dict(lr=0.02, weight_decay=0.1)
AUX = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
# roots from two steps of gradients, in fp64 (the reference's eigh and power round differently)
SHAMPOO = dict(lr=1e-2, max_preconditioner_dim=8, precondition_frequency=2, root_dtype=torch.float64)


def _model(meta=False, checkpoint=False):
    if meta:
        torch.manual_seed(0)
        with torch.device("meta"):
            return TinyGPT(checkpoint=checkpoint)
    return build(checkpoint=checkpoint)


def _reference_model(meta=False, checkpoint=False):
    if meta:
        torch.manual_seed(0)
        return TinyGPT(checkpoint=checkpoint)
    return build(checkpoint=checkpoint)


def _split(model):
    """Muon's matrices and the rest (embedding tied with the head, norms, biases)."""
    mats = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "embed" not in n)]
    return mats, rest


def make_ours(kind, model, **sharding):
    if kind == "adamw":
        return vo.AdamW(model.parameters(), **ADAMW, **sharding)
    if kind == "muon":
        mats, rest = _split(model)
        return vo.Muon([{"params": mats}, {"params": rest, "use_muon": False, **AUX}], **MUON, **sharding)
    return vo.Shampoo(model.parameters(), **SHAMPOO, **sharding)


class _Reference:
    def __init__(self, kind, model):
        if kind == "adamw":
            self.opts = [torch.optim.AdamW(model.parameters(), **ADAMW)]
        elif kind == "muon":
            mats, rest = _split(model)
            self.opts = [torch.optim.Muon(mats, **MUON), torch.optim.AdamW(rest, **AUX)]
        else:
            self.opts = [ReferenceShampoo(list(model.parameters()), **SHAMPOO)]

    def step(self):
        for opt in self.opts:
            opt.step()


def reference(kind, world, steps=STEPS, micro=1, meta=False, checkpoint=False):
    model = _reference_model(meta, checkpoint)
    opt = _Reference(kind, model)
    for t in range(steps):
        for p in model.parameters():
            p.grad = None
        for r in range(world):
            for m in range(micro):
                (loss_fn(model, *batch(t, r, m)) / (world * micro)).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(kind, steps=STEPS, micro=1, no_sync=False, meta=False, checkpoint=False, **sharding):
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = _model(meta, checkpoint)
    opt = make_ours(kind, model, shard_modules=[*model.layers, model], **sharding)
    for t in range(steps):
        for m in range(micro):
            quiet = opt.no_sync() if no_sync and m < micro - 1 else contextlib.nullcontext()
            with quiet:
                (loss_fn(model, *batch(t, rank, m)) / micro).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def _assert_equal(got, want, atol=1e-6):
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=atol, msg=k)


# Muon: the mean gradient rounds differently here and in one process, and Newton-Schulz in
# bf16 turns that into the odd flipped rounding of its output: one flip moves a parameter by
# at most 2^-8 (|O| < 1) times the adjusted lr (0.02 * sqrt(3) for the 48x16 attention
# matrix), 1.4e-4; the tolerance allows about a dozen over the run. test_muon holds Muon to
# torch exactly on gradients whose mean is exact.
TOL = {"adamw": 1e-6, "muon": 2e-3, "shampoo": 1e-5}


@pytest.mark.parametrize("kind", ["adamw", "muon", "shampoo"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fully_sharded_equals_one_process(world, kind, world_size):
    want = reference(kind, world_size)
    for got in world(world_size).run(_train, kind):
        _assert_equal(got, want, TOL[kind])


CASES = {
    "keep gathered after forward": dict(reshard_after_forward=False),
    "accumulate": dict(micro=2),
    "accumulate under no_sync": dict(micro=3, no_sync=True),
    "activation checkpointing": dict(checkpoint=True),
    "meta-device model": dict(meta=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_variants_equal_one_process(world, kind, case):
    args = CASES[case]
    keys = ("micro", "meta", "checkpoint")
    want = reference(kind, 3, **{k: args[k] for k in keys if k in args})
    for got in world(3).run(_train, kind, **args):
        _assert_equal(got, want, TOL[kind])


def _bf16_dtypes():
    model = build()
    opt = make_ours("adamw", model, shard_modules=[*model.layers, model], param_dtype=torch.bfloat16)
    return {(u.full.data.dtype, u.shard.dtype, u.grad.dtype) for u in opt.units}


def test_bf16_compute_over_fp32_shards_tracks_fp32(world):
    """param_dtype=bf16 gathers and computes in bf16 (half the all-gather bytes); shards,
    gradients' shards, state and the update stay fp32. AdamW moves an element by at most
    about lr per step, so bf16 rounding can at worst reverse a step (|Δ| <= 2 lr per step,
    for gradients near zero); on average the run stays within 5 % of how far fp32 moved."""
    assert world(2).run(_bf16_dtypes)[0] == {(torch.bfloat16, torch.float32, torch.float32)}
    want = reference("adamw", 2)
    init = build().state_dict()
    for got in world(2).run(_train, "adamw", param_dtype=torch.bfloat16):
        diff = torch.cat([(got[k] - want[k]).abs().flatten() for k in want])
        moved = torch.cat([(want[k] - init[k]).abs().flatten() for k in want])
        assert diff.max() <= 2 * ADAMW["lr"] * STEPS
        assert 0 < diff.mean() <= 0.05 * moved.mean()
