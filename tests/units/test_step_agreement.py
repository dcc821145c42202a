"""Which parameters step, as in torch: only those with a gradient on some rank; frozen,
unused and partly used parameters; zero_grad; parameters changed behind the optimizer's back."""

import re

import pytest
import torch
import torch.distributed as dist
from _reference import mean_grad_reference

import vescale_optim as vo
from vescale_optim.units import ReducedGrad

STEPS = 6
# Each covers twice the noise floor of summing the ranks' gradients in another order (gloo's
# ring does on W >= 3), measured by tests/test_references.py; Muon's is one flipped bf16
# rounding of a Newton-Schulz output (2**-8 of an update of size ~lr * 0.2 * sqrt(n)).
TOL = {"adamw": dict(rtol=1e-5, atol=1e-6), "muon": dict(rtol=0, atol=2e-4)}
LR = dict(muon=0.02, adam=0.01)


class Net(torch.nn.Module):
    """`side` is used only by rank 0 on even steps; `unused` never."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 4)
        self.side, self.unused = torch.nn.Linear(8, 4), torch.nn.Linear(4, 4)

    def forward(self, x, side: bool):
        h = torch.tanh(self.a(x))
        return self.b(h) + self.side(h) if side else self.b(h)


def _loss(model, t, rank):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * t + rank)).to(model.a.weight.dtype)
    return model(x, side=rank == 0 and t % 2 == 0).square().mean()


def _freeze_schedule(model, t):
    if t == 2:
        model.b.weight.requires_grad_(False)  # frozen after construction: takes no step
    if t == 4:
        model.b.weight.requires_grad_(True)


def _groups(model, kind):
    if kind == "adamw":
        return [{"params": list(model.parameters()), "lr": LR["adam"], "weight_decay": 0.1}]
    mats = [p for p in model.parameters() if p.ndim == 2]
    vecs = [p for p in model.parameters() if p.ndim == 1]
    return [
        {"params": mats, "lr": LR["muon"], "weight_decay": 0.1},
        {"params": vecs, "lr": LR["adam"], "weight_decay": 0.1, "use_muon": False},
    ]


def _train(kind, steps=STEPS):
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = Net()
    opt = (vo.AdamW if kind == "adamw" else vo.Muon)(_groups(model, kind))
    for t in range(steps):
        _freeze_schedule(model, t)
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())  # as torch: no stale gradients
        _loss(model, t, rank).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()


def _reference(kind, world, steps=STEPS, reversed_order=False):
    model = Net()
    groups = _groups(model, kind)
    if kind == "adamw":
        opts = [torch.optim.AdamW(groups)]
    else:
        opts = [
            torch.optim.Muon(groups[0]["params"], lr=LR["muon"], weight_decay=0.1),
            torch.optim.AdamW(groups[1]["params"], lr=LR["adam"], betas=(0.9, 0.95), weight_decay=0.1),
        ]
    for t in range(steps):
        _freeze_schedule(model, t)
        backward = lambda r, t=t: _loss(model, t, r).backward()
        mean_grad_reference(model.parameters(), world, backward, reversed_order)
        for o in opts:
            o.step()
    position = {id(p): i for i, p in enumerate(p for g in groups for p in g["params"])}
    state = {position[id(p)]: s for o in opts for p, s in o.state.items()}
    return [p.detach() for p in model.parameters()], state


def _check(kind, world, results):
    want, state = _reference(kind, world)
    tol = TOL[kind]
    initial = [p.detach() for p in Net().parameters()]
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
    model = Net()
    opt = vo.AdamW(model.parameters(), lr=0.01)
    _loss(model, 0, rank).backward()
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
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    mean_grad_reference(model.parameters(), world_size, lambda r: _loss(model, 0, r).backward())
    opt.step()
    opt.zero_grad(set_to_none=False)
    opt.step()
    for res in results:
        for got, want in zip(res, model.parameters()):
            torch.testing.assert_close(got, want.detach(), **TOL["adamw"])


# --- parameters changed behind the optimizer's back: refused at step, nothing lost ---------


def _refused(change, ranks=None):
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = Net()
    model.unused.weight.requires_grad_(False)  # frozen at construction: not in the buffers
    opt = vo.AdamW(model.named_parameters(), lr=0.01)
    _loss(model, 0, rank).backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    state = opt.state_dict()
    if ranks is None or rank in ranks:
        change(model, opt)
    opt.zero_grad()
    try:
        _loss(model, 1, rank).backward()
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
        _loss(model, 1, opt.rank).backward()
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
