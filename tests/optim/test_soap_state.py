"""SOAP's state: torch's format in the reference's layout (loads into the reference and back),
resumable at another world size through torch's format, DCP and `vo.CheckpointManager`; 8-bit moments
and bf16 factors, the same bits at any world size; every tensor held counted; parameters without a
gradient take no step."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _held import held_tensor_bytes
from _soap_cases import (
    MIXED,
    SHAPES,
    STEPS,
    TOL,
    assert_same_state,
    base_grad,
    build,
    groups,
    initial,
    order,
    rank_grad,
    reference,
    run,
    train,
)
from _soap_reference import ReferenceSOAP

import vescale_optim as vo


def _values(model) -> list[torch.Tensor]:
    return [v.clone() for v in model.state_dict().values()]


def _saved(steps, layout="zero2", **options):
    model, opt = build(layout=layout, **options)
    train(model, opt, range(steps))
    return _values(model), opt.state_dict()


def _resumed(values, state, steps, layout="zero2", **options):
    model, opt = build(layout=layout, **options)
    model.load_state_dict(dict(zip(model.state_dict(), values)))
    opt.load_state_dict(state)
    reloaded = opt.state_dict()
    train(model, opt, steps)
    return _values(model), reloaded


@pytest.mark.parametrize("layout", ["zero2", "zero3"])
def test_torch_format_saved_at_4_loads_at_3_and_continues_exactly(world, layout):
    straight, _ = world(4).run(_saved, STEPS, layout)[0]
    values, state = world(4).run(_saved, 3, layout)[0]
    _, via3 = world(3).run(_resumed, values, state, range(0), layout)[0]
    assert_same_state(state, via3)  # nothing lost at another world size and layout
    for got, want in zip(world(4).run(_resumed, values, via3, range(3, STEPS), layout)[0][0], straight):
        assert torch.equal(got, want)


def _dcp_save(path, steps, manager=False):
    model, opt = build()
    train(model, opt, range(steps))
    if manager:
        vo.CheckpointManager(path, model, opt).save(steps)
    else:
        dcp.save(
            {"model": opt.sharded_model_state_dict(model), "optim": opt.sharded_state_dict(model)},
            checkpoint_id=path,
        )
    dist.barrier()
    return _values(model)


def _dcp_resume(path, steps, manager=False):
    model, opt = build()
    if manager:
        assert vo.CheckpointManager(path, model, opt).load().step == steps.start
    else:
        pieces = {"model": opt.sharded_model_state_dict(model), "optim": opt.sharded_state_dict(model)}
        dcp.load(pieces, checkpoint_id=path)
        opt.load_sharded_model_state_dict(pieces["model"])
        opt.load_sharded_state_dict(pieces["optim"], model)
    loaded = opt.state_dict()
    train(model, opt, steps)
    return _values(model), loaded


@pytest.mark.parametrize("manager", [False, True], ids=["dcp", "manager"])
def test_dcp_and_the_manager_save_at_4_load_at_3_and_continue_exactly(world, tmp_path, manager):
    straight, state = world(4).run(_saved, STEPS)[0]
    at3 = world(4).run(_saved, 3)[0][1]
    path = str(tmp_path / "ckpt")
    world(4).run(_dcp_save, path, 3, manager)
    for got, loaded in world(3).run(_dcp_resume, path, range(3, STEPS), manager):
        assert_same_state(at3, loaded)
        for a, b in zip(got, straight):
            assert torch.equal(a, b)


# --- the reference's layout ---------------------------------------------------------------------


def _ours_then(steps, state=None):
    """Ours on this rank, trained `steps` (a range) from the reference's `state` if given."""
    model, opt = build()
    if state is not None:
        values, sd = state
        model.load_state_dict(dict(zip(model.state_dict(), values)))
        opt.load_state_dict(sd)
    train(model, opt, steps)
    return _values(model), opt.state_dict()


def _reference_steps(params, opt, steps):
    for t in steps:
        for i, p in enumerate(params):
            p.grad = base_grad(t, i, p.shape)
        opt.step()


def test_state_dicts_move_between_ours_and_the_reference(world):
    # ours (3 ranks, 3 steps) -> the reference continues 2 steps: as the reference alone
    params, alone = reference()
    values, state = world(3).run(_ours_then, range(3))[0]
    twins = [torch.nn.Parameter(v.clone()) for v in values]
    ref = ReferenceSOAP(groups(twins))
    ref.load_state_dict(state)
    _reference_steps(twins, ref, range(3, STEPS))
    for a, b in zip(twins, params):
        torch.testing.assert_close(a.detach(), b.detach(), **TOL)
    assert [ref.state[twins[i]]["step"] for i in order()] == [alone.state[params[i]]["step"] for i in order()]
    # the reference (3 steps) -> ours on 3 ranks continues 2 steps: as ours alone
    mid, mid_opt = reference(steps=3)
    got, _ = world(3).run(_ours_then, range(3, STEPS), ([p.detach() for p in mid], mid_opt.state_dict()))[0]
    for a, b in zip(got, world(3).run(run)[0]["params"]):
        torch.testing.assert_close(a, b, **TOL)


def test_a_state_dict_whose_lists_do_not_fit_is_refused_by_name():
    model, opt = build()
    train(model, opt, range(2))
    state = opt.state_dict()
    state["state"][0]["GG"] = state["state"][0]["GG"][:1]
    with pytest.raises(ValueError, match="'GG' lists 1 factor"):
        opt.load_state_dict(state)


# --- storage tiers ------------------------------------------------------------------------------

BIG = [(64, 64), (80, 80), (4096,), (12, 12)]  # square: full-rank factors; 4096+ elements: 8-bit moments
BIG_SPEC = [([0, 1, 2, 3], dict(precondition_frequency=2, max_precond_dim=70))]


# how far the low-bit run ends from fp32, as a share of how far fp32 moved each parameter: measured
# 0.008 for 8-bit moments, 0.17 for bf16 factors and bases (a basis rounded to bf16 is orthogonal to
# 1e-3 only, and Adam's early steps divide each rotated component by its own size)
LOW_BIT = {"q8": (dict(state_bits=8), 0.03), "bf16": (dict(factor_dtype=torch.bfloat16), 0.4)}


@pytest.mark.parametrize("kind", list(LOW_BIT))
def test_low_bit_storage_is_the_same_bits_at_any_world_size_and_near_fp32(world, kind):
    options, near = LOW_BIT[kind]
    one = world(1).run(run, spec=BIG_SPEC, shapes=BIG, **options)[0]
    for res in world(3).run(run, spec=BIG_SPEC, shapes=BIG, **options):
        for got, want in zip(res["params"], one["params"]):
            assert torch.equal(got, want)
        assert_same_state(one["state"], res["state"])
    exact, _ = reference(BIG_SPEC, shapes=BIG)
    for got, want, start in zip(one["params"], exact, initial(BIG)):
        assert float((got - want.detach()).norm()) <= near * float((want.detach() - start).norm())


def _held(steps, **options):
    model, opt = build(spec=BIG_SPEC, shapes=BIG, **options)
    train(model, opt, range(steps), BIG)
    return held_tensor_bytes(opt), opt.local_state_bytes(), opt.local_state_numel()


@pytest.mark.parametrize("world_size", [1, 3])
def test_local_state_counts_every_tensor_held(world, world_size):
    fp32 = world(world_size).run(_held, 2)
    for held, counted, numel in fp32:
        assert held == counted == 4 * numel
    q8 = world(world_size).run(_held, 2, state_bits=8)
    assert all(held == counted for held, counted, _ in q8)
    # 8-bit moments, about a quarter of fp32's, beside fp32 factors: half of it in all, over the ranks
    assert sum(counted for _, counted, _ in q8) < 0.6 * sum(counted for _, counted, _ in fp32)


# --- parameters without a gradient take no step, as in torch -----------------------------------

SKIPPED = {1: {0}, 2: {0, 2}, 3: {6}}  # step -> parameters with no gradient on any rank


def _train_sparse():
    model, opt = build()
    for t in range(STEPS):
        opt.zero_grad()
        xs = [rank_grad(t, i, s, dist.get_rank(), dist.get_world_size()) for i, s in enumerate(SHAPES)]
        loss = sum(b(x) for i, (b, x) in enumerate(zip(model.blocks, xs)) if i not in SKIPPED.get(t, ()))
        loss.backward()
        opt.step()
    return _values(model), opt.state_dict()


@pytest.mark.parametrize("world_size", [1, 3])
def test_parameters_without_a_gradient_take_no_step(world, world_size):
    params = [torch.nn.Parameter(v) for v in initial()]
    ref = ReferenceSOAP(groups(params))
    for t in range(STEPS):
        for i, p in enumerate(params):
            p.grad = None if i in SKIPPED.get(t, ()) else base_grad(t, i, p.shape)
        ref.step()
    for got, sd in world(world_size).run(_train_sparse):
        for a, b in zip(got, params):
            torch.testing.assert_close(a, b.detach(), **TOL)
        for pos, i in enumerate(order(MIXED)):
            assert float(sd["state"][pos]["step"]) == ref.state[params[i]]["step"], i


def test_torchs_get_and_set_optimizer_state_dict_round_trip():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model, opt = build()
    train(model, opt, range(3))
    before = opt.state_dict()
    saved = get_optimizer_state_dict(model, opt)  # keyed by parameter name: the lists ride along
    assert set(saved["state"]["blocks.0.w"]) >= {"GG", "Q", "exp_avg", "exp_avg_sq", "step"}
    fresh_model, fresh = build()
    set_optimizer_state_dict(fresh_model, fresh, saved)
    assert_same_state(before, fresh.state_dict())
