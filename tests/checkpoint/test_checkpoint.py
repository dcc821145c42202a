"""Checkpoints: torch-format state dicts across world sizes and into torch, and DCP resharding."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _adamw_cases import SHAPES, groups, make_params, mean_grads, set_grads

import vescale_optim as vo


def _run(opt, params, steps, rank=None):
    rank = dist.get_rank() if rank is None else rank
    for t in steps:
        opt.zero_grad()
        set_grads(params, t, rank, params[0].dtype)
        opt.step()


def _train_then_state(steps):
    params = make_params()
    opt = vo.AdamW(groups(params))
    _run(opt, params, range(steps))
    return [p.detach().clone() for p in params], opt.state_dict()


def _restored(values, state):
    """A fresh optimizer over parameters set to `values`, loaded from `state`."""
    params = make_params()
    with torch.no_grad():
        for p, v in zip(params, values):
            p.copy_(v)
    opt = vo.AdamW(groups(params))
    opt.load_state_dict(state)
    return params, opt


def _resume(values, state, steps):
    params, opt = _restored(values, state)
    _run(opt, params, steps)
    return [p.detach().clone() for p in params]


def _reload(values, state):
    return _restored(values, state)[1].state_dict()


def test_round_trip_across_world_sizes_continues_exactly(world):
    straight, _ = world(2).run(_train_then_state, 5)[0]
    values, state = world(2).run(_train_then_state, 3)[0]
    # The gradients of steps 3 and 4 are defined per rank for 2 ranks; resume on 2 ranks but
    # through a state dict that went through a 3-rank optimizer and back.
    via3 = world(3).run(_reload, values, state)[0]
    resumed = world(2).run(_resume, values, via3, range(3, 5))[0]
    for a, b in zip(resumed, straight):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_cross_loads_with_torch_adamw():
    params = make_params()
    ours = vo.AdamW(groups(params))
    _run(ours, params, range(3), rank=0)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    theirs = torch.optim.AdamW(groups(twins))
    theirs.load_state_dict(ours.state_dict())
    for t in range(3, 5):
        set_grads(twins, t, 0)
        theirs.step()
    _run(ours, params, range(3, 5), rank=0)
    for a, b in zip(params, twins):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
    # and back: torch's state loads into ours
    again = make_params()
    with torch.no_grad():
        for p, v in zip(again, twins):
            p.copy_(v)
    ours2 = vo.AdamW(groups(again))
    ours2.load_state_dict(theirs.state_dict())
    sd = ours2.state_dict()
    for i, st in theirs.state_dict()["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(sd["state"][i][k], v)


def test_wrong_shapes_are_refused_before_anything_changes():
    params = make_params()
    opt = vo.AdamW(groups(params))
    _run(opt, params, range(2), rank=0)
    good = opt.state_dict()
    bad = opt.state_dict()
    bad["state"][4]["exp_avg_sq"] = torch.zeros(3, 17)
    bad["param_groups"][0]["lr"] = 123.0
    wrong = r"parameter 4: 'exp_avg_sq' has shape \(3, 17\), expected \(17, 3\)"
    with pytest.raises(ValueError, match=wrong):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert after["param_groups"][0]["lr"] == good["param_groups"][0]["lr"]
    for i, st in good["state"].items():
        for k, v in st.items():
            assert torch.equal(v, after["state"][i][k])
    missing = opt.state_dict()
    del missing["state"][2]["exp_avg"]
    with pytest.raises(ValueError, match="parameter 2: state dict lacks 'exp_avg'"):
        opt.load_state_dict(missing)
    with pytest.raises(ValueError, match="state dict has 4 param groups, the optimizer has 2"):
        opt.load_state_dict({"state": {}, "param_groups": good["param_groups"] * 2})


# --- torch.distributed.checkpoint ------------------------------------------------------


def _dcp_save(path, steps):
    params = make_params()
    opt = vo.AdamW(groups(params))
    _run(opt, params, range(steps))
    dcp.save(opt.sharded_state_dict(torch.nn.ParameterList(params)), checkpoint_id=path)
    return [p.detach().clone() for p in params]


def _dcp_load_and_state(path, values):
    params = make_params()
    with torch.no_grad():
        for p, v in zip(params, values):
            p.copy_(v)
    opt = vo.AdamW(groups(params))
    names = torch.nn.ParameterList(params)  # the names its state is keyed by
    sd = opt.sharded_state_dict(names)
    dcp.load(sd, checkpoint_id=path)
    opt.load_sharded_state_dict(sd, names)
    return opt.state_dict()


def test_dcp_save_at_4_load_at_3_and_1_continues_exactly(world, tmp_path):
    path = str(tmp_path / "ckpt")
    values = world(4).run(_dcp_save, path, 3)[0]
    reference = world(4).run(_train_then_state, 3)[0][1]
    at3 = world(3).run(_dcp_load_and_state, path, values)[0]
    at1 = _dcp_load_and_state(path, values)  # one process, no process group
    for got in (at3, at1):
        for i in range(len(SHAPES)):
            for k, v in reference["state"][i].items():
                torch.testing.assert_close(got["state"][i][k], v, rtol=0, atol=0)
    # training continues exactly as without the interruption
    straight = world(4).run(_train_then_state, 5)[0][0]
    resumed = world(4).run(_resume, values, at3, range(3, 5))[0]
    for a, b in zip(resumed, straight):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _dcp_bf16(path, save):
    params = make_params(torch.bfloat16)
    opt = vo.AdamW(groups(params))
    names = torch.nn.ParameterList(params)  # the names its state is keyed by
    if save:
        _run(opt, params, range(2))
        dcp.save(opt.sharded_state_dict(names), checkpoint_id=path)
    else:  # fresh, untrained parameters: everything must come from the checkpoint
        sd = opt.sharded_state_dict(names)
        dcp.load(sd, checkpoint_id=path)
        opt.load_sharded_state_dict(sd, names)
    _run(opt, params, range(2, 4))
    return [p.detach().float() for p in params]


def test_dcp_keeps_the_fp32_master_of_bf16_params(world, tmp_path):
    path = str(tmp_path / "bf16")
    straight = world(2).run(_dcp_bf16, path, True)[0]
    resumed = world(2).run(_dcp_bf16, path, False)[0]
    for a, b in zip(resumed, straight):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# --- load_state_dict refuses before changing anything ------------------------------------


def _refuses_amsgrad_state():
    rank = dist.get_rank() if dist.is_initialized() else 0
    params = make_params()
    ours = vo.AdamW(groups(params, amsgrad=False))
    _run(ours, params, range(2), rank)
    before = ours.state_dict()
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    theirs = torch.optim.AdamW(groups(twins, amsgrad=True))
    set_grads(twins, 0, 0)
    theirs.step()

    def with_state(index, entry):
        return {**before, "state": {**before["state"], index: entry}}

    bad = {
        r"param group 1: state dict has amsgrad=True, the optimizer amsgrad=False": theirs.state_dict(),
        r"state for parameters \[99\] that no param group lists": with_state(99, {}),
        r"parameter 0: 'step' is 1.5": with_state(0, {**before["state"][0], "step": torch.tensor(1.5)}),
    }
    for match, sd in bad.items():
        with pytest.raises(ValueError, match=match):
            ours.load_state_dict(sd)
        after = ours.state_dict()  # still works, and nothing changed
        assert after["param_groups"] == before["param_groups"]
        for i, st in before["state"].items():
            assert all(torch.equal(v, after["state"][i][k]) for k, v in st.items())


@pytest.mark.parametrize("world_size", [1, 2])
def test_state_that_does_not_fit_is_refused_before_anything_changes(world, world_size):
    if world_size == 1:
        _refuses_amsgrad_state()
    else:
        world(world_size).run(_refuses_amsgrad_state, timeout=60)


# --- per-parameter steps: some parameters of a bucket with state, others without ----------

PARTIAL = {0: (2,), 1: (1, 2), 2: (2,), 3: (2,), 4: (2, 5)}  # param 2 never has a gradient


def _torch_partial(world, steps, state=None, values=None):
    params = make_params()
    if values is not None:
        with torch.no_grad():
            for p, v in zip(params, values):
                p.copy_(v)
    opt = torch.optim.AdamW(groups(params))
    if state is not None:
        opt.load_state_dict(copy.deepcopy(state))  # torch would update the tensors of `state`
    for t in steps:
        for p, g in zip(params, mean_grads(t, world, skip=PARTIAL[t])):
            p.grad = g
        opt.step()
    return [p.detach().clone() for p in params], opt.state_dict()


def _ours_partial(values, state, steps):
    rank = dist.get_rank() if dist.is_initialized() else 0
    params, opt = _restored(values, state)
    for t in steps:
        opt.zero_grad()
        set_grads(params, t, rank, skip=PARTIAL[t])
        opt.step()
    return [p.detach().clone() for p in params], opt.state_dict()


@pytest.mark.parametrize("world_size", [1, 2])
def test_torch_state_with_per_parameter_steps_resumes_as_torch(world, world_size):
    values, state = _torch_partial(world_size, range(3))
    assert 2 not in state["state"] and float(state["state"][1]["step"]) == 2
    want, want_state = _torch_partial(world_size, range(3, 5), state, values)
    run = world(world_size).run if world_size > 1 else lambda fn, *a: [fn(*a)]
    for got, got_state in run(_ours_partial, values, state, range(3, 5)):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert set(got_state["state"]) == set(want_state["state"])
        for i, st in want_state["state"].items():
            for k, v in st.items():
                torch.testing.assert_close(got_state["state"][i][k], v, rtol=1e-6, atol=1e-7)


# --- bf16 parameters: the fp32 master travels with the state dict -------------------------


def _bf16_train(steps, values=None, state=None):
    rank = dist.get_rank() if dist.is_initialized() else 0
    params = make_params(torch.bfloat16)
    if values is not None:
        with torch.no_grad():
            for p, v in zip(params, values):
                p.copy_(v)
    opt = vo.AdamW(groups(params))
    if state is not None:
        opt.load_state_dict(state)
    _run(opt, params, steps, rank)
    return [p.detach().clone() for p in params], opt.state_dict()


@pytest.mark.parametrize("world_size", [1, 2])
def test_bf16_resume_from_a_state_dict_is_exact(world, world_size):
    run = world(world_size).run if world_size > 1 else lambda fn, *a: [fn(*a)]
    straight = run(_bf16_train, range(4))[0][0]
    values, state = run(_bf16_train, range(2))[0]
    assert state["state"][0]["master"].dtype == torch.float32
    resumed = run(_bf16_train, range(2, 4), values, state)[0][0]
    for a, b in zip(resumed, straight):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bf16_state_cross_loads_with_torch_and_a_stale_master_loses_to_the_parameter():
    values, state = _bf16_train(range(2))
    twins = [torch.nn.Parameter(v.clone()) for v in values]
    theirs = torch.optim.AdamW(groups(twins))
    theirs.load_state_dict(copy.deepcopy(state))  # torch ignores the master
    _run(theirs, twins, range(2, 4), rank=0)
    back = theirs.state_dict()  # its masters are now two steps old
    trained = [p.detach().clone() for p in twins]
    without = {
        **back,
        "state": {i: {k: v for k, v in st.items() if k != "master"} for i, st in back["state"].items()},
    }
    got = _bf16_train(range(4, 6), trained, back)[0]
    want = _bf16_train(range(4, 6), trained, without)[0]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bf16_parameters_written_after_construction_are_taken_up():
    """Weights loaded into the model after the optimizer was built (fine-tuning) are not
    overwritten by the masters taken at construction."""
    params = make_params(torch.bfloat16)
    opt = vo.AdamW(groups(params))
    with torch.no_grad():
        for p in params:
            p.add_(1.0)  # as model.load_state_dict does: in place
    _run(opt, params, range(2), rank=0)
    fresh = make_params(torch.bfloat16)
    with torch.no_grad():
        for p in fresh:
            p.add_(1.0)
    _run(vo.AdamW(groups(fresh)), fresh, range(2), rank=0)
    for a, b in zip(params, fresh):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=0)
