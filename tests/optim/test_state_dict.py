"""The torch-format state dict goes through torch's own machinery (every optimizer hook fires
as for torch.optim.AdamW), and can be gathered onto one rank only, or into CPU memory."""

import pytest
import torch
import torch.distributed as dist
from _adamw_cases import groups, make_params, set_grads
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.profiler import ProfilerActivity, profile

import vescale_optim as vo


def _hooked(opt, log):
    """Register every hook; each logs what it was called with."""

    def keys(sd):
        return sorted(sd), sorted(sd["state"]), sorted(sd["state"][0])

    return [
        opt.register_step_pre_hook(lambda o, a, k: log.append(("step_pre", o is opt, len(a), sorted(k)))),
        opt.register_step_post_hook(lambda o, a, k: log.append(("step_post", o is opt, len(a), sorted(k)))),
        register_optimizer_step_pre_hook(lambda o, a, k: log.append(("global_pre", o is opt))),
        register_optimizer_step_post_hook(lambda o, a, k: log.append(("global_post", o is opt))),
        opt.register_state_dict_pre_hook(lambda o: log.append(("sd_pre", o is opt))),
        opt.register_state_dict_post_hook(lambda o, sd: log.append(("sd_post", o is opt, keys(sd)))),
        opt.register_load_state_dict_pre_hook(lambda o, sd: log.append(("load_pre", o is opt, keys(sd)))),
        opt.register_load_state_dict_post_hook(
            lambda o: log.append(("load_post", o is opt, o.param_groups[-1]["lr"]))
        ),
    ]


def _exercise(make):
    params = make_params()
    opt = make(groups(params))
    log = []
    handles = _hooked(opt, log)
    try:
        set_grads(params, 0, 0)
        opt.step()
        opt.step(closure=lambda: 1.0)
        sd = opt.state_dict()
        sd["param_groups"][1]["lr"] = 0.5
        opt.load_state_dict(sd)
    finally:
        for h in handles:
            h.remove()
    return log


def test_every_hook_fires_as_for_torch_adamw():
    ours, theirs = _exercise(vo.AdamW), _exercise(torch.optim.AdamW)
    assert ours == theirs
    assert [e[0] for e in ours] == ["global_pre", "step_pre", "step_post", "global_post"] * 2 + [
        "sd_pre",
        "sd_post",
        "load_pre",
        "load_post",
    ]


def _hook_results(make):
    """A state-dict post hook edits the dict or returns a new one; a load pre hook returns a new
    dict whose lr and state the optimizer then takes; a step pre hook replaces the arguments."""
    params = make_params()
    opt = make(groups(params))
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: (a, {"closure": lambda: calls.append("closure") or 2.0}))
    set_grads(params, 0, 0)
    loss = opt.step()
    h1 = opt.register_state_dict_post_hook(lambda o, sd: sd["param_groups"][0].update(tag="edited"))
    h2 = opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 7})
    sd = opt.state_dict()
    h1.remove()
    h2.remove()

    def new_dict(o, sd):
        calls.append(sd is given)  # the hook sees a shallow copy, as in torch
        sd = {**sd, "param_groups": [dict(g) for g in sd["param_groups"]]}
        sd["param_groups"][1]["lr"] = 0.25
        zeroed = {**sd["state"][0], "exp_avg": torch.zeros_like(sd["state"][0]["exp_avg"])}
        sd["state"] = {**sd["state"], 0: zeroed}
        return sd

    given = opt.state_dict()
    opt.register_load_state_dict_pre_hook(new_dict)
    opt.load_state_dict(given)
    after = {i: st["exp_avg"].abs().sum().item() for i, st in opt.state_dict()["state"].items()}
    tag = sd["param_groups"][0]["tag"]
    return loss, calls, sd["extra"], tag, opt.param_groups[1]["lr"], after[0], after[1] > 0


def test_hooks_change_results_as_in_torch():
    ours, theirs = _hook_results(vo.AdamW), _hook_results(torch.optim.AdamW)
    assert ours == theirs
    assert ours[:6] == (2.0, ["closure", False], 7, "edited", 0.25, 0.0)


def _muon(ps):
    return vo.Muon([{"params": [ps[0], ps[4]]}, {"params": ps[1:4] + ps[5:], "use_muon": False}])


@pytest.mark.parametrize("make", [_muon, lambda ps: vo.Shampoo(ps, max_preconditioner_dim=4)])
def test_hooks_fire_for_muon_and_shampoo(make):
    params = make_params()
    opt = make(params)
    log = []
    handles = _hooked(opt, log)
    set_grads(params, 0, 0)
    opt.step()
    opt.load_state_dict(opt.state_dict())
    for h in handles:
        h.remove()
    assert [e[0] for e in log] == [
        "global_pre",
        "step_pre",
        "step_post",
        "global_post",
        "sd_pre",
        "sd_post",
        "load_pre",
        "load_post",
    ]
    assert all(e[1] for e in log)


def test_loaded_groups_stay_the_optimizers_own():
    """torch installs the loaded param groups; ours are updated in place, so a change to
    `param_groups` after loading still reaches the step."""
    params = make_params()
    opt = vo.AdamW(groups(params))
    set_grads(params, 0, 0)
    opt.step()
    before = list(opt.param_groups)
    opt.load_state_dict(opt.state_dict())
    assert all(a is b for a, b in zip(opt.param_groups, before))
    for g in opt.param_groups:
        g["lr"] = 0.0
    values = [p.detach().clone() for p in params]
    set_grads(params, 1, 0)
    opt.step()
    for p, v in zip(params, values):
        torch.testing.assert_close(p.detach(), v, rtol=0, atol=0)


# --- gathering onto one rank ------------------------------------------------------------------


def _big_params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(64, 96), (96,), (33, 65)]]


def _to_rank(dst, kind):
    if kind == "adamw":
        params = _big_params()
        opt = vo.AdamW(params, lr=1e-2, amsgrad=True)
    else:
        params = make_params()
        opt = vo.Shampoo(params, max_preconditioner_dim=4, epsilon=1e-6)
    for t in range(2):
        g = torch.Generator().manual_seed(10 * t + dist.get_rank())
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    everywhere = opt.state_dict()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        one = opt.state_dict(to_rank=dst)
    biggest = max((e.cpu_memory_usage for e in prof.events()), default=0)
    on_cpu = opt.state_dict(to_rank=dst, cpu_offload=True)
    return everywhere, one, on_cpu, biggest, max(p.numel() for p in params) * 4


@pytest.mark.parametrize("kind, dst", [("adamw", 1), ("shampoo", 2)])
def test_state_dict_gathers_onto_one_rank_only(world, kind, dst):
    results = world(3).run(_to_rank, dst, kind)
    for rank, (everywhere, one, on_cpu, biggest, largest_param_bytes) in enumerate(results):
        assert one["param_groups"] == everywhere["param_groups"] == on_cpu["param_groups"]
        if rank != dst:
            assert one["state"] == {} and on_cpu["state"] == {}
            if kind == "adamw":  # a gather to one rank, not an all-gather: no full tensor here
                assert biggest < largest_param_bytes, (rank, biggest, largest_param_bytes)
            continue
        assert biggest >= largest_param_bytes  # the measurement sees full tensors where they land
        assert one["state"].keys() == everywhere["state"].keys() == on_cpu["state"].keys()
        for i, entry in everywhere["state"].items():
            assert one["state"][i].keys() == entry.keys() == on_cpu["state"][i].keys()
            for k, v in entry.items():
                assert on_cpu["state"][i][k].device.type == "cpu"
                torch.testing.assert_close(one["state"][i][k], v, rtol=0, atol=0)
                torch.testing.assert_close(on_cpu["state"][i][k], v, rtol=0, atol=0)


def test_bad_to_rank_is_refused():
    opt = vo.AdamW(make_params())
    for bad in (1, -1, "0"):
        with pytest.raises(ValueError, match=r"to_rank must be a rank of the optimizer's process group"):
            opt.state_dict(to_rank=bad)
    assert opt.state_dict(to_rank=0, cpu_offload=True)["state"] == {}
