"""Shampoo over a tensor-parallel model (dp2 x tp2 on 4 gloo ranks): torch's TP plan on
world["tp"], vo.Shampoo on world["dp"]. With the TP cuts on the tile grid every tile of a full
matrix lies inside one TP shard, so each TP rank's tiles of its shard are the full tensor's,
computed once in the world by their data-parallel owners: the same numbers as the one-process
reference on the unparallelised model fed the mean gradient (ZeRO-2, ZeRO-3, HSDP), also after a
DCP or CheckpointManager round trip into dp2 x tp2 or a plain dp4 model. Matrices replicated over
TP (plain, or a Replicate DTensor) next to cut ones have their tiles computed once in the dp x tp
world too. torch's full format holds the one-process reference's state on every rank and resumes
bitwise at dp2 x tp2, dp4 x tp1 and dp1 x tp4. Cuts off the grid are refused."""

import pytest
import torch
from _fsdp_cases import SHAMPOO
from _resume import save_and_load
from _shampoo_reference import ReferenceShampoo
from _tp import (
    PLAN,
    SP_PLAN,
    SP_SEQ,
    SP_TP,
    SequenceParallelBlock,
    at_layout,
    build,
    full,
    mean_grad,
    mesh,
    replicated_mesh,
    train,
    train_sequence_parallel,
)
from _tp_shampoo import STEPS, reference, roots_per_step
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import parallelize_module

import vescale_optim as vo

pytestmark = pytest.mark.slow

# SHAMPOO's max_preconditioner_dim is 8: every TP shard of the block (8 or 16 rows / columns) on the grid

# the MLP cut over TP; attention replicated over TP: wq, wk, wv plain, wo a Replicate DTensor
MLP_PLAN = {name: style for name, style in PLAN.items() if name in ("w1", "w3", "w2")}


def _parallelize(model, tp, plan):
    """`model` under torch's TP `plan` on mesh `tp`; with MLP_PLAN, wo a Replicate DTensor."""
    model = parallelize_module(model, tp, plan)
    if plan is MLP_PLAN:
        distribute_module(
            model.wo,
            tp,
            input_fn=lambda _, xs, mesh: tuple(DTensor.from_local(x, mesh, [Replicate()]) for x in xs),
            output_fn=lambda _, out, mesh: out.to_local(),
        )
    return model


def _train(shape, zero3, plan=PLAN):
    """vo.Shampoo on a (replicate, shard, tp) root mesh of `shape`: the whole model after STEPS
    and each step's roots computed on this rank."""
    world, dp_rank = replicated_mesh(shape)
    dp = world["dp_shard"] if shape[0] == 1 else world["dp_replicate", "dp_shard"]
    model = _parallelize(build(), world["tp"], plan)
    units = dict(shard_modules=[*(getattr(model, n) for n in plan), model]) if zero3 else {}
    opt = vo.Shampoo(model.parameters(), mesh=dp, **units, **SHAMPOO)
    roots = train(model, opt, dp_rank, range(STEPS), "roots")
    assert all(isinstance(getattr(model, n).weight, DTensor) for n in plan)
    if plan is MLP_PLAN:
        assert not isinstance(model.wq.weight, DTensor) and model.wo.weight.placements == (Replicate(),)
    return full(model.state_dict()), roots


LAYOUTS = [((1, 2, 2), False), ((1, 2, 2), True), ((2, 1, 2), False)]
IDS = ["dp2xtp2", "dp2xtp2-zero3", "hsdp2x1xtp2"]


@pytest.mark.parametrize("shape, zero3", LAYOUTS, ids=IDS)
def test_shampoo_under_tp_equals_one_process_each_tile_once(world, shape, zero3):
    want = reference()
    results = world(4).run(_train, shape, zero3)
    for t, n in enumerate(roots_per_step()):  # each tile's roots computed once in the world
        assert sum(roots[t] for _, roots in results) == n, (t, [roots for _, roots in results])
    for got, _ in results:
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=k)


def _setup(dp, tp, plan=PLAN, opts=SHAMPOO, weights=None):
    """The model at (dp, tp) (a plain one at tp=1) with vo.Shampoo, and this rank's dp rank."""
    optimizer = lambda params, **mesh: vo.Shampoo(params, **mesh, **opts)  # noqa: E731
    return at_layout(dp, tp, optimizer, weights, lambda model, tp_mesh: _parallelize(model, tp_mesh, plan))


def _round_trip(path, kind, dp, tp):
    """STEPS/2 steps at dp2 x tp2 (roots refreshed at the last), saved (`kind`: "dcp" or
    "manager"), resumed at (dp, tp) for the rest; the whole model."""
    half = STEPS // 2
    model, opt, dp_rank = _setup(2, 2)
    train(model, opt, dp_rank, range(half))
    model, opt, dp_rank = save_and_load(kind, path, model, opt, half, None, lambda _: _setup(dp, tp))
    train(model, opt, dp_rank, range(half, STEPS))
    return full(model.state_dict())


@pytest.mark.parametrize("kind", ["dcp", "manager"])
@pytest.mark.parametrize("dp, tp", [(2, 2), (4, 1)], ids=["dp2xtp2", "dp4xtp1"])
def test_saved_at_dp2_tp2_resumes_exactly(world, tmp_path, kind, dp, tp):
    # each tile's factors and roots under the full tensor's tile keys: any layout on the grid reads them
    want = reference(dp_after=dp)
    for got in world(4).run(_round_trip, str(tmp_path / "ckpt"), kind, dp, tp, timeout=120):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=k)


D4 = {**SHAMPOO, "max_preconditioner_dim": 4}  # the MLP's TP shards at tp2 and tp4 on the grid
# Inverse roots of near-singular factors (eigenvalues down to 1e-9 of 1e-6) scale the factors' last
# bits (the mean gradient summed in another order) by their condition number: 4e-4 measured; a
# root under another tile's key would be off by O(1)
ROOTS = 2e-3


def _full_round_trip(dp, tp):
    """STEPS/2 steps at dp2 x tp2 under MLP_PLAN (cut and replicated matrices), `opt.state_dict()`
    loaded into a fresh optimizer at (dp, tp), which trains the rest: the state dict saved, the
    one the loaded optimizer gives back, and the whole model at the end."""
    half = STEPS // 2
    model, opt, dp_rank = _setup(2, 2, MLP_PLAN, D4)
    train(model, opt, dp_rank, range(half))
    saved, weights = opt.state_dict(), full(model.state_dict())
    torch.distributed.barrier()
    model, opt, dp_rank = _setup(dp, tp, MLP_PLAN, D4, weights)
    opt.load_state_dict(saved)
    again = opt.state_dict()
    train(model, opt, dp_rank, range(half, STEPS))
    return saved["state"], again["state"], full(model.state_dict())


@pytest.mark.parametrize("dp, tp", [(2, 2), (4, 1), (1, 4)], ids=["dp2xtp2", "dp4xtp1", "dp1xtp4"])
def test_full_state_dict_under_tp_is_one_processs_and_resumes_exactly(world, dp, tp):
    # every parameter's full state and every tile's factors, keyed as the one-process reference
    # keys them, on every rank; loaded at another layout it gives back the same bits
    state, want = reference(opts=D4, steps=STEPS // 2), reference(dp_after=dp, opts=D4)
    results = world(4).run(_full_round_trip, dp, tp, timeout=120)
    for saved, again, got in results:
        assert sorted(saved) == [i for i, st in enumerate(state) if st is not None]
        for i, entry in saved.items():
            assert set(entry) == set(state[i]), (i, sorted(entry), sorted(state[i]))
            for key, v in entry.items():
                assert not isinstance(v, DTensor), (i, key)
                ref = torch.as_tensor(state[i][key]).double()
                torch.testing.assert_close(
                    v.double(),
                    ref,
                    rtol=ROOTS if "inv_root" in key else 1e-5,
                    atol=1e-6 * float(ref.abs().max()),
                    msg=f"{i} {key}",
                )
                assert torch.equal(v, results[0][0][i][key]), (i, key)  # the same on every rank
                assert torch.equal(again[i][key], v), (i, key)  # fp32 state bitwise after the load
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=k)


def _refused(block):
    world = mesh()
    model = parallelize_module(build(), world["tp"], PLAN)
    before = {n: p.to_local().clone() for n, p in model.named_parameters() if isinstance(p, DTensor)}
    try:
        vo.Shampoo(model.named_parameters(), mesh=world["dp"], **{**SHAMPOO, "max_preconditioner_dim": block})
    except NotImplementedError as e:
        same = all(torch.equal(model.get_parameter(n).to_local(), v) for n, v in before.items())
        return str(e), same
    return None, True


@pytest.mark.parametrize("block", [16, 6])
def test_a_tp_cut_off_the_tile_grid_is_refused_on_every_rank(world, block):
    # block 16: wq's 16 rows are one tile, cut in two by ColwiseParallel; block 6: 8-row shards
    for got, same in world(4).run(_refused, block):
        assert got is not None and "'wq.weight'" in got and f"max_preconditioner_dim={block}" in got, got
        assert "TP shard shape (8, 16)" in got and same, got


@pytest.mark.parametrize("shape, zero3", LAYOUTS, ids=IDS)
def test_matrices_replicated_over_tp_next_to_cut_ones_equal_one_process_each_tile_once(world, shape, zero3):
    # wq, wk, wv (plain) and wo (a Replicate DTensor): each of their tiles computed by one rank of
    # the dp x tp world, its update on every TP rank's copy; the MLP's tiles in their TP shards
    want = reference()
    results = world(4).run(_train, shape, zero3, MLP_PLAN)
    for t, n in enumerate(roots_per_step()):
        assert sum(roots[t] for _, roots in results) == n, (t, [roots for _, roots in results])
    for got, _ in results:
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=k)


def _sequence_parallel():
    """vo.Shampoo on the sequence-parallel plan (`_tp.SP_PLAN`: SequenceParallel norms, Replicate
    DTensors whose gradients arrive Partial): the whole model after its steps."""
    world = mesh(2, SP_TP)
    model = parallelize_module(build(SequenceParallelBlock), world["tp"], SP_PLAN)
    opt = vo.Shampoo(model.parameters(), mesh=world["dp"], **SHAMPOO)
    train_sequence_parallel(model, opt, world, range(STEPS))
    return full(model.state_dict())


def test_sequence_parallel_norms_next_to_tp_matrices_equal_one_process(world):
    model = build(SequenceParallelBlock)
    opt = ReferenceShampoo(list(model.parameters()), **SHAMPOO)
    for t in range(STEPS):
        mean_grad(model, t, 2, SP_SEQ)
        opt.step()
    for got in world(4).run(_sequence_parallel):
        for k, v in model.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-5, msg=k)
