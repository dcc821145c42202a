"""`local_state_bytes()` counts every persistent tensor an optimizer holds, and a Muon step
allocates no fp32 temporary the size of the local slice."""

import pytest
import torch
import torch.distributed as dist
from _held import held_tensor_bytes
from torch.profiler import ProfilerActivity, profile

import vescale_optim as vo
from vescale_optim.optim import muon as muon_module


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(64, 96), torch.nn.Linear(96, 128), torch.nn.GELU(), torch.nn.Linear(128, 96)
    ).to(dtype)


CONFIGS = {
    "adamw32": lambda m: vo.AdamW(m.parameters()),
    "adamw16": lambda m: vo.AdamW(m.parameters(), state_bits=16),
    "adamw8": lambda m: vo.AdamW(m.parameters(), state_bits=8),
    "muon32": lambda m: vo.Muon(vo.muon_param_groups(m)),
    "muon8": lambda m: vo.Muon(vo.muon_param_groups(m), state_bits=8),
    "shampoo": lambda m: vo.Shampoo(m.parameters(), max_preconditioner_dim=32),
}


def _counted(name, dtype):
    model = _model(dtype)
    opt = CONFIGS[name](model)
    x = torch.randint(0, 64, (4, 5), generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return held_tensor_bytes(opt), opt.local_state_bytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_local_state_bytes_counts_every_tensor_held(world, name, dtype):
    for held, counted in world(2).run(_counted, name, dtype):
        assert held == counted


def test_a_muon_step_allocates_no_slice_sized_fp32_temporary(monkeypatch):
    monkeypatch.setattr(muon_module, "_CHUNK", 1024)
    params = [torch.nn.Parameter(torch.randn(64, 128)) for _ in range(4)]
    opt = vo.Muon(params, lr=0.02)
    shard = opt.units[0].layout.shard_size
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            opt.step()
    largest = 0
    for e in prof.events():
        scopes, x = [], e.cpu_parent
        while x is not None:
            scopes.append(x.name)
            x = x.cpu_parent
        if "vescale_optim.update" in scopes and "vescale_optim.newton_schulz" not in scopes:
            largest = max(largest, e.cpu_memory_usage)
    assert largest <= 2 * shard  # the bf16 update; fp32 temporaries are chunk-sized
