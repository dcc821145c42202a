"""HSDP on a 2-D mesh (replicate x shard): the same numbers as one process fed the mean
gradient over all ranks, every matrix orthogonalized (and every Shampoo root computed)
once in the whole world, checkpoints across topologies, clear errors for bad meshes."""

import pytest
import torch
import torch.distributed as dist
from _fsdp_cases import SHAMPOO, STEPS, TOL, assert_equal, make_ours, reference, train_sharded
from _tiny_gpt import batch, build, loss_fn, train
from torch.distributed.device_mesh import init_device_mesh

import vescale_optim as vo

MESHES = {"2x2": (2, 2), "1x4": (1, 4), "4x1": (4, 1), "2x1": (2, 1)}


def _mesh(shape):
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _train(kind, shape, sharded=True, micro=1, accumulate="reduce", steps=STEPS, backward_prefetch=True):
    """`accumulate`: "reduce" (every micro-batch reduced everywhere), "no_sync" (kept whole
    until the last) or "no_all_reduce" (reduce-scattered, all-reduced across replicas last)."""
    units = {} if sharded else {"shard_modules": None}  # a unit per block and the root's, or ZeRO-2
    quiet = None if accumulate == "reduce" else accumulate
    return train_sharded(
        kind, steps, micro, quiet, mesh=_mesh(shape), backward_prefetch=backward_prefetch, **units
    )


@pytest.mark.parametrize("kind", ["adamw", "muon", "shampoo"])
@pytest.mark.parametrize("mesh", ["2x2", "1x4", "4x1"])
@pytest.mark.parametrize("sharded", [True, False], ids=["zero3", "zero2"])
def test_any_mesh_equals_one_process(world, kind, mesh, sharded):
    want = reference(kind, 4)
    results = world(4).run(_train, kind, MESHES[mesh], sharded)
    for got, _ in results:
        assert_equal(got, want, TOL[kind])
    if kind == "muon":  # every matrix once in the whole world, each step
        per_step = [sum(stats[t]["ns_matrices"] for _, stats in results) for t in range(STEPS)]
        assert per_step == [12] * STEPS  # 3 layers x (attn, proj, mlp.0, mlp.2)


@pytest.mark.parametrize("accumulate", ["reduce", "no_all_reduce"])
def test_2x2_without_backward_prefetch_equals_one_process(world, accumulate):
    want = reference("adamw", 4, micro=2)
    for got, _ in world(4).run(
        _train, "adamw", MESHES["2x2"], micro=2, accumulate=accumulate, backward_prefetch=False
    ):
        assert_equal(got, want, TOL["adamw"])


def test_two_replicas_of_one_rank_equal_one_process(world):
    want = reference("muon", 2)
    for got, _ in world(2).run(_train, "muon", MESHES["2x1"]):
        assert_equal(got, want, TOL["muon"])


@pytest.mark.parametrize("accumulate", ["no_sync", "no_all_reduce"])
@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_accumulation_modes_equal_one_process(world, kind, accumulate):
    want = reference(kind, 4, micro=2)
    for got, _ in world(4).run(_train, kind, MESHES["2x2"], True, 2, accumulate):
        assert_equal(got, want, TOL[kind])


def _overlap():
    """At each block's backward: how many units have an all-reduce across replicas in
    flight; after backward: whether any reduction is still pending; each step's bytes."""
    rank = dist.get_rank()
    model = build()
    opt = make_ours("adamw", model, mesh=_mesh((2, 2)), shard_modules=[*model.layers, model])
    in_flight, steps = [], []

    def probe(module, grad_output):
        in_flight.append(sum(u.grads.reducing_over_replicas for u in opt.units))

    for layer in model.layers:
        layer.register_full_backward_pre_hook(probe)
    for t in range(3):
        in_flight.clear()
        loss_fn(model, *batch(t, rank)).backward()
        pending = [u.name for u in opt.units if u.grads.has_full or u.grads.reducing_over_replicas]
        opt.step()
        opt.zero_grad()
        steps.append((list(in_flight), pending, opt.step_stats["bytes_sent"]))
    return steps


def test_all_reduces_across_replicas_overlap_backward_and_finish_in_it(world):
    for steps in world(4).run(_overlap):
        # the first step too (it learns the fixed order of the outermost unit's reduction, yet
        # reduces it in backward once complete: iteration 0 leaves averaged gradients as any other)
        for in_flight, pending, sent in steps:
            # block 2 reduces at the end of its backward; its all-reduce starts once that
            # finishes (seen in block 1's backward at the latest) and is waited at the end
            assert in_flight[0] == 0 and in_flight[2] >= 1, in_flight
            assert pending == [] and sent == 0, (pending, sent)


def _unsynced_gradient_bytes():
    """memory_stats' gradients after a micro-batch inside no_all_reduce() (second step:
    every unit reduces in backward), and one gradient shard per unit, in bytes."""
    rank = dist.get_rank()
    model = build()
    opt = make_ours("adamw", model, mesh=_mesh((2, 2)), shard_modules=[*model.layers, model])
    train(model, opt, range(1), rank)
    with opt.no_all_reduce():
        loss_fn(model, *batch(1, rank)).backward()
    return opt.memory_stats()["gradients"], sum(u.layout.shard_size * 4 for u in opt.units)


def test_gradients_kept_unsynced_across_replicas_are_counted(world):
    # zero_grad freed the gradient shards: what the no_all_reduce micro-batch left is the unsynced part
    for held, shards in world(4).run(_unsynced_gradient_bytes):
        assert held == shards > 0


def _roots(shape):
    _, stats = _train("shampoo", shape, True, steps=2)
    return [s["roots"] for s in stats]


def test_every_shampoo_root_is_computed_once_in_the_world(world):
    model = build()
    tiles = vo.Shampoo(model.parameters(), **SHAMPOO).num_tiles
    for shape in ("2x2", "4x1"):
        per_rank = world(4).run(_roots, MESHES[shape])
        # step 2 refreshes every root (precondition_frequency 2); step 1 none
        assert [sum(r[t] for r in per_rank) for t in range(2)] == [0, 2 * tiles]
        if shape == "2x2":
            assert sum(1 for r in per_rank if r[1]) >= 3  # the work is spread over the replicas


# --- checkpoints across topologies -------------------------------------------------------


def _opt_for(model, kind, shape):
    mesh = _mesh(shape) if shape is not None else None
    return make_ours(kind, model, mesh=mesh, shard_modules=[*model.layers, model])


def _save(path, kind, shape, steps):
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank() if dist.is_initialized() else 0
    model = build()
    opt = _opt_for(model, kind, shape)
    train(model, opt, range(steps), rank)
    dcp.save({"model": opt.sharded_model_state_dict(), "optim": opt.sharded_state_dict()}, checkpoint_id=path)
    return model.state_dict(), opt.state_dict()


def _load(path, kind, shape, steps=0, first=0, save_to=None):
    """Load `path` into a fresh model and optimizer on `shape` (None: 1-D over the world),
    optionally save again to `save_to`, train `steps` more, return state dicts."""
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank() if dist.is_initialized() else 0
    model = build(seed=5)
    opt = _opt_for(model, kind, shape)
    sd = {"model": opt.sharded_model_state_dict(), "optim": opt.sharded_state_dict()}
    dcp.load(sd, checkpoint_id=path)
    opt.load_sharded_model_state_dict(sd["model"])
    opt.load_sharded_state_dict(sd["optim"])
    loaded = (model.state_dict(), opt.state_dict())
    if save_to is not None:
        dcp.save(
            {"model": opt.sharded_model_state_dict(), "optim": opt.sharded_state_dict()},
            checkpoint_id=save_to,
        )
    train(model, opt, range(first, first + steps), rank)
    return loaded, {k: v.clone() for k, v in model.state_dict().items()}


def _same(loaded, saved):
    (model_sd, opt_sd), (want_model, want_opt) = loaded, saved
    for k, v in want_model.items():
        assert torch.equal(model_sd[k], v), k
    for i, st in want_opt["state"].items():
        for k, v in st.items():
            assert torch.equal(opt_sd["state"][i][k], v), (i, k)


@pytest.mark.parametrize("kind", ["adamw", "muon", "shampoo"])
def test_a_2x2_checkpoint_loads_at_3_and_continues_exactly(world, tmp_path, kind):
    path = str(tmp_path / "ckpt")
    saved = world(4).run(_save, path, kind, MESHES["2x2"], 2)[0]
    loaded, after = world(3).run(_load, path, kind, None, 2, 2)[0]
    _same(loaded, saved)
    # the same as continuing at 3 from the 2x2 run's state dicts (torch format)
    straight = world(3).run(_continue_from_full, kind, saved, 2)[0]
    for k, v in straight.items():
        assert torch.equal(after[k], v), k


def _continue_from_full(kind, saved, first):
    rank = dist.get_rank()
    model = build(seed=5)
    opt = _opt_for(model, kind, None)
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    train(model, opt, range(first, first + 2), rank)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_2x2_to_one_process_and_back_continues_exactly(world, tmp_path):
    first, again = str(tmp_path / "first"), str(tmp_path / "again")
    saved = world(4).run(_save, first, "muon", MESHES["2x2"], 2)[0]
    loaded, _ = world(1).run(_load, first, "muon", None, 0, 0, again)[0]  # one process: load, save
    _same(loaded, saved)
    direct = world(4).run(_load, first, "muon", MESHES["2x2"], 2, 2)
    through_one = world(4).run(_load, again, "muon", MESHES["2x2"], 2, 2)
    for (_, a), (_, b) in zip(direct, through_one):
        for k in a:
            assert torch.equal(a[k], b[k]), k


def _state_dict_on(shape, full):
    model = build()
    opt = _opt_for(model, "muon", shape)
    model.load_state_dict(full[0])
    opt.load_state_dict(full[1])
    return opt.state_dict()


def test_the_torch_format_state_dict_does_not_depend_on_the_mesh(world, tmp_path):
    saved = world(4).run(_save, str(tmp_path / "c"), "muon", MESHES["2x2"], 2)[0]
    for shape in ("1x4", "4x1", "2x2"):
        got = world(4).run(_state_dict_on, MESHES[shape], saved)[0]
        for i, st in saved[1]["state"].items():
            assert st.keys() == got["state"][i].keys()
            for k, v in st.items():
                assert torch.equal(got["state"][i][k], v), (shape, i, k)


# --- bad meshes ------------------------------------------------------------------------------


def _bad_mesh(case):
    model = build()
    if case == "3-D":
        mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "replicate", "shard"))
        match = "mesh has 3 dimensions"
    elif case == "not the world":
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh("cpu", torch.arange(2).view(1, 2), mesh_dim_names=("replicate", "shard"))
        match = "do not tile the world"
    else:
        mesh = _mesh((2, 2))
        match = "pass either mesh= or process_group="
        with pytest.raises(ValueError, match=match):
            vo.AdamW(model.parameters(), mesh=mesh, process_group=dist.group.WORLD)
        return True
    with pytest.raises(ValueError, match=match):
        vo.AdamW(model.parameters(), mesh=mesh)
    return True


@pytest.mark.parametrize("case", ["3-D", "not the world", "both"])
def test_bad_meshes_are_refused(world, case):
    assert world(4).run(_bad_mesh, case, timeout=60) == [True] * 4
