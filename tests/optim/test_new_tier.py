"""A new state tier is `optim/state_tiers.py` alone (docs/extending.md counts the files): `Halves`, an
fp16 tier this file defines, is given the three entries a tier written in state_tiers.py would have
(`STATE_BITS`, `_BY_BITS`, `_BY_TIER`) and nothing else of the library changes. AdamW, Muon (its
AdamW part too) and NorMuon's owned `variance_neuron` (`state_tiers.Kept`) then keep their state in it:
after one step it is the fp32 run's state rounded to fp16, and torch's and DCP's state dicts
round-trip it, in one process and on 2 ranks."""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import vescale_optim as vo
from vescale_optim.optim import state_tiers

HALF_BITS = 12  # the `state_bits` that picks the tier: any value no tier takes names it


class Halves(state_tiers.Rounded):
    """Test-only: state in fp16, rounded to nearest, decoded to fp32 copies."""

    tier = "fp16"

    def allocate(self, specs, n: int, device, dtype: torch.dtype) -> dict:
        return {s.name: torch.zeros(n, dtype=torch.float16, device=device) for s in specs}


@contextmanager
def _added():
    """`Halves` in state_tiers's tables for the duration (what state_tiers.py itself would list)."""
    halves, bits = Halves(), state_tiers.STATE_BITS
    state_tiers.STATE_BITS = (*bits, HALF_BITS)
    state_tiers._BY_BITS[HALF_BITS], state_tiers._BY_TIER[halves.tier] = halves, halves
    try:
        yield
    finally:
        state_tiers.STATE_BITS = bits
        del state_tiers._BY_BITS[HALF_BITS], state_tiers._BY_TIER[halves.tier]


def _build(kind: str, state_bits: int) -> tuple[nn.Module, vo.ShardedOptimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 64))  # 6144-element weights
    units = dict(shard_modules=[model[0], model[2], model])
    if kind == "adamw":
        return model, vo.AdamW(model.parameters(), lr=1e-2, state_bits=state_bits, **units)
    groups = vo.muon_param_groups(model, exclude=[model[2]])  # its AdamW part holds the last weight
    return model, vo.Muon(groups, lr=1e-2, state_bits=state_bits, normuon=kind == "normuon", **units)


def _stepped(kind: str, state_bits: int, rank: int) -> tuple[nn.Module, vo.ShardedOptimizer]:
    model, opt = _build(kind, state_bits)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    model(x).square().sum().backward()  # gradients of order 1: every state value is a normal fp16
    opt.step()
    return model, opt


def _through_halves(world_size: int, folder: str) -> list[str]:
    """Each optimizer with its state in `Halves`, checked; returns the state names checked."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    checked = []
    with _added(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Muon's notes on the model's shapes
        for kind in ("adamw", "muon", "normuon"):
            _, opt = _stepped(kind, HALF_BITS, rank)
            assert {seg.tier for seg in opt.segments} == {"fp16", "fp32"}, kind
            assert all(
                t.dtype == torch.float16 for s in opt.segments if s.tier == "fp16" for t in s.state.values()
            )
            got, want = opt.state_dict()["state"], _stepped(kind, 32, rank)[1].state_dict()["state"]
            params = [p for g in opt.param_groups for p in g["params"]]
            for i, entry in got.items():
                if params[i].numel() < state_tiers.QUANT_MIN_NUMEL:
                    continue  # a small tensor's state stays fp32
                for name, value in entry.items():
                    if name != "step":  # fp16: rounded to nearest (half its 2**-10 step; subnormals 2**-25)
                        assert value.dtype == torch.float32 and not torch.equal(value, want[i][name])
                        torch.testing.assert_close(value, want[i][name], rtol=2**-11, atol=2**-25)
                        checked.append(f"{kind} {name}")
            _, again = _build(kind, HALF_BITS)
            again.load_state_dict(opt.state_dict())
            _same(again.state_dict()["state"], got)
            dcp.save({"opt": opt.sharded_state_dict()}, checkpoint_id=f"{folder}/{kind}")
            _, loaded = _build(kind, HALF_BITS)
            pieces = {"opt": loaded.sharded_state_dict()}
            dcp.load(pieces, checkpoint_id=f"{folder}/{kind}")
            loaded.load_sharded_state_dict(pieces["opt"])
            _same(loaded.state_dict()["state"], got)
    return sorted(set(checked))


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for i in a:
        assert a[i].keys() == b[i].keys() and all(torch.equal(a[i][k], b[i][k]) for k in a[i]), i


STATE = {"adamw": ["exp_avg", "exp_avg_sq"], "muon": ["exp_avg", "exp_avg_sq", "momentum_buffer"]}
STATE["normuon"] = [*STATE["muon"], "variance_neuron"]
WANT = [f"{kind} {name}" for kind, names in STATE.items() for name in names]


def test_a_tier_added_to_state_tiers_alone_serves_every_optimizer_in_one_process(tmp_path):
    assert _through_halves(1, str(tmp_path)) == WANT
    assert HALF_BITS not in state_tiers.STATE_BITS and "fp16" not in state_tiers._BY_TIER  # taken out again
    with pytest.raises(ValueError, match="state_bits must be one of"):
        _build("adamw", HALF_BITS)


def test_a_tier_added_to_state_tiers_alone_serves_every_optimizer_on_two_ranks(world, tmp_path):
    assert world(2).run(_through_halves, 2, str(tmp_path), timeout=180) == [WANT, WANT]
