"""Sharded AdamW equals torch.optim.AdamW fed the mean gradient, at any world size."""

import math

import pytest
import torch
import torch.distributed as dist
from _adamw_cases import SHAPES, groups, make_params, mean_grads, schedule, set_grads

import vescale_optim as vo

STEPS = 4
SKIP = {2: (1,), 3: (4,)}  # step -> params that get no gradient that step


def reference(world, steps=STEPS, clip=None, dtype=torch.float32):
    params = [torch.nn.Parameter(p.detach().float()) for p in make_params(dtype)]
    opt = torch.optim.AdamW(groups(params))
    sched = schedule(opt)
    norms = []
    for t in range(steps):
        for p, g in zip(params, mean_grads(t, world, dtype, SKIP.get(t, ()))):
            p.grad = None if g is None else g.clone()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(params, clip).item())
        opt.step()
        sched.step()
    return params, opt, norms


def _train(steps=STEPS, clip=None, dtype=torch.float32, state=False):
    rank = dist.get_rank()
    params = make_params(dtype)
    opt = vo.AdamW(groups(params))
    sched = schedule(opt)
    norms = []
    for t in range(steps):
        opt.zero_grad()
        set_grads(params, t, rank, dtype, SKIP.get(t, ()))
        if clip is not None:
            norms.append(opt.clip_grad_norm_(clip).item())
        opt.step()
        sched.step()
    out = {"params": [p.detach().float().clone() for p in params], "norms": norms}
    if state:
        out["state"] = opt.state_dict()
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_equals_torch_adamw(world, world_size):
    results = world(world_size).run(_train, state=True)
    ref, ropt, _ = reference(world_size)
    for res in results:
        for got, want in zip(res["params"], ref):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    ours = results[0]["state"]
    theirs = ropt.state_dict()
    for i in range(len(SHAPES)):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours["state"][i][key], theirs["state"][i][key], rtol=1e-5, atol=1e-7)
        # per-parameter step counts, as torch keeps them (SKIP leaves params 1 and 4 a step behind)
        assert float(ours["state"][i]["step"]) == float(theirs["state"][i]["step"])
    assert [float(ours["state"][i]["step"]) for i in range(len(SHAPES))] == [4, 3, 4, 4, 3, 4]
    assert "max_exp_avg_sq" in ours["state"][4] and "max_exp_avg_sq" not in ours["state"][0]


@pytest.mark.parametrize("world_size", [1, 3])
def test_clipping_equals_torch(world, world_size):
    results = world(world_size).run(_train, clip=0.5)
    ref, _, norms = reference(world_size, clip=0.5)
    for res in results:
        assert res["norms"] == pytest.approx(norms, rel=1e-5)
        for got, want in zip(res["params"], ref):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world_size", [2, 4])
def test_bf16_parameters_track_torch_with_fp32_master(world, world_size):
    results = world(world_size).run(_train, dtype=torch.bfloat16)
    ref, _, _ = reference(world_size, dtype=torch.bfloat16)
    for res in results:
        for got, want in zip(res["params"], ref):
            # one bf16 rounding of the master, plus the bf16 mean of the gradients
            torch.testing.assert_close(got, want.detach().bfloat16().float(), rtol=2e-2, atol=2e-3)


def test_single_process_without_process_group():
    params = make_params()
    opt = vo.AdamW(groups(params))
    sched = schedule(opt)
    for t in range(STEPS):
        opt.zero_grad()
        set_grads(params, t, 0, skip=SKIP.get(t, ()))
        opt.step()
        sched.step()
    ref, _, _ = reference(1)
    for got, want in zip(params, ref):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-6, atol=1e-7)
    assert opt.world_size == 1


def _accumulate():
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4))
    model[2].bias.requires_grad_(False)
    frozen = model[2].bias.detach().clone()
    opt = vo.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(rank))
    model(x[:4]).square().sum().backward()
    model.zero_grad(set_to_none=True)  # torch's zero_grad drops the views; the optimizer restores them
    model(x[:4]).square().sum().backward()
    model(x[4:]).square().sum().backward()
    opt.step()
    assert torch.equal(model[2].bias.detach(), frozen)
    return [p.detach().clone() for p in model.parameters()]


def test_gradient_accumulation_and_frozen_params(world):
    results = world(2).run(_accumulate)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4))
    model[2].bias.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for r in range(2):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(r))
        (model(x).square().sum() / 2).backward()
    opt.step()
    for res in results:
        for got, want in zip(res, model.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def _nonfinite():
    rank = dist.get_rank()
    params = make_params()
    opt = vo.AdamW(groups(params), skip_nonfinite=True)
    set_grads(params, 0, rank)
    opt.step()
    before = [p.detach().clone() for p in params]
    state = opt.state_dict()
    opt.zero_grad()
    set_grads(params, 1, rank)
    if rank == world_rank_with_inf():
        params[2].grad[1, 2, 3] = float("inf")
    with pytest.warns(UserWarning, match="non-finite"):
        opt.step()
    after = opt.state_dict()
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, params))
    for i in state["state"]:
        for k, v in state["state"][i].items():
            assert torch.equal(v, after["state"][i][k])
    with pytest.raises(RuntimeError, match="non-finite"):
        opt.clip_grad_norm_(1.0, error_if_nonfinite=True)
    return opt.skipped_steps


def world_rank_with_inf():
    return dist.get_world_size() - 1


def test_skip_nonfinite_changes_nothing_on_any_rank(world):
    assert world(3).run(_nonfinite) == [1, 1, 1]


def _mismatch():
    rank = dist.get_rank()
    params = make_params()
    if rank == 1:
        params[4] = torch.nn.Parameter(torch.zeros(3, 17))
    vo.AdamW(params)


def test_mismatched_params_across_ranks_error_instead_of_hanging(world):
    with pytest.raises(Exception, match=r"rank 1 passed different parameters.*\(3, 17\)"):
        world(3).run(_mismatch, timeout=60)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda p: vo.AdamW([p[0], p[1], p[0]]), "appears more than once"),
        (lambda p: vo.AdamW([torch.zeros(3, dtype=torch.long)]), "need floating"),
        (lambda p: vo.AdamW([torch.zeros(3).to_sparse()]), "sparse"),
        (lambda p: vo.AdamW(p, lr=-1.0), "learning rate"),
        (lambda p: vo.AdamW(p, betas=(0.9, 1.0)), "beta"),
    ],
)
def test_bad_input(make, match):
    with pytest.raises(ValueError, match=match):
        make(make_params())


def test_add_param_group_after_construction_is_refused():
    params = make_params()
    opt = vo.AdamW(params[:2])
    with pytest.raises(NotImplementedError, match="at construction"):
        opt.add_param_group({"params": params[2:]})


def test_state_is_sharded():
    params = make_params()
    opt = vo.AdamW(params)
    total = sum(math.prod(s) for s in SHAPES)
    assert opt.local_state_numel() >= 2 * total
