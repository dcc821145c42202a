"""SOAP equals a plain one-process SOAP written from the published algorithm (and the authors' file,
when it is at hand), in one process and at any world size under ZeRO-2, ZeRO-3 and HSDP, the same bits
everywhere; each parameter's refresh once in the world, balanced; bad hyperparameters refused by name;
a non-finite factor keeps its basis."""

import re
import warnings

import pytest
import torch
from _soap_cases import (
    SHAPES,
    STEPS,
    TOL,
    assert_same_state,
    authors_soap,
    base_grad,
    build,
    check_state,
    initial,
    rank_grad,
    reference,
    run,
)
from _soap_reference import ReferenceSOAP
from hypothesis import given, settings
from hypothesis import strategies as st

import vescale_optim as vo
from vescale_optim.optim._soap_math import Plan, merged_shape

# --- the math, in one process ------------------------------------------------------------------


def _one_process(cls, shapes, steps, **hyper):
    params = [torch.nn.Parameter(v) for v in initial(shapes)]
    opt = cls(params, **hyper)
    for t in range(steps):
        for i, p in enumerate(params):
            p.grad = base_grad(t, i, p.shape)
        opt.step()
    return params, opt


AUTHORS_CASES = [
    dict(lr=0.01, precondition_frequency=3, max_precond_dim=9),
    dict(
        lr=0.01,
        precondition_frequency=2,
        merge_dims=True,
        max_precond_dim=12,
        precondition_1d=True,
        data_format="channels_last",
    ),
    dict(
        lr=0.01,
        precondition_frequency=1,
        normalize_grads=True,
        correct_bias=False,
        shampoo_beta=0.9,
        betas=(0.9, 0.99),
        weight_decay=0.1,
    ),
]


@pytest.mark.parametrize("hyper", AUTHORS_CASES)
def test_reference_and_ours_equal_the_authors_file(hyper):
    authors = authors_soap()
    if authors is None:
        pytest.skip(
            "the authors' soap.py (github.com/nikhilvyas/SOAP) is not in this repository: set "
            "SOAP_REFERENCE_PY=/path/to/soap.py to compare the reference and vo.SOAP with it"
        )
    theirs, their_opt = _one_process(authors, SHAPES, 12, **hyper)
    for cls in (ReferenceSOAP, vo.SOAP):
        ours, opt = _one_process(cls, SHAPES, 12, **hyper)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a.detach(), b.detach(), **TOL)
    # the authors' state dict loads into ours: the same state as ours after the same steps
    fresh, loaded = _one_process(vo.SOAP, SHAPES, 0, **hyper)
    loaded.load_state_dict(their_opt.state_dict())
    check_state(loaded.state_dict(), their_opt, theirs, [(list(range(len(SHAPES))), {})])


@st.composite
def _cases(draw):
    shapes = draw(
        st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=4).map(tuple), min_size=1, max_size=3)
    )
    hyper = dict(
        lr=0.01,
        max_precond_dim=draw(st.integers(1, 12)),
        merge_dims=draw(st.booleans()),
        precondition_1d=draw(st.booleans()),
        precondition_frequency=draw(st.integers(1, 3)),
        data_format=draw(st.sampled_from(["channels_first", "channels_last"])),
        normalize_grads=draw(st.booleans()),
        correct_bias=draw(st.booleans()),
    )
    return shapes, hyper, draw(st.integers(1, 5))


def _float64(cls, shapes, steps, **hyper):
    params = [torch.nn.Parameter(v.double()) for v in initial(shapes)]
    opt = cls(params, **hyper)
    for t in range(steps):
        for i, p in enumerate(params):
            p.grad = base_grad(t, i, p.shape).double()
        opt.step()
    return params


@settings(max_examples=15)
@given(_cases())
def test_one_process_equals_the_reference_on_any_shape_and_options(case):
    # SOAP is sensitive to rounding: a rotated gradient component near zero (a factor of low rank has
    # eigenvectors of zero eigenvalue) is still divided by its own RMS. So the tolerance is each
    # example's floor, the reference's own error in fp32 against the reference in float64; over 300
    # examples ours was at most 2.8x that floor (both fp32, rounding in other orders).
    shapes, hyper, steps = case
    ours, _ = _one_process(vo.SOAP, shapes, steps, **hyper)
    theirs, _ = _one_process(ReferenceSOAP, shapes, steps, **hyper)
    exact = _float64(ReferenceSOAP, shapes, steps, **hyper)
    floor = max(float((b.detach().double() - c.detach()).abs().max()) for b, c in zip(theirs, exact))
    error = max(float((a.detach().double() - c.detach()).abs().max()) for a, c in zip(ours, exact))
    assert error <= 10 * floor + 1e-6, (error, floor)


@given(st.lists(st.integers(1, 40), max_size=6), st.integers(1, 100))
def test_merged_dimensions_keep_the_size_and_stay_within_the_limit(shape, limit):
    merged = merged_shape(shape, limit)
    assert torch.Size(merged).numel() == torch.Size(shape).numel()
    # a merged dimension is within the limit unless it is one dimension of the shape, alone
    assert all(n <= limit or n in shape for n in merged)
    if shape and all(n <= limit for n in shape) and torch.Size(shape).numel() <= limit:
        assert merged == (torch.Size(shape).numel(),)


def test_first_step_only_builds_and_one_d_parameters_are_adam():
    # the first step leaves every parameter as it was (no update, no decay); a 1-D parameter without
    # precondition_1d is then AdamW whose step t is SOAP's t + 1, with decay after the update
    params, opt = _one_process(vo.SOAP, [(6,), (4, 3)], 1, weight_decay=0.5)
    assert all(torch.equal(p.detach(), v) for p, v in zip(params, initial([(6,), (4, 3)])))
    assert float(opt.state_dict()["state"][0]["step"]) == 0 and opt.state_dict()["state"][0]["GG"] == [[]]
    twin = torch.nn.Parameter(initial([(6,)])[0])
    adam = torch.optim.Adam([twin], lr=3e-3, betas=(0.95, 0.95))
    for t in range(1, 4):
        params[0].grad, twin.grad = base_grad(t, 0, (6,)), base_grad(t, 0, (6,))
        opt.step()
        adam.step()
        with torch.no_grad():
            twin.mul_(1 - 3e-3 * 0.5)
        torch.testing.assert_close(params[0].detach(), twin.detach(), rtol=1e-6, atol=1e-7)


# --- sharded: every world size and layout -------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_zero2_equals_the_reference_and_one_process_bit_for_bit(world, world_size):
    results = world(world_size).run(run)
    one = world(1).run(run)[0] if world_size > 1 else results[0]
    params, ref = reference()
    for res in results:
        for got, want, alone in zip(res["params"], params, one["params"]):
            torch.testing.assert_close(got, want.detach(), **TOL)
            assert torch.equal(got, alone)
        assert_same_state(one["state"], res["state"])
    check_state(results[0]["state"], ref, params)
    # parameters cut by rank boundaries travel to their owners; the refresh work stays balanced
    assert (results[0]["moved"] > 0) == (world_size > 1)
    # (few parameters: the busiest rank may carry the largest one above the mean)
    largest = Plan.of((10, 7), dict(max_precond_dim=12, merge_dims=False)).cost
    assert max(results[0]["work"]) <= 1.1 * sum(results[0]["work"]) / world_size + largest


@settings(max_examples=6)
@given(_cases())
def test_any_shapes_and_options_give_the_same_bits_on_three_ranks(world, case):
    # generated here, run on the ranks: ZeRO-3 (each parameter a unit of its own) against one process
    shapes, hyper, steps = case
    spec = [(list(range(len(shapes))), hyper)]
    one = world(1).run(run, spec=spec, steps=steps, shapes=shapes)[0]
    for res in world(3).run(run, spec=spec, steps=steps, layout="zero3", shapes=shapes):
        assert all(torch.equal(a, b) for a, b in zip(res["params"], one["params"]))
        assert_same_state(one["state"], res["state"])


@pytest.mark.parametrize(
    "layout, world_size",
    [("zero3", 2), ("zero3", 3), ("zero3", 5), ("hsdp", 2), ("hsdp", 3), ("hsdp", 4), ("hsdp", 5)],
)
def test_zero3_and_hsdp_equal_one_process_bit_for_bit(world, layout, world_size):
    one = world(1).run(run)[0]
    for res in world(world_size).run(run, layout=layout):
        for got, want in zip(res["params"], one["params"]):
            assert torch.equal(got, want)
        assert_same_state(one["state"], res["state"])


def _inside_ddp():
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, opt = build()
    ddp = DDP(model)  # averages the whole gradient on every rank: the optimizer takes ZeRO-1's part
    for t in range(STEPS):
        opt.zero_grad()
        ddp([rank_grad(t, i, s, opt.rank, opt.world_size) for i, s in enumerate(SHAPES)]).backward()
        opt.step()
    return [v.clone() for v in model.state_dict().values()]


def test_inside_ddp_equals_one_process_bit_for_bit(world):
    one = world(1).run(run)[0]
    for got in world(2).run(_inside_ddp):
        assert all(torch.equal(a, b) for a, b in zip(got, one["params"]))


def _refreshes(steps):
    model, opt = build()
    counted = []
    for t in range(steps):
        opt.zero_grad()
        model([rank_grad(t, i, s, opt.rank, opt.world_size) for i, s in enumerate(SHAPES)]).backward()
        opt.step()
        counted.append(opt.step_stats["bases"])
    return counted


def test_each_basis_is_computed_once_in_the_world(world):
    one = world(1).run(_refreshes, STEPS)[0]
    per_step = [sum(c[t] for c in world(3).run(_refreshes, STEPS)) for t in range(STEPS)]
    assert per_step == one
    # step 1: every factor's eigh: (10, 7) 2, (8, 3, 2) 3, (13,) none, (5, 12) 2, (1, 6) 2, (6,) with
    # precondition_1d 1, (4, 3, 2, 5) channels-last (4, 5, 3, 2) merged to (4, 5, 6) 3, (21, 16) none
    assert one[0] == 2 + 3 + 0 + 2 + 2 + 1 + 3 + 0


def test_unbalanced_refresh_work_moves_parameters_to_other_owners(world):
    # the layout puts the four matrices on rank 0 and the four vectors (no factors) on rank 1
    shapes = [(12, 12)] * 4 + [(144,)] * 4
    spec = [(list(range(8)), dict(precondition_frequency=2))]
    results = world(2).run(run, spec=spec, shapes=shapes)
    params, _ = reference(spec, shapes=shapes)
    res = results[0]
    assert res["native"][1] < 0.01 * res["native"][0]
    assert res["moved"] == 2 and max(res["work"]) <= 1.1 * sum(res["work"]) / 2
    for got, want in zip(res["params"], params):
        torch.testing.assert_close(got, want.detach(), **TOL)


# --- checks -------------------------------------------------------------------------------------

BAD = [
    (dict(betas=(1.0, 0.95)), "betas"),
    (dict(betas=(0.9, -0.1)), "betas"),
    (dict(betas=(0.9,)), "betas"),
    (dict(precondition_frequency=0), "precondition_frequency"),
    (dict(precondition_frequency=2.5), "precondition_frequency"),
    (dict(eps=-1e-8), "eps"),
    (dict(data_format="channels_middle"), "data_format"),
    (dict(max_precond_dim=0), "max_precond_dim"),
    (dict(shampoo_beta=1.5), "shampoo_beta"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(lr=-1.0), "learning rate"),
    (dict(merge_dims="yes"), "merge_dims"),
]


@pytest.mark.parametrize("kwargs, match", BAD)
def test_bad_hyperparameters_are_refused_at_construction_by_name(kwargs, match):
    params = [torch.nn.Parameter(v) for v in initial()]
    with pytest.raises(ValueError, match=match):
        vo.SOAP(params, **kwargs)
    with pytest.raises(ValueError, match=rf"param group 1: .*{match}"):
        vo.SOAP([{"params": params[:2]}, {"params": params[2:], **kwargs}])


STORAGE = [(dict(state_bits=4), "state_bits"), (dict(factor_dtype=torch.float16), "factor_dtype")]


@pytest.mark.parametrize("kwargs, match", STORAGE)
def test_bad_storage_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        vo.SOAP([torch.nn.Parameter(torch.zeros(3, 3))], **kwargs)


def test_a_bad_hyperparameter_set_after_construction_refuses_the_step():
    model, opt = build()
    opt.param_groups[0]["precondition_frequency"] = 0
    model([base_grad(0, i, s) for i, s in enumerate(SHAPES)]).backward()
    with pytest.raises(RuntimeError, match="precondition_frequency"):
        opt.step()


def _dtensor_refusal():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    p = torch.nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]))
    try:
        vo.SOAP([p])
    except NotImplementedError as e:
        return str(e)
    return None


def test_tensor_parallel_parameters_are_refused_by_name(world):
    for message in world(2).run(_dtensor_refusal):
        assert message is not None and re.search("SOAP does not support DTensor", message)


# --- a non-finite factor keeps the last good basis ----------------------------------------------


def _nan(steps):
    model, opt = build()
    kept, stats = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(steps):
            opt.zero_grad()
            xs = [rank_grad(t, i, s, opt.rank, opt.world_size) for i, s in enumerate(SHAPES)]
            if t == 1:
                xs[0][0, 0] = float("nan")  # the 10 x 7 parameter's factors are NaN from then on
            model(xs).backward()
            opt.step()
            kept.append(opt.kept_bases)
            stats.append(opt.step_stats["kept_bases"])
    state = opt.state_dict()["state"][0]
    return kept, stats, [str(w.message) for w in caught if "eigenbasis" in str(w.message)], state["Q"]


@pytest.mark.parametrize("world_size", [1, 3])
def test_non_finite_factors_keep_their_bases_counted_and_warned(world, world_size):
    for kept, stats, warned, bases in world(world_size).run(_nan, STEPS):
        # refreshes every 2 Adam steps (calls 3 and 5): both factors kept each time
        assert kept == [0, 0, 2, 2, 4] and stats == [0, 0, 2, 0, 2]
        assert len(warned) == 2 and "2 factor(s)" in warned[0]
        assert all(torch.isfinite(q).all() for q in bases)


# --- host reads: one per step (the agreement), one more where bases are built or refreshed --------


def _reads(steps):
    from vescale_optim.shard.host_reads import host_reads

    model, opt = build(spec=[(list(range(len(SHAPES))), dict(precondition_frequency=3))])
    found = []
    for t in range(steps):
        opt.zero_grad()
        model([rank_grad(t, i, s, opt.rank, opt.world_size) for i, s in enumerate(SHAPES)]).backward()
        with host_reads() as reads:
            opt.step()
        found.append(len(reads))
    return found[1:]  # the first step also agrees the order of reductions (Python objects, once a run)


def test_a_step_reads_once_and_a_step_that_builds_or_refreshes_bases_twice(world):
    # calls 2 to 5 are Adam steps 1 to 4: the bases are refreshed after the third
    for found in world(2).run(_reads, STEPS):
        assert found == [1, 1, 2, 1], found


def test_a_non_finite_first_gradient_keeps_the_identity_basis():
    p = torch.nn.Parameter(torch.ones(3, 4))
    opt = vo.SOAP([p])
    p.grad = torch.full((3, 4), float("nan"))
    with pytest.warns(UserWarning, match="kept the previous eigenbasis of 2 factor"):
        opt.step()
    bases = opt.state_dict()["state"][0]["Q"]
    assert torch.equal(bases[0], torch.eye(3)) and torch.equal(bases[1], torch.eye(4))
    assert opt.kept_bases == 2 and opt.step_stats["kept_bases"] == 2
