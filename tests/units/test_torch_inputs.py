"""torch's own optimizer test inputs, run against vo.AdamW and vo.Muon.

`torch.testing._internal.common_optimizers` lists, per optimizer, the configurations that
torch tests (`optim_inputs_func`, plus its `foreach`/`fused`/`differentiable` variants)
and the bad inputs it must refuse (`optim_error_inputs_func`). Every configuration steps
like torch's optimizer on the same data, in one process and on 2 ranks; every bad input
is refused as torch refuses it, except those in DIFFERENT, each with its reason.
"""

import re
import warnings

import pytest
import torch

import vescale_optim as vo

OURS = {"AdamW": vo.AdamW, "Muon": vo.Muon}
TORCH = {"AdamW": torch.optim.AdamW, "Muon": torch.optim.Muon}
SHAPES = {"AdamW": [(5, 7), (13,), (3, 4)], "Muon": [(6, 4), (3, 5), (8, 8)]}  # torch's Muon: 2-D only
STEPS = 3

# torch's error input -> what ours does instead: (error type, message) or None (accepted, and
# then it steps like torch's optimizer given the same input without `foreach`)
DIFFERENT = {
    # torch warns and steps the parameter twice; ours refuses a parameter listed twice
    "a param group cannot have duplicate parameters": (ValueError, "appears more than once"),
    # `foreach` names one of torch's implementations, which cannot take Tensor lr or betas;
    # ours has one implementation, and it can
    "lr as Tensor doesn't work with foreach & not capturable": None,
    r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True": None,
    # ours orthogonalizes a 3-D parameter as a stack of matrices
    "only support 2D parameters": None,
    # refused at construction, before anything is built, rather than at the first step
    "does not support complex parameters": (ValueError, "need floating"),
}


def _torch_cases():
    """(configurations, error inputs) per optimizer name, as plain data (picklable, and the
    ranks need not import torch's test module)."""
    with warnings.catch_warnings():  # importing it sets global warning filters
        from torch.testing._internal.common_optimizers import OptimizerErrorEnum, optim_db
    configs, errors = {}, {}
    for name, cls in TORCH.items():
        info = next(i for i in optim_db if i.optim_cls is cls)
        flags = [f for f in info.supported_impls if f != "fused" or "cpu" in info.supports_fused_on]
        configs[name] = []
        for case in info.optim_inputs_func("cpu"):
            base = {**case.kwargs, **dict.fromkeys(flags, False)}
            configs[name].append((case.desc, base))
            configs[name] += [(f"{case.desc} & {f}", {**base, f: True}) for f in flags]
        errors[name] = [
            (
                e.optimizer_error_input.desc,
                e.optimizer_error_input.params,
                e.optimizer_error_input.kwargs,
                e.error_type,
                e.error_regex,
                e.error_on == OptimizerErrorEnum.STEP_ERROR,
            )
            for e in info.optim_error_inputs_func("cpu", torch.float32)
        ]
    return configs, errors


CONFIGS, ERRORS = _torch_cases()


def _params(name):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES[name]]


def _grad(shape, step, i):
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * step + i))


def _steps(opt, params, steps=STEPS):
    """The same gradient on every rank, so the mean is exact at any world size."""
    for t in range(steps):
        opt.zero_grad()
        for i, p in enumerate(params):
            p.grad = _grad(p.shape, t, i)
        opt.step()
    return [p.detach().clone() for p in params]


def _torch_result(name, kwargs):
    params = _params(name)
    kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    return _steps(TORCH[name](params, **kwargs), params)


def _ours(name, kwargs):
    """Our parameters after STEPS steps, or (error type, message) if the input is refused."""
    params = _params(name)
    kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    try:
        opt = OURS[name](params, **kwargs)
    except (TypeError, ValueError, RuntimeError) as e:
        return type(e), str(e)
    return _steps(opt, params)


def _run_configs(name):
    return [_ours(name, kwargs) for _, kwargs in CONFIGS[name]]


def _check_configs(name, results):
    for (desc, kwargs), got in zip(CONFIGS[name], results):
        if kwargs.get("differentiable"):
            assert isinstance(got, tuple) and got[0] is ValueError, (desc, got)
            assert "does not support differentiable=True" in got[1]
            continue
        assert isinstance(got, list), (desc, got)
        for a, b in zip(got, _torch_result(name, kwargs)):
            # AdamW: torch's fused kernel vs its other implementations (measured: equal);
            # Muon: an ulp of momentum may flip a bf16 rounding in Newton–Schulz (measured: 3e-8)
            tol = dict(rtol=1e-6, atol=1e-7) if name == "AdamW" else dict(rtol=0, atol=2e-4)
            torch.testing.assert_close(a, b, **tol, msg=lambda m, d=desc: f"{name} '{d}': {m}")


@pytest.mark.parametrize("name", ["AdamW", "Muon"])
def test_torch_configurations_step_like_torch(world, name):
    _check_configs(name, _run_configs(name))
    for results in world(2).run(_run_configs, name):
        _check_configs(name, results)


def _run_errors(name):
    """What each error input does to ours: ('raised', type, message), ('warned', messages)
    or ('accepted', parameters after STEPS steps, given real parameters if it had none)."""
    out = []
    for desc, params, kwargs, _, _, at_step in ERRORS[name]:
        if desc in DIFFERENT and DIFFERENT[desc] is None and params is None:
            out.append(("accepted", _ours(name, kwargs)))
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                opt = OURS[name](params, **kwargs)
                if at_step:
                    opt.step()
            except (TypeError, ValueError, RuntimeError) as e:
                out.append(("raised", type(e), str(e)))
                continue
        out.append(("accepted", None) if desc in DIFFERENT else ("warned", [str(w.message) for w in caught]))
    return out


def _check_errors(name, results):
    assert len(results) == len(ERRORS[name])
    for (desc, _, kwargs, error_type, regex, _), got in zip(ERRORS[name], results):
        if desc in DIFFERENT and DIFFERENT[desc] is None:
            assert got[0] == "accepted", (desc, got)
            if isinstance(got[1], list):
                plain = {k: v for k, v in kwargs.items() if k != "foreach"}
                for a, b in zip(got[1], _torch_result(name, plain)):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            continue
        error_type, regex = DIFFERENT.get(desc, (error_type, regex))
        if issubclass(error_type, Warning):
            assert got[0] == "warned" and any(re.search(regex, m) for m in got[1]), (desc, got)
        else:
            assert got[0] == "raised" and got[1] is error_type and re.search(regex, got[2]), (desc, got)


@pytest.mark.parametrize("name", ["AdamW", "Muon"])
def test_torch_error_inputs_are_refused_like_torch(world, name):
    _check_errors(name, _run_errors(name))
    for results in world(2).run(_run_errors, name):
        _check_errors(name, results)


# --- flags, schedulers ----------------------------------------------------------------


def test_implementation_flags():
    params = _params("AdamW")
    for flags in (dict(foreach=True), dict(fused=True), dict(foreach=False, fused=False)):
        vo.AdamW(params, **flags)
    with pytest.raises(ValueError, match="differentiable=True"):
        vo.AdamW(params, differentiable=True)
    with pytest.raises(ValueError, match="capturable=True"):
        vo.AdamW(params, capturable=True)
    with pytest.raises(RuntimeError, match="cannot be `True` together"):
        vo.AdamW(params, foreach=True, fused=True)


def test_adamw_param_groups_are_checked_like_the_defaults():
    params = _params("AdamW")
    bad = [
        (dict(betas=(1.0, 0.9)), "beta parameter at index 0"),
        (dict(eps=-1.0), "epsilon"),
        (dict(lr=torch.tensor([1.0, 2.0])), "Tensor lr"),
        (dict(weight_decay=-1), "weight_decay"),
    ]
    for group, match in bad:
        with pytest.raises(ValueError, match=match):
            vo.AdamW([{"params": params[:1]}, {"params": params[1:], **group}])


def _scheduled(make_opt, make_sched):
    params = _params("Muon")
    opt = make_opt(params)
    sched = make_sched(opt)
    momenta = []
    for t in range(6):
        opt.zero_grad()
        for i, p in enumerate(params):
            p.grad = _grad(p.shape, t, i)
        opt.step()
        sched.step()
        momenta.append(opt.param_groups[0]["momentum"])
    return [p.detach().clone() for p in params], momenta, opt.param_groups[0].get("betas")


@pytest.mark.parametrize(
    "make_sched",
    [
        lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=7),
        lambda opt: torch.optim.lr_scheduler.CyclicLR(
            opt, base_lr=0.01, max_lr=0.05, step_size_up=2, base_momentum=0.8, max_momentum=0.95
        ),
    ],
    ids=["OneCycleLR", "CyclicLR"],
)
def test_schedulers_cycle_muon_momentum_as_for_torch(make_sched):
    ours, our_momenta, betas = _scheduled(lambda p: vo.Muon(p, lr=0.02), make_sched)
    theirs, their_momenta, _ = _scheduled(lambda p: torch.optim.Muon(p, lr=0.02), make_sched)
    assert our_momenta == their_momenta and len(set(our_momenta)) > 1
    assert betas is None  # betas belong to AdamW groups only
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-4)
