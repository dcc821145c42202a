"""Shampoo over a tensor-parallel model (dp2 x tp2 on 4 gloo ranks): torch's TP plan on
world["tp"], vo.Shampoo on world["dp"]. With the TP cuts on the tile grid every tile of a full
matrix lies inside one TP shard, so each TP rank's tiles of its shard are the full tensor's,
computed once in the world by their data-parallel owners: the same numbers as the one-process
reference on the unparallelised model fed the mean gradient. Cuts off the grid are refused."""

import pytest
import torch
from _reference import mean_grad_reference
from _shampoo_reference import ReferenceShampoo, tile_slices
from test_fsdp import SHAMPOO
from test_tensor_parallel import PLAN, _batch, _build, _full, _loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import vescale_optim as vo

pytestmark = pytest.mark.slow

STEPS = 4  # roots refreshed at steps 2 and 4 (precondition_frequency=2)
D = SHAMPOO["max_preconditioner_dim"]  # 8: every TP shard of the block (8 or 16 rows / columns) on the grid


def reference(dp=2):
    """One process, the unparallelised model, the reference Shampoo on the mean gradient over dp."""
    model = _build()
    opt = ReferenceShampoo(list(model.parameters()), **SHAMPOO)
    for t in range(STEPS):
        mean_grad_reference(model.parameters(), dp, lambda r, t=t: _loss(model, *_batch(t, r)).backward())
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _roots_per_step() -> list[int]:
    """Inverse roots of the full model's tiles each step: two per tile where roots refresh."""
    tiles = sum(len(tile_slices(p.shape[0], p[0].numel(), D)) for p in _build().parameters() if p.ndim >= 2)
    return [2 * tiles if (t + 1) % SHAMPOO["precondition_frequency"] == 0 else 0 for t in range(STEPS)]


def _train(zero3):
    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(_build(), world["tp"], PLAN)
    units = dict(shard_modules=[*(getattr(model, n) for n in PLAN), model]) if zero3 else {}
    opt = vo.Shampoo(model.parameters(), mesh=world["dp"], **units, **SHAMPOO)
    dp_rank = world["dp"].get_local_rank()
    roots = []
    for t in range(STEPS):
        _loss(model, *_batch(t, dp_rank)).backward()
        opt.step()
        opt.zero_grad()
        roots.append(opt.step_stats["roots"])
    assert all(isinstance(getattr(model, n).weight, DTensor) for n in PLAN)
    return _full(model.state_dict()), roots


@pytest.mark.parametrize("zero3", [False, True], ids=["zero2", "zero3"])
def test_dp2_tp2_shampoo_equals_one_process_each_tile_once(world, zero3):
    want = reference()
    results = world(4).run(_train, zero3)
    for t, n in enumerate(_roots_per_step()):  # each tile's roots computed once in the world
        assert sum(roots[t] for _, roots in results) == n, (t, [roots for _, roots in results])
    for got, _ in results:
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=k)


def _refused(block, plain):
    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(_build(), world["tp"], PLAN)
    before = {n: p.to_local().clone() for n, p in model.named_parameters() if isinstance(p, DTensor)}
    params = [
        *model.named_parameters(),
        *([("extra", torch.nn.Parameter(torch.ones(8, 8)))] if plain else []),
    ]
    try:
        vo.Shampoo(params, mesh=world["dp"], **{**SHAMPOO, "max_preconditioner_dim": block})
    except NotImplementedError as e:
        same = all(torch.equal(model.get_parameter(n).to_local(), v) for n, v in before.items())
        return str(e), same
    return None, True


@pytest.mark.parametrize("block", [16, 6])
def test_a_tp_cut_off_the_tile_grid_is_refused_on_every_rank(world, block):
    # block 16: wq's 16 rows are one tile, cut in two by ColwiseParallel; block 6: 8-row shards
    for got, same in world(4).run(_refused, block, False):
        assert got is not None and "'wq.weight'" in got and f"max_preconditioner_dim={block}" in got, got
        assert "TP shard shape (8, 16)" in got and same, got


def test_a_matrix_replicated_over_tp_next_to_cut_ones_is_refused_on_every_rank(world):
    # every TP rank would compute its tiles again: not once in the world
    for got, same in world(4).run(_refused, D, True):
        assert got is not None and "'extra'" in got and "replicated over TP" in got and same, got
