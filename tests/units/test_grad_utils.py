"""torch's gradient utilities on vo.AdamW / vo.Muon gradients, against torch on the mean gradient.

In one process `.grad` is an ordinary tensor; over ranks (ZeRO-2 buckets, ZeRO-3 units) it is a
`ReducedGrad` whose norms are partial values reduced in one all-reduce, and whose element-wise
ops run on the shards. Each case runs on every rank after a fresh backward, and the same case
runs in one process on the mean gradient (`mean_grad_reference`), with torch.optim.AdamW.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from _reference import mean_grad_reference
from torch import nn

import vescale_optim as vo
from vescale_optim.shard.handle import traced
from vescale_optim.units import ShardedGradError, Unreduced

INF = math.inf
NORMS = (2.0, 1.0, 3.0, INF, 0.0)


class RaggedNet(nn.Module):
    """Two blocks and a head: ragged cuts at W=2 and 3 (4*6+4, 6*5+5, 5*3+3 elements)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(6, 4), nn.Tanh()), nn.Linear(4, 5)])
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(torch.tanh(x))


def _loss(model: nn.Module, t: int, rank: int) -> torch.Tensor:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * t + rank))
    return model(x).square().mean()


def _noise(p: torch.Tensor, k: int) -> torch.Tensor:
    """A full tensor, the same on every rank (gradient noise)."""
    return 1e-3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(k))


def _full(g: torch.Tensor | None) -> torch.Tensor | None:
    if g is None:
        return None
    return g.full_tensor() if hasattr(g, "full_tensor") else g.detach().clone()


def _value(v):
    return v.value() if isinstance(v, Unreduced) else v


# every case takes the parameters (their gradients are the mean gradient) and returns values
def _clip(norm_type, foreach):
    return lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.05, norm_type=norm_type, foreach=foreach)


def _two_phase(ps):
    total = torch.nn.utils.get_total_norm([p.grad for p in ps], 2.0)
    torch.nn.utils.clip_grads_with_norm_(ps, 0.05, total)
    return total


def _value_clip(foreach):
    return lambda ps: torch.nn.utils.clip_grad_value_(ps, 0.01, foreach=foreach)


def _logging(ps):
    g = ps[2].grad
    out = [g.norm(), g.norm(1), torch.linalg.vector_norm(g, INF), g.abs().max(), g.sum(), g.mean(), g.min()]
    out += [torch.isfinite(g).all(), g.isnan().any(), (g > 0).sum()]
    return [_value(v) for v in out]


def _inplace(ps):
    a, b, c = ps[0].grad, ps[2].grad, ps[4].grad
    a.mul_(0.5).div_(2.0).clamp_(-0.02, 0.02)
    b.add_(1e-3).add_(b.sign(), alpha=1e-4)  # a scalar, then a tensor of the same layout
    b.add_(_noise(ps[2], 1))  # a full tensor, the same on every rank
    c.zero_()
    ps[1].grad.mul_(torch.tensor(3.0))
    ps[3].grad *= 2
    torch._foreach_mul_([p.grad for p in ps[5:]], 0.25)
    return []


def _nonfinite(ps):
    g = ps[2].grad
    g.div_(0.0)  # 0/0 = nan, x/0 = +-inf
    g.nan_to_num_(0.0, 1.0, -1.0)
    ps[4].grad.add_(INF)
    try:
        torch.nn.utils.clip_grad_norm_(ps, 1.0, error_if_nonfinite=True)
    except RuntimeError as e:
        return [torch.tensor("non-finite" in str(e))]
    return [torch.tensor(False)]


CASES = {
    **{f"clip-{n}-{f}": _clip(n, f) for n in NORMS for f in (None, True)},
    "two-phase": _two_phase,
    "value-None": _value_clip(None),
    "value-True": _value_clip(True),
    "logging": _logging,
    "inplace": _inplace,
    "nonfinite": _nonfinite,
}


def _make(mode: str, model: nn.Module):
    if mode == "zero3":
        return vo.AdamW(model.parameters(), lr=0.01, shard_modules=[*model.blocks, model])
    if mode == "hsdp":  # 2 replicas x 2 shards: the gradients are all-reduced across replicas too
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        return vo.AdamW(model.parameters(), lr=0.01, mesh=mesh, shard_modules=[*model.blocks, model])
    if mode == "muon":  # matrices gathered to owners at the step; the gradients are the same ragged shards
        groups = vo.muon_param_groups(model, exclude=["head"])
        return vo.Muon(groups, lr=0.02, shard_modules=[*model.blocks, model])
    return vo.AdamW(model.parameters(), lr=0.01, bucket_cap_numel=40)  # several buckets


def _ours(mode: str, names: list[str]) -> dict:
    """Every case on this rank after a fresh backward (the first one at iteration 0)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = RaggedNet()
    opt = _make(mode, model)
    out = {}
    for t, name in enumerate(names):
        opt.zero_grad()
        _loss(model, t, rank).backward()
        ps = list(model.parameters())
        returned = CASES[name](ps)
        returned = [] if returned is None else returned if isinstance(returned, list) else [returned]
        out[name] = ([torch.as_tensor(r).detach().clone() for r in returned], [_full(p.grad) for p in ps])
    return out


def _reference(world: int, names: list[str]) -> dict:
    model = RaggedNet()
    out = {}
    for t, name in enumerate(names):
        mean_grad_reference(model.parameters(), world, lambda r, t=t: _loss(model, t, r).backward())
        ps = list(model.parameters())
        returned = CASES[name](ps)
        returned = [] if returned is None else returned if isinstance(returned, list) else [returned]
        out[name] = ([torch.as_tensor(r).detach().clone() for r in returned], [_full(p.grad) for p in ps])
    return out


def _compare(got: dict, want: dict) -> None:
    for name, (values, grads) in want.items():
        g_values, g_grads = got[name]
        assert len(values) == len(g_values), name
        for a, b in zip(g_values, values):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
        for a, b in zip(g_grads, grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


NAMES = list(CASES)


@pytest.mark.parametrize("mode", ["zero2", "zero3"])
def test_gradient_utilities_in_one_process_are_torch_on_plain_tensors(mode):
    got = _ours(mode, NAMES)
    model = RaggedNet()
    opt = _make(mode, model)
    _loss(model, 0, 0).backward()
    assert all(type(p.grad) is torch.Tensor for p in model.parameters())  # iteration 0
    opt.step()
    opt.zero_grad()
    _loss(model, 1, 0).backward()
    assert all(type(p.grad) is torch.Tensor for p in model.parameters())  # every later one
    _compare(got, _reference(1, NAMES))


@pytest.mark.parametrize("mode", ["zero2", "zero3"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_gradient_utilities_over_ranks_equal_torch_on_the_mean_gradient(world, mode, world_size):
    results = world(world_size).run(_ours, mode, NAMES, timeout=300)
    want = _reference(world_size, NAMES)
    for got in results:
        _compare(got, want)


@pytest.mark.parametrize("mode,world_size", [("hsdp", 4), ("muon", 3)])
def test_gradient_utilities_under_hsdp_and_muon_equal_torch_on_the_mean_gradient(world, mode, world_size):
    names = ["clip-2.0-None", "clip-inf-True", "two-phase", "value-None", "logging", "inplace", "nonfinite"]
    results = world(world_size).run(_ours, mode, names, timeout=300)
    want = _reference(world_size, names)
    for got in results:
        _compare(got, want)


# --- collectives, iteration 0, errors ------------------------------------------------------------


def _collectives(mode: str) -> dict:
    rank = dist.get_rank()
    model = RaggedNet()
    opt = _make(mode, model)
    out = {}
    for t in range(2):
        opt.zero_grad()
        _loss(model, t, rank).backward()
        ps = list(model.parameters())
        assert all(type(p.grad).__name__ == "ReducedGrad" for p in ps), t  # iteration 0 too
        for foreach in (None, True):
            with traced() as trace:
                torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=foreach)
            out[(t, foreach)] = list(trace)
        with traced() as trace:
            torch.nn.utils.clip_grad_norm_(ps, 1.0, norm_type=INF)
            torch.nn.utils.clip_grad_value_(ps, 1.0)
            for p in ps:
                p.grad.mul_(0.5)
        out[(t, "inf")] = list(trace)
        opt.step()
    g = ps[0].grad
    errors = []
    for op in (
        lambda: g[0],
        lambda: g.view(-1),
        lambda: g.T,
        lambda: g @ g.new_ones(6).mul_(2),
        lambda: g.sum(dim=0),
    ):
        try:
            op()
        except ShardedGradError as e:
            errors.append(str(e).split(" on a gradient")[0])
    out["errors"] = errors
    return out


@pytest.mark.parametrize("mode", ["zero2", "zero3"])
def test_clip_grad_norm_is_one_small_all_reduce_for_all_parameters(world, mode):
    for got in world(2).run(_collectives, mode):
        for key in [(t, f) for t in range(2) for f in (None, True, "inf")]:
            kind = "max" if key[1] == "inf" else "sum"  # clip_grad_value_ and mul_ issue none
            assert got[key] == [f"all-reduce ({kind}): a reduction of sharded gradients"], (key, got[key])
        assert got["errors"] == ["__getitem__()", "view()", "T()", "matmul()", "sum()"]


# --- training: the loop of issue 35, and clipping over ranks --------------------------------------


def _train(kind: str, steps: int = 4) -> list[torch.Tensor]:
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = RaggedNet()
    if kind == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        opt = vo.AdamW(
            model.parameters(),
            lr=1e-2,
            **({"shard_modules": [*model.blocks, model]} if kind == "zero3" else {}),
        )
    for t in range(steps):
        opt.zero_grad(set_to_none=True)
        _loss(model, t, rank).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
    return [v.detach().clone() for v in model.state_dict().values()]  # ZeRO-3 parameters are freed now


def test_issue_loop_with_clipping_equals_torch_adamw_in_one_process():
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    ref.load_state_dict(m.state_dict())
    opt, ref_opt = vo.AdamW(m.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for model, o in ((m, opt), (ref, ref_opt)):
            o.zero_grad(set_to_none=True)
            model(x).sum().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            o.step()
    for a, b in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("world_size", [2, 3])
def test_training_with_torch_clipping_over_ranks_equals_torch_adamw(world, world_size):
    model = RaggedNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for t in range(4):
        mean_grad_reference(model.parameters(), world_size, lambda r, t=t: _loss(model, t, r).backward())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
    for kind in ("zero2", "zero3"):
        for got in world(world_size).run(_train, kind):
            for a, b in zip(got, model.parameters()):
                torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
