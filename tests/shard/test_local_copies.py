"""One process, no process group: what stands in for a collective (the unit all-gather's copy
of the shard into the unsharded buffer, the 8-bit reduction's all-to-all, the gather of the
updated shards of unsharded bf16 units) runs on a side stream on CUDA, so its result may be
read only once its handle is waited for. Under the emulated asynchronous device
(`delayed()`), a local copy runs only when waited for and its outputs hold garbage until then:
training is the same bits as without the emulation, and equals torch.optim.AdamW."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

import vescale_optim as vo
from vescale_optim.shard.handle import delayed

STEPS = 3


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    layers = nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4)
    return nn.Sequential(*layers).to(dtype)


def _data(t: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(t)).to(dtype)


def _optimizer(kind: str, model: nn.Module):
    sharded = dict(shard_modules=[model[0], model[2], model[4], model])
    if kind == "adamw":
        return vo.AdamW(model.parameters(), lr=1e-2, **sharded)
    if kind == "adamw_reduce8":
        return vo.AdamW(model.parameters(), lr=1e-2, reduce_bits=8, **sharded)
    if kind == "muon":
        mats = [p for p in model.parameters() if p.ndim == 2]
        rest = [p for p in model.parameters() if p.ndim != 2]
        return vo.Muon([{"params": mats}, {"params": rest, "use_muon": False}], lr=0.02, **sharded)
    if kind == "adamw_bf16_unsharded":
        return vo.AdamW(model.parameters(), lr=1e-2)
    raise ValueError(kind)


def _train(kind: str, emulate: bool) -> tuple[list[torch.Tensor], int | None]:
    dtype = torch.bfloat16 if "bf16" in kind else torch.float32
    model = _model(dtype)
    opt = _optimizer(kind, model)
    with delayed() if emulate else contextlib.nullcontext() as delays:
        for t in range(STEPS):
            model(_data(t, dtype)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        params = [p.detach().float().clone() for p in model.state_dict().values()]
    return params, delays.held_at_wait if emulate else None


@pytest.mark.parametrize("kind", ["adamw", "adamw_reduce8", "muon", "adamw_bf16_unsharded"])
def test_local_copies_are_waited_for_on_an_asynchronous_device(kind):
    assert not dist.is_initialized()
    plain, _ = _train(kind, emulate=False)
    emulated, held = _train(kind, emulate=True)
    assert held > 0  # local copies were really held back until waited for
    assert all(torch.isfinite(p).all() for p in emulated)
    assert all(torch.equal(a, b) for a, b in zip(plain, emulated))


def test_one_process_zero3_equals_torch_adamw():
    model, ref = _model(), _model()
    opt = _optimizer("adamw", model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with delayed():
        for t in range(STEPS):
            for m, o in ((model, opt), (ref, ref_opt)):
                m(_data(t, torch.float32)).square().mean().backward()
                o.step()
                o.zero_grad()
        got = [p.detach().clone() for p in model.state_dict().values()]
    for a, b in zip(got, ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
