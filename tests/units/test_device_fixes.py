"""What a first GPU run would have shown, on CPU: devices compared by one rule (an
indexed device is the same device), meta-device models with buffers (a buffer-only
module included) equal the model built normally, an uninitialisable meta tensor is
named, the group's device follows its backend, and HSDP's cross-replica all-reduce runs
in `reduce_dtype`."""

import math
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import vescale_optim as vo
from vescale_optim.shard.comm import _group_device


class BufferOnlyRotary(nn.Module):
    """A buffer-only module, as a rotary embedding: `inv_freq` is computed, not learned."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", torch.empty(dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.inv_freq.copy_(1.0 / 10000 ** (torch.arange(0, self.dim, 2).float() / self.dim))

    def forward(self, x):
        return x * torch.cos(self.inv_freq).repeat(2)


class BufferedBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)
        self.rope = BufferOnlyRotary(dim)
        self.register_buffer("count", torch.zeros(3))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.count.fill_(1.0)

    def forward(self, x):
        return x + self.fc(self.rope(self.norm(x))) * self.count.sum()


class BufferedNet(nn.Module):
    def __init__(self, dim: int = 8, layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(BufferedBlock(dim) for _ in range(layers))
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _built(meta: bool, **sharding):
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            model = BufferedNet()
    else:
        model = BufferedNet()
        for block in model.layers:
            block.reset_parameters()
    opt = vo.AdamW(model.parameters(), lr=0.1, shard_modules=[*model.layers, model], **sharding)
    return model, opt


def _meta_equals_normal():
    model, _ = _built(meta=True, device="cpu")
    normal, _ = _built(meta=False)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    want = {**dict(normal.named_buffers()), **normal.state_dict()}
    got = {**dict(model.named_buffers()), **model.state_dict()}
    return left, all(torch.equal(got[k], want[k]) for k in want), sorted(want) == sorted(got)


@pytest.mark.parametrize("world_size", [1, 2])
def test_meta_buffers_and_buffer_only_modules_are_initialised_as_built_normally(world, world_size):
    for left, equal, same_keys in world(world_size).run(_meta_equals_normal):
        assert left == [] and equal and same_keys


class Extra(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(2))


def test_a_meta_buffer_nothing_can_initialise_is_named():
    class WithExtra(BufferedNet):
        def __init__(self):
            super().__init__()
            self.extra = Extra()

    with torch.device("meta"):
        model = WithExtra()
    named = r"WithExtra\.extra\.scale is on the meta device.*no reset_parameters"
    with pytest.raises(ValueError, match=named):
        vo.AdamW(model.parameters(), shard_modules=[*model.layers, model], device="cpu")


def _steps(device):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 2))
    opt = vo.AdamW(model.parameters(), lr=0.1, device=device, shard_modules=[*model, model])
    for t in range(3):
        model(torch.randn(4, 6, generator=torch.Generator().manual_seed(t))).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.state_dict().values()]


def test_an_indexed_device_is_the_same_device():
    """`cpu:0` (like `cuda` against `cuda:0`) names the parameters' device: they step."""
    plain, indexed = _steps(None), _steps(torch.device("cpu", 0))
    start = _steps(None)  # deterministic: the same again
    assert all(torch.equal(a, b) for a, b in zip(plain, indexed))
    assert all(torch.equal(a, b) for a, b in zip(plain, start))
    torch.manual_seed(1)
    untouched = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 2)).state_dict().values()
    assert not all(torch.equal(a, b) for a, b in zip(plain, untouched))


def test_the_group_device_follows_the_backend():
    """gloo and a mixed group's CPU side move CPU tensors; without CUDA, NCCL's would be CUDA."""
    assert _group_device(None, "gloo") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert _group_device(None, "cpu:gloo,cuda:nccl") == torch.device("cpu")


class _BoundGroup:
    """Stands in for a process group bound to a CUDA device (`init_process_group(device_id=...)`)."""

    def __init__(self, device):
        self.bound_device_id = device


def test_a_group_bound_to_another_device_than_the_current_one_is_refused(monkeypatch):
    """`all_gather_object` stages on the current CUDA device: a group bound elsewhere is an error
    naming both (faked: this host may have no GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(vo.DeviceMismatchError, match=r"bound to cuda:1.*current CUDA device is cuda:0"):
        _group_device(_BoundGroup(torch.device("cuda", 1)), "nccl")
    assert _group_device(_BoundGroup(torch.device("cuda", 0)), "nccl") == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert _group_device(_BoundGroup(torch.device("cuda", 1)), "nccl") == torch.device("cuda", 1)


def _hsdp_bytes(reduce_dtype):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    opt = vo.AdamW(
        model.parameters(), lr=0.01, mesh=mesh, shard_modules=[*model, model], reduce_dtype=reduce_dtype
    )
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).square().mean().backward()
    opt.step()
    return (
        opt.step_stats["bytes_sent"],
        [u.grads.sent_bytes for u in opt.units],
        [p.detach() for p in model.state_dict().values()],
    )


def test_hsdp_reduces_across_replicas_in_reduce_dtype(world):
    full = world(4).run(_hsdp_bytes, torch.float32)
    half = world(4).run(_hsdp_bytes, torch.bfloat16)
    for (_, f, pf), (_, h, ph) in zip(full, half):
        assert [b * 2 for b in h] == f  # every byte of the reduction, across replicas too, in bf16
        assert all(
            math.isfinite(float((a - b).abs().max())) and torch.allclose(a, b, atol=2e-2)
            for a, b in zip(pf, ph)
        )


def test_cpu_parameters_over_an_nccl_group_are_refused_by_name():
    from types import SimpleNamespace

    from vescale_optim.units.runtime import device_problem

    nccl = SimpleNamespace(active=True, device=torch.device("cuda", 0), backend="nccl")
    p = nn.Parameter(torch.zeros(2))
    named = r"parameter 'w' \(shape \(2,\)\) is on cpu, but the process group \(nccl\)"
    assert re.match(named, device_problem([p], nccl, {id(p): "'w' (shape (2,))"}))
    gloo = SimpleNamespace(active=True, device=torch.device("cpu"), backend="gloo")
    assert device_problem([p], gloo, {}) is None  # the runtime raises it on every rank (test_adamw)


def _full_state(to_rank):
    model, opt = _built(meta=False)
    plain = model.state_dict()
    mine = opt.full_model_state_dict(to_rank=to_rank)
    return (
        sorted(plain),
        sorted(mine),
        all(torch.equal(mine[k], plain[k]) for k in mine),
        {v.device.type for v in mine.values()},
    )


def test_the_full_model_state_dict_on_one_rank_or_every_rank(world):
    every = world(2).run(_full_state, None)
    one = world(2).run(_full_state, 1)
    for keys, got, equal, devices in every:
        assert got == keys and equal and devices == {"cpu"}
    (keys, got0, equal0, _), (_, got1, equal1, _) = one
    assert got1 == keys and equal0 and equal1
    assert [k for k in got0 if "weight" in k or "bias" in k] == []  # the sharded parameters went to rank 1
    assert {k for k in got0} == {k for k in keys if k.endswith("count")}  # buffers stay on every rank


class Plain(nn.Module):
    """Modules with no reset_parameters(): initialised only through param_init_fn."""

    def __init__(self, dim: int = 6):
        super().__init__()
        self.w = nn.Parameter(torch.empty(dim, dim))
        self.register_buffer("freq", torch.empty(dim))

    def forward(self, x):
        return x @ self.w * self.freq


class PlainNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Plain() for _ in range(2))
        self.scale = nn.Parameter(torch.empty(6))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x * self.scale


def _init(module):
    """A transformers-style `_init_weights`: one function for every kind of module."""
    with torch.no_grad():
        if isinstance(module, Plain):
            module.w.normal_(std=0.02)
            module.freq.copy_(torch.arange(6.0))
        elif isinstance(module, PlainNet):
            module.scale.fill_(1.0)


def _param_init_fn():
    torch.manual_seed(3)
    normal = PlainNet()
    for m in normal.modules():
        _init(m)
    torch.manual_seed(3)
    with torch.device("meta"):
        model = PlainNet()
    vo.Muon(
        [{"params": [b.w for b in model.blocks]}, {"params": [model.scale], "use_muon": False}],
        shard_modules=[*model.blocks, model],
        device="cpu",
        param_init_fn=_init,
    )
    got, want = (
        {**model.state_dict(), **dict(model.named_buffers())},
        {**normal.state_dict(), **dict(normal.named_buffers())},
    )
    return all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("world_size", [1, 3])
def test_param_init_fn_initialises_a_meta_model_as_built_normally(world, world_size):
    assert world(world_size).run(_param_init_fn) == [True] * world_size


def test_a_tensor_param_init_fn_skips_is_named():
    with torch.device("meta"):
        model = PlainNet()

    def forgets_buffers(module):
        if isinstance(module, Plain):
            module.w.data.zero_()
        if isinstance(module, PlainNet):
            module.scale.data.fill_(1.0)

    with pytest.raises(ValueError, match=r"PlainNet\.blocks\.0\.freq was not initialised by param_init_fn"):
        vo.AdamW(
            model.parameters(),
            shard_modules=[*model.blocks, model],
            device="cpu",
            param_init_fn=forgets_buffers,
        )
