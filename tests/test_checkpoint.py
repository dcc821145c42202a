"""Checkpoints: torch-format state dicts across world sizes and into torch, and DCP resharding."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _adamw_cases import SHAPES, groups, make_params, set_grads

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
    dcp.save(opt.sharded_state_dict(), checkpoint_id=path)
    return [p.detach().clone() for p in params]


def _dcp_load_and_state(path, values):
    params = make_params()
    with torch.no_grad():
        for p, v in zip(params, values):
            p.copy_(v)
    opt = vo.AdamW(groups(params))
    sd = opt.sharded_state_dict()
    dcp.load(sd, checkpoint_id=path)
    opt.load_sharded_state_dict(sd)
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
    if save:
        _run(opt, params, range(2))
        dcp.save(opt.sharded_state_dict(), checkpoint_id=path)
    else:  # fresh, untrained parameters: everything must come from the checkpoint
        sd = opt.sharded_state_dict()
        dcp.load(sd, checkpoint_id=path)
        opt.load_sharded_state_dict(sd)
    _run(opt, params, range(2, 4))
    return [p.detach().float() for p in params]


def test_dcp_keeps_the_fp32_master_of_bf16_params(world, tmp_path):
    path = str(tmp_path / "bf16")
    straight = world(2).run(_dcp_bf16, path, True)[0]
    resumed = world(2).run(_dcp_bf16, path, False)[0]
    for a, b in zip(resumed, straight):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
