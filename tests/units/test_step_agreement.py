"""Which parameters step, as in torch: only those with a gradient on some rank; frozen,
unused and partly used parameters; zero_grad; parameters changed behind the optimizer's back."""

import re

import pytest
import torch
import torch.distributed as dist
from _reference import mean_grad_reference
from _step_agreement_cases import STEPS, TOL, PartlyUsedNet, freeze_schedule, groups, loss, reference

import vescale_optim as vo
from vescale_optim.units import ReducedGrad


def _train(kind, steps=STEPS):
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = PartlyUsedNet()
    opt = (vo.AdamW if kind == "adamw" else vo.Muon)(groups(model, kind))
    for t in range(steps):
        freeze_schedule(model, t)
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())  # as torch: no stale gradients
        loss(model, t, rank).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()


def _check(kind, world, results):
    want, state = reference(kind, world)
    tol = TOL[kind]
    initial = [p.detach() for p in PartlyUsedNet().parameters()]
    for params, sd in results:
        for got, ref in zip(params, want):
            torch.testing.assert_close(got, ref, **tol)
        assert torch.equal(params[6], initial[6]) and torch.equal(params[7], initial[7])  # unused
        # state only for parameters that stepped, with torch's per-parameter step counts
        assert set(sd["state"]) == set(state)
        for i, st in state.items():
            if "step" in st:
                assert float(sd["state"][i]["step"]) == float(st["step"]), i
            for key, value in st.items():
                if key != "step":
                    torch.testing.assert_close(sd["state"][i][key], value, **tol)


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_only_parameters_with_a_gradient_step_in_one_process(kind):
    _check(kind, 1, [_train(kind)])


@pytest.mark.parametrize("kind", ["adamw", "muon"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_only_parameters_with_a_gradient_on_some_rank_step(world, kind, world_size):
    _check(kind, world_size, world(world_size).run(_train, kind))


def _zero_grad_keeps_zeros():
    """set_to_none=False: the gradients that exist become zero and step as zero gradients."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = PartlyUsedNet()
    opt = vo.AdamW(model.parameters(), lr=0.01)
    loss(model, 0, rank).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    grads = [p.grad for p in model.parameters()]
    if dist.is_initialized():  # over ranks every trainable parameter has its ReducedGrad (the same
        # on every rank, so that its reductions pair up): zeroed, read over the ranks
        assert all(type(g) is ReducedGrad and not g.any() for g in grads)
    else:  # one process, as torch: ordinary tensors, zeroed; None where there never was one
        assert all(g is None for g in grads[-2:])
        assert all(type(g) is torch.Tensor and not g.any() for g in grads[:6] if g is not None)
    assert all(not u.grads.shard.any() for u in opt.units)
    opt.step()  # a zero gradient still steps (weight decay, moment decay), as in torch
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world_size", [1, 2])
def test_zero_grad_without_set_to_none_steps_zero_gradients_as_torch(world, world_size):
    results = world(world_size).run(_zero_grad_keeps_zeros) if world_size > 1 else [_zero_grad_keeps_zeros()]
    model = PartlyUsedNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    mean_grad_reference(model.parameters(), world_size, lambda r: loss(model, 0, r).backward())
    opt.step()
    opt.zero_grad(set_to_none=False)
    opt.step()
    for res in results:
        for got, want in zip(res, model.parameters()):
            torch.testing.assert_close(got, want.detach(), **TOL["adamw"])


# --- parameters changed behind the optimizer's back: refused at step, nothing lost ---------


def _refused(change, ranks=None):
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = PartlyUsedNet()
    model.unused.weight.requires_grad_(False)  # frozen at construction: not in the buffers
    opt = vo.AdamW(model.named_parameters(), lr=0.01)
    loss(model, 0, rank).backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    state = opt.state_dict()
    if ranks is None or rank in ranks:
        change(model, opt)
    opt.zero_grad()
    try:
        loss(model, 1, rank).backward()
        opt.step()
    except RuntimeError as e:
        error = str(e)
    else:
        error = None
    return error, before, state, model, opt


def _double(model, opt):
    model.double()


def _unfreeze(model, opt):
    model.unused.weight.requires_grad_(True)


def _amsgrad(model, opt):
    opt.param_groups[0]["amsgrad"] = True


CHANGES = {
    "double": (_double, r"parameter 'a.weight' \(shape \(8, 6\)\) is now torch.float64 .* moved or cast"),
    "unfreeze": (_unfreeze, r"parameter 'unused.weight' \(shape \(4, 4\)\) was frozen .* now requires grad"),
    "amsgrad": (_amsgrad, r"param group 0: 'amsgrad' changed from False to True after construction"),
}


def _refused_and_recovers(name):
    change, match = CHANGES[name]
    error, before, state, model, opt = _refused(change)
    assert error is not None and re.search(match, error), error
    assert all(torch.equal(a, b.detach().to(a.dtype)) for a, b in zip(before, model.parameters()))
    after = opt.state_dict()
    for i, st in state["state"].items():
        assert all(torch.equal(v, after["state"][i][k]) for k, v in st.items())
    if name == "double":  # moved back: the optimizer takes the parameters up again
        model.float()
        loss(model, 1, opt.rank).backward()
        opt.step()
        assert not torch.equal(before[0], model.a.weight.detach())
    return error


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_changed_parameters_are_refused_at_step_in_one_process(name):
    _refused_and_recovers(name)


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_changed_parameters_are_refused_at_step_on_every_rank(world, name):
    world(2).run(_refused_and_recovers, name, timeout=60)


def _one_rank_moves():
    error, *_ = _refused(_double, ranks={1})
    return error


def test_a_change_on_one_rank_is_refused_on_every_rank_without_hanging(world):
    errors = world(2).run(_one_rank_moves, timeout=60)
    assert "another rank found a problem" in errors[0]
    assert "'a.weight'" in errors[1]
