"""Sharded AdamW equals torch.optim.AdamW fed the mean gradient, at any world size."""

import math

import pytest
import torch
import torch.distributed as dist
from _adamw_cases import (
    SHAPES,
    SKIP,
    STEPS,
    TOL,
    full_precision,
    groups,
    make_params,
    reference,
    schedule,
    set_grads,
)
from _reference import mean_grad_reference

import vescale_optim as vo
from vescale_optim.optim.adamw import adamw_update_


def _train(steps=STEPS, clip=None, dtype=torch.float32, state=False, norm_type=2.0, state_bits=32):
    rank = dist.get_rank() if dist.is_initialized() else 0
    params = make_params(dtype)
    opt = vo.AdamW(groups(params, amsgrad=state_bits == 32), state_bits=state_bits)
    sched = schedule(opt)
    norms = []
    for t in range(steps):
        opt.zero_grad()
        set_grads(params, t, rank, dtype, SKIP.get(t, ()))
        if clip is not None:
            norms.append(opt.clip_grad_norm_(clip, norm_type).item())
        opt.step()
        sched.step()
    full = full_precision(dtype)
    out = {"params": [p.detach().to(full).clone() for p in params], "norms": norms}
    if state:
        out["state"] = opt.state_dict()
    return out


@pytest.mark.parametrize("state_bits", [32, 16])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_equals_torch_adamw(world, world_size, state_bits):
    results = world(world_size).run(_train, state=True, state_bits=state_bits)
    ref, ropt, _ = reference(world_size, amsgrad=state_bits == 32)
    # fp32: twice the reduction order's noise floor (tests/test_references.py measures it);
    # 16-bit moments (of the last, large parameter) are rounded to bf16 at every step
    tol = TOL if state_bits == 32 else dict(rtol=1e-3, atol=2e-5)
    for res in results:
        for got, want in zip(res["params"], ref):
            torch.testing.assert_close(got, want.detach(), **tol)
    ours = results[0]["state"]
    theirs = ropt.state_dict()
    for i in range(len(SHAPES)):
        for key in ("exp_avg", "exp_avg_sq"):
            # bf16 moments: a few bf16 roundings of O(1) values
            close = dict(rtol=1e-5, atol=1e-7) if state_bits == 32 else dict(rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(ours["state"][i][key], theirs["state"][i][key], **close)
        # per-parameter step counts, as torch keeps them (SKIP leaves params 1 and 4 a step behind)
        assert float(ours["state"][i]["step"]) == float(theirs["state"][i]["step"])
    assert [float(ours["state"][i]["step"]) for i in range(len(SHAPES))] == [4, 3, 4, 4, 3, 4, 4]
    if state_bits == 32:
        assert "max_exp_avg_sq" in ours["state"][4] and "max_exp_avg_sq" not in ours["state"][0]


@pytest.mark.parametrize("world_size", [1, 2])
def test_float64_parameters_equal_torch(world, world_size):
    dtype = torch.float64
    results = world(world_size).run(_train, dtype=dtype) if world_size > 1 else [_train(dtype=dtype)]
    ref, _, _ = reference(world_size, dtype=dtype)
    for res in results:
        for got, want in zip(res["params"], ref):
            assert got.dtype == torch.float64
            torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("world_size, norm_type", [(1, 2.0), (3, 2.0), (3, math.inf), (3, 1.0)])
def test_clipping_equals_torch(world, world_size, norm_type):
    # two param groups, so two buckets: the norm is reduced within a rank and across ranks
    results = world(world_size).run(_train, clip=0.5, norm_type=norm_type)
    ref, _, norms = reference(world_size, clip=0.5, norm_type=norm_type)
    for res in results:
        assert res["norms"] == pytest.approx(norms, rel=1e-5)
        for got, want in zip(res["params"], ref):
            torch.testing.assert_close(got, want.detach(), **TOL)


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

    def rank_backward(r):  # both halves accumulated, as each rank does
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(r))
        model(x[:4]).square().sum().backward()
        model(x[4:]).square().sum().backward()

    mean_grad_reference(model.parameters(), 2, rank_backward)
    opt.step()
    for res in results:
        for got, want in zip(res, model.parameters()):
            torch.testing.assert_close(got, want.detach(), **TOL)


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
    with pytest.warns(UserWarning, match="non-finite") as record:
        opt.step()
    assert record[0].filename == __file__  # the warning points at the caller's line
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
    # ranks that disagree about skipping end in mismatched collectives: fail fast, not after
    # the 120 s collective timeout
    assert world(3).run(_nonfinite, timeout=30) == [1, 1, 1]


def _mismatch():
    rank = dist.get_rank()
    params = make_params()
    if rank == 1:
        params[4] = torch.nn.Parameter(torch.zeros(3, 17))
    vo.AdamW(params)


def test_mismatched_params_across_ranks_error_instead_of_hanging(world):
    with pytest.raises(Exception, match=r"rank 1 passed different parameters.*\(3, 17\)"):
        world(3).run(_mismatch, timeout=60)


def _tensor_lr_mismatch():
    lr = torch.tensor(1e-3 + (1e-7 if dist.get_rank() == 1 else 0.0), dtype=torch.float64)
    vo.AdamW(make_params(), lr=lr)


def test_a_tensor_lr_that_differs_across_ranks_is_refused(world):
    """Tensors are compared by value, not by their printed digits (both print as 0.0010) nor
    their device (cuda:0 on one rank is cuda:1 on the next)."""
    f64 = torch.float64
    assert repr(torch.tensor(1e-3, dtype=f64)) == repr(torch.tensor(1e-3 + 1e-7, dtype=f64))
    with pytest.raises(Exception, match=r"rank 1 passed different parameters.*lr"):
        world(2).run(_tensor_lr_mismatch, timeout=60)


def _one_rank_refuses():
    params = make_params()
    if dist.get_rank() == 1:
        params.append(params[0])
    try:
        vo.AdamW(params, shard_modules=None)
    except ValueError as e:
        return str(e)
    return None


def test_a_problem_one_rank_finds_is_raised_on_every_rank(world):
    """Before any collective whose sizes depend on the parameters: nobody is left waiting."""
    got = world(3).run(_one_rank_refuses, timeout=60)
    assert "appears more than once" in got[1] and not got[1].startswith("rank ")
    assert got[0] == got[2] == f"rank 1: {got[1]}"


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


@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adamw_update_equals_torch_step_by_step(maximize, amsgrad):
    """The pure update behind 16-bit state, with weight decay and a large learning rate so
    that the order of decay and update shows."""
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(300, generator=gen)
    ref = torch.nn.Parameter(p.clone())
    hyper = dict(lr=0.1, eps=1e-6, weight_decay=0.5, maximize=maximize)
    opt = torch.optim.AdamW([ref], betas=(0.8, 0.9), amsgrad=amsgrad, foreach=False, **hyper)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    vmax = torch.zeros_like(p) if amsgrad else None
    for step in range(1, 5):
        grad = torch.randn(300, generator=gen)
        ref.grad = grad.clone()
        opt.step()
        adamw_update_(p, grad, m, v, vmax, step=step, beta1=0.8, beta2=0.9, **hyper)
        torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(m, opt.state[ref]["exp_avg"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(v, opt.state[ref]["exp_avg_sq"], rtol=1e-6, atol=1e-7)
