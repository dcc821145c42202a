"""Distributed Muon equals torch.optim.Muon (and AdamW for its aux group) at any world size."""

import math
import re
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _muon_cases import STEPS, grad, hyper, make_params, mean_grad, n_matrices, reference
from _reference import mean_of

import vescale_optim as vo
from vescale_optim.optim._muon_math import ns_flops
from vescale_optim.owners.balance import assign_owners, imbalance


def _train(adjust, nesterov, steps=STEPS, cap=64 * 1024 * 1024, state=False):
    rank = dist.get_rank()
    muon, adam = make_params()
    opt = vo.Muon(
        [{"params": muon}, {"params": adam, "use_muon": False, "lr": 0.01, "weight_decay": 0.05}],
        bucket_cap_numel=cap,
        **hyper(adjust, nesterov),
    )
    counts = []
    for t in range(steps):
        opt.zero_grad()
        for i, p in enumerate(muon + adam):
            p.grad = grad(p.shape, t, rank, i)
        opt.step()
        counts.append(opt.orthogonalized)
    out = {"params": [p.detach().clone() for p in muon + adam], "counts": counts}
    if state:
        out["state"] = opt.state_dict()
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("adjust, nesterov", [(None, True), ("match_rms_adamw", False)])
def test_equals_torch_muon(world, world_size, adjust, nesterov):
    results = world(world_size).run(_train, adjust, nesterov)
    want, _ = reference(world_size, adjust, nesterov)
    for res in results:
        for got, ref in zip(res["params"], want):
            # Newton-Schulz runs in bf16; batching equal shapes may round differently.
            torch.testing.assert_close(got, ref, rtol=0, atol=2e-4)
    # every matrix is orthogonalized exactly once per step, across all ranks
    assert [sum(r["counts"][t] for r in results) for t in range(STEPS)] == [n_matrices()] * STEPS


def test_owned_and_gathered_layouts_agree(world):
    # a tiny bucket cap puts each parameter in its own bucket, so matrices straddle ranks
    gathered = world(3).run(_train, None, True, cap=1)[0]["params"]
    owned = world(3).run(_train, None, True)[0]["params"]
    want, _ = reference(3, None, True)
    for a, b, c in zip(gathered, owned, want):
        torch.testing.assert_close(a, c, rtol=0, atol=2e-4)
        torch.testing.assert_close(b, c, rtol=0, atol=2e-4)


def test_load_balance_and_no_gather_when_owned():
    costs = [ns_flops(m, n) for m, n in [(64, 64)] * 12 + [(64, 256)] * 4]
    assert imbalance(costs, assign_owners(costs, 4), 4) <= 1.1
    homes = [i % 4 for i in range(8)]
    assert assign_owners([1.0] * 8, 4, homes) == homes  # balanced homes: nothing moves
    assert imbalance([1.0] * 8, assign_owners([1.0] * 8, 4, [0] * 8), 4) == 1.0
    # one big matrix among many small ones still lands on the least-loaded rank
    assert imbalance([1.0] * 16 + [4.0], assign_owners([1.0] * 16 + [4.0], 4), 4) == 1.0


def test_state_dict_cross_loads_with_torch_muon():
    g = torch.Generator().manual_seed(3)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(6, 4), (3, 5)]]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ours, theirs = vo.Muon(ps, lr=0.05), torch.optim.Muon(twins, lr=0.05)
    for t in range(4):
        for p, q in zip(ps, twins):
            gr = torch.randn(p.shape, generator=g)
            p.grad, q.grad = gr.clone(), gr.clone()
        (ours if t < 2 else theirs).step()
        if t == 1:
            theirs.load_state_dict(ours.state_dict())
            for p, q in zip(ps, twins):
                q.data.copy_(p.detach())
    ours.load_state_dict(theirs.state_dict())
    for i, st in theirs.state_dict()["state"].items():
        torch.testing.assert_close(ours.state_dict()["state"][i]["momentum_buffer"], st["momentum_buffer"])


def _dcp(path, mode, values=None):
    """Every rank uses the same gradients, so runs at different world sizes are comparable."""
    muon, adam = make_params()
    if values is not None:
        with torch.no_grad():
            for p, v in zip(muon + adam, values):
                p.copy_(v)
    opt = vo.Muon([{"params": muon}, {"params": adam, "use_muon": False}], lr=0.02)
    names = torch.nn.ParameterList(muon + adam)  # the names its state is keyed by
    steps = range(2) if mode == "save" else range(2, 4)
    if mode == "load":
        sd = opt.sharded_state_dict(names)
        dcp.load(sd, checkpoint_id=path)
        opt.load_sharded_state_dict(sd, names)
    for t in steps if mode != "straight" else range(4):
        opt.zero_grad()
        for i, p in enumerate(muon + adam):
            p.grad = mean_grad(p.shape, t, 4, i)
        opt.step()
    if mode == "save":
        dcp.save(opt.sharded_state_dict(names), checkpoint_id=path)
    return [p.detach().clone() for p in muon + adam]


def test_dcp_save_at_4_load_at_3_continues_exactly(world, tmp_path):
    path = str(tmp_path / "muon")
    values = world(4).run(_dcp, path, "save")[0]
    resumed = world(3).run(_dcp, path, "load", values)[0]
    straight = world(4).run(_dcp, path, "straight")[0]
    for a, b in zip(resumed, straight):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-4)


def _muon(defaults, muon_group=None, adam_group=None):
    g = torch.Generator().manual_seed(0)
    matrix, vector = (torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(3, 4), (4,)])
    muon = {"params": [matrix], **(muon_group or {})}
    return vo.Muon([muon, {"params": [vector], "use_muon": False, **(adam_group or {})}], **defaults)


# (constructor arguments, Muon group, AdamW group, message)
BAD = [
    ({}, {"params": [torch.nn.Parameter(torch.zeros(5))]}, {}, r"shape \(5,\); put it in a group"),
    (dict(adjust_lr_fn="sqrt"), {}, {}, "Adjust learning rate function sqrt is not supported"),
    (dict(ns_steps=0), {}, {}, "ns_steps must be an integer >= 1"),
    (dict(lr=-1.0), {}, {}, "Learning rate"),
    (dict(lr=torch.tensor([0.1, 0.1])), {}, {}, "Tensor lr must be 1-element"),
    (dict(momentum=1.5), {}, {}, "momentum should be >= 0 and < 1"),
    (dict(momentum=-0.1), {}, {}, "momentum should be >= 0"),
    (dict(weight_decay=-1.0), {}, {}, "weight decay"),
    (dict(eps=-1.0), {}, {}, "epsilon"),
    (dict(ns_coefficients=(3.4, -4.7)), {}, {}, "Coefficients must be a tuple of exactly 3 values"),
    (dict(betas=(0.9, 1.0)), {}, {}, "beta parameter at index 1"),
    (dict(betas=(-0.1, 0.9)), {}, {}, "beta parameter at index 0"),
    ({}, dict(momentum=1.5), {}, "momentum should be"),
    ({}, dict(ns_steps=2.5), {}, "ns_steps"),
    ({}, {}, dict(betas=(1.0, 0.9)), "beta parameter at index 0"),
    ({}, {}, dict(eps=-1e-8), "epsilon"),
    ({}, {}, dict(lr=float("nan")), "learning rate"),
    ({}, dict(use_muon="yes"), {}, "use_muon must be True or False"),
]


@pytest.mark.parametrize("defaults, muon_group, adam_group, match", BAD)
def test_bad_input(defaults, muon_group, adam_group, match):
    with pytest.raises(ValueError, match=match):
        _muon(defaults, muon_group, adam_group)


def _refusals(bad):
    out = []
    for defaults, muon_group, adam_group, _ in bad:
        try:
            _muon(defaults, muon_group, adam_group)
            out.append(None)
        except Exception as e:  # noqa: BLE001 - the test checks type and message
            out.append((type(e).__name__, str(e)))
    return out


def test_bad_input_on_two_ranks(world):
    for refused in world(2).run(_refusals, BAD):
        for (*_, match), got in zip(BAD, refused):
            assert got is not None and got[0] == "ValueError" and re.search(match, got[1]), (match, got)


def test_bare_tensor_is_not_a_parameter_list():
    with pytest.raises(TypeError, match="should be an iterable of Tensors or dicts"):
        vo.Muon(torch.zeros(3, 4))


def test_one_dim_param_named_in_error():
    model = torch.nn.Linear(3, 4)
    with pytest.raises(ValueError, match="'bias'"):
        vo.Muon(model.named_parameters())


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.block = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.lm_head = torch.nn.Linear(4, 10, bias=False)


def _split(model, **kwargs):
    """(Muon group, AdamW group, warnings) of muon_param_groups."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        muon, adam = vo.muon_param_groups(model, **kwargs)
    return muon, adam, [str(w.message) for w in caught]


def test_muon_param_groups_split_a_model():
    model = Tiny()
    muon, adam, warned = _split(model, exclude=[model.lm_head])
    assert [p.shape for p in muon["params"]] == [torch.Size([4, 4])]
    assert len(adam["params"]) == 5 and adam["use_muon"] is False and not warned
    experts = torch.nn.Module()
    experts.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 8, 16))
    experts.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(4, 16))  # stacked biases: AdamW
    muon_e, adam_e, _ = _split(experts)
    assert [p.shape for p in muon_e["params"]] == [torch.Size([4, 8, 16])]
    assert [p.shape for p in adam_e["params"]] == [torch.Size([4, 16])]
    model.lm_head.weight = model.embed.weight  # tied head: AdamW with the embedding, no warning
    muon, adam, warned = _split(model)
    assert len(muon["params"]) == 1 and len(adam["params"]) == 4 and not warned
    assert math.isclose(vo.Muon([muon, adam]).param_groups[1]["eps"], 1e-8)


def test_muon_param_groups_inherit_the_optimizers_hyperparameters():
    model = Tiny()
    groups = vo.muon_param_groups(model, exclude=["lm_head"])
    opt = vo.Muon(groups, lr=0.05, weight_decay=0.0, betas=(0.8, 0.9))
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(0.05, 0.0), (0.05, 0.0)]
    assert opt.param_groups[1]["betas"] == (0.8, 0.9) and "betas" not in opt.param_groups[0]
    # asked for: a separate AdamW lr, betas and weight decay, a Muon momentum
    groups = vo.muon_param_groups(
        model,
        exclude=["lm_head"],
        momentum=0.9,
        adamw_lr=3e-4,
        adamw_betas=(0.9, 0.99),
        adamw_weight_decay=0.01,
    )
    opt = vo.Muon(groups, lr=0.05)
    muon, adam = opt.param_groups
    assert (muon["lr"], muon["weight_decay"], muon["momentum"]) == (0.05, 0.1, 0.9)
    assert (adam["lr"], adam["betas"], adam["weight_decay"], adam["eps"]) == (3e-4, (0.9, 0.99), 0.01, 1e-8)


def test_muon_param_groups_exclude_by_module_parameter_or_name():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    head = model[2]
    for exclude in ([head], [head.weight], ["2"], ["2.weight"], head):
        muon, adam, warned = _split(model, exclude=exclude)
        assert [p.shape for p in muon["params"]] == [torch.Size([16, 8])] and not warned, exclude
        assert any(p is head.weight for p in adam["params"])
    with pytest.raises(ValueError, match="no module or parameter named '3'"):
        vo.muon_param_groups(model, exclude=["3"])
    with pytest.raises(ValueError, match="holds no parameter of the model"):
        vo.muon_param_groups(model, exclude=[torch.nn.Linear(2, 2)])


def test_muon_param_groups_warn_when_a_likely_head_goes_to_muon():
    # an nn.Sequential's last Linear
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    muon, _, warned = _split(model)
    assert len(muon["params"]) == 2 and len(warned) == 1
    assert "'2' (the model's last Linear)" in warned[0] and "exclude=" in warned[0]

    class LikelyHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(50, 8)
            self.decode = torch.nn.Linear(8, 50)  # as many outputs as the embedding has rows
            self.expand = torch.nn.Linear(8, 2048)  # vocabulary-sized
            self.mix = torch.nn.Linear(8, 8)

    _, _, warned = _split(LikelyHeads())
    assert len(warned) == 1
    for part in (
        "'decode' (out_features equals an embedding's rows)",
        "'expand' (vocabulary-sized",
        "'mix' (the model's last Linear)",
    ):
        assert part in warned[0]
    _, _, warned = _split(Tiny())  # a head found by name only before: now Muon, with a warning
    assert len(warned) == 1 and "'lm_head' (named like one, the model's last Linear" in warned[0]


F64_SHAPES = [(6, 4), (3, 5), (4, 6)]  # one matrix per shape: Newton-Schulz runs unbatched, as torch's


def _f64_params():
    g = torch.Generator().manual_seed(4)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64)) for s in F64_SHAPES]


def _float64(world_size):
    rank = dist.get_rank() if dist.is_initialized() else 0
    ps = _f64_params()
    opt = vo.Muon(ps, lr=0.05)
    for t in range(3):
        for i, p in enumerate(ps):
            p.grad = grad(p.shape, t, rank, i).double()
        opt.step()
    return [p.detach().clone() for p in ps], opt.state_dict()


@pytest.mark.parametrize("world_size", [1, 2])
def test_float64_parameters_equal_torch(world, world_size):
    results = world(world_size).run(_float64, world_size) if world_size > 1 else [_float64(1)]
    ps = _f64_params()
    ref = torch.optim.Muon(ps, lr=0.05)
    for t in range(3):
        for i, p in enumerate(ps):
            p.grad = mean_of(grad(p.shape, t, r, i).double() for r in range(world_size))
        ref.step()
    for params, sd in results:
        for i, (got, want) in enumerate(zip(params, ps)):
            assert got.dtype == sd["state"][i]["momentum_buffer"].dtype == torch.float64
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-12)
            torch.testing.assert_close(sd["state"][i]["momentum_buffer"], ref.state[want]["momentum_buffer"])


def _schedule_adjust(world_size):
    rank = dist.get_rank() if dist.is_initialized() else 0
    muon, _ = make_params()
    opt = vo.Muon(muon, lr=0.02)
    for t in range(4):
        if t == 2:
            opt.param_groups[0]["adjust_lr_fn"] = "match_rms_adamw"  # takes effect at the next step
            opt.param_groups[0]["lr"] = 0.01
        for i, p in enumerate(muon):
            p.grad = grad(p.shape, t, rank, i)
        opt.step()
    return [p.detach().clone() for p in muon]


@pytest.mark.parametrize("world_size", [1, 2])
def test_hyperparameters_changed_after_construction_take_effect(world, world_size):
    got = world(world_size).run(_schedule_adjust, world_size) if world_size > 1 else [_schedule_adjust(1)]
    muon, _ = make_params()
    mats = [torch.nn.Parameter(p.detach().reshape(p.shape[0], -1).clone()) for p in muon if p.ndim != 3]
    idx = [i for i, p in enumerate(muon) if p.ndim != 3]
    ref = torch.optim.Muon(mats, lr=0.02)
    for t in range(4):
        if t == 2:
            ref.param_groups[0]["adjust_lr_fn"] = "match_rms_adamw"
            ref.param_groups[0]["lr"] = 0.01
        for m, i in zip(mats, idx):
            m.grad = mean_grad(muon[i].shape, t, world_size, i).reshape(m.shape)
        ref.step()
    for res in got:
        for m, i in zip(mats, idx):
            torch.testing.assert_close(res[i].reshape(m.shape), m.detach(), rtol=0, atol=2e-4)


def test_torch_muon_state_without_steps_loads_and_is_kept():
    g = torch.Generator().manual_seed(3)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(6, 4), (3, 5)]]
    theirs = torch.optim.Muon(ps, lr=0.05)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
    theirs.step()
    state = theirs.state_dict()
    assert "step" not in state["state"][0]  # torch.optim.Muon counts no steps
    ours = vo.Muon([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=0.05)
    ours.load_state_dict(state)
    for i, st in state["state"].items():
        torch.testing.assert_close(ours.state_dict()["state"][i]["momentum_buffer"], st["momentum_buffer"])


def test_state_of_another_muon_split_is_refused():
    (muon, adam), (muon2, adam2) = make_params(), make_params()
    ours = vo.Muon([{"params": muon[:2]}, {"params": adam, "use_muon": False}])
    other = vo.Muon([{"params": muon2[:2], "use_muon": False}, {"params": adam2, "use_muon": False}])
    for p in muon2[:2] + adam2:
        p.grad = torch.ones_like(p)
    other.step()
    match = "param group 0: state dict has use_muon=False, the optimizer use_muon=True"
    with pytest.raises(ValueError, match=match):
        ours.load_state_dict(other.state_dict())


def _bad_adjust_refused():
    rank = dist.get_rank() if dist.is_initialized() else 0
    muon, _ = make_params()
    opt = vo.Muon(muon, lr=0.02)
    opt.param_groups[0]["adjust_lr_fn"] = "sqrt"
    for i, p in enumerate(muon):
        p.grad = grad(p.shape, 0, rank, i)
    before = [p.detach().clone() for p in muon]
    with pytest.raises(RuntimeError, match="param group 0: Adjust learning rate function sqrt is not supp"):
        opt.step()
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, muon)) and not opt.state_dict()["state"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_an_invalid_adjust_lr_fn_set_later_is_refused_before_the_step(world, world_size):
    if world_size == 1:
        _bad_adjust_refused()
    else:
        world(world_size).run(_bad_adjust_refused, timeout=60)
