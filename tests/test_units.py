"""Units and their schedule on their own: plain SGD on the shards equals one process."""

import pytest
import torch
import torch.distributed as dist
from _tiny_gpt import batch, build, loss_fn

from vescale_optim.shard import Comm, plan_layout
from vescale_optim.units import State, Unit
from vescale_optim.units.assign import assign_units
from vescale_optim.units.schedule import Schedule

LR = 0.1


def make_units(model, shard_modules, comm, sharded=True, param_dtype=None):
    params = list(model.parameters())
    if shard_modules is None:
        groups, modules = [list(range(len(params)))], [None]
        names = {i: str(i) for i in range(len(params))}
    else:
        unit_of, listed, names = assign_units(params, shard_modules)
        order = sorted(set(unit_of), key=unit_of.index)
        groups = [[i for i, u in enumerate(unit_of) if u == k] for k in order]
        modules = [listed[k] for k in order]
    units = []
    for idx in groups:
        ps = [params[i] for i in idx]
        layout = plan_layout([p.numel() for p in ps], [1] * len(ps), comm.world_size, 4)
        units.append(Unit(ps, [names[i] for i in idx], layout, comm, index=len(units),
                          name=str(len(units)), sharded=sharded, param_dtype=param_dtype))  # fmt: skip
    return units, modules


def reference(world, steps, micro=1, **kwargs):
    model = build(**kwargs)
    for t in range(steps):
        for p in model.parameters():
            p.grad = None
        for r in range(world):
            for m in range(micro):
                (loss_fn(model, *batch(t, r, m)) / (world * micro)).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(LR * p.grad)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _train(steps, mode, micro=1, no_sync=False, reshard=True, checkpoint=False):
    comm = Comm()
    model = build(checkpoint=checkpoint)
    shard_modules = None if mode == "zero2" else [*model.layers, model]
    units, modules = make_units(model, shard_modules, comm, sharded=mode == "zero3")
    sched = Schedule(units, modules, reshard_after_forward=reshard)
    peak = []

    def probe(module, args):
        peak.append(sum(u.state is not State.RESHARDED for u in units if u.sharded))

    for layer in model.layers:
        layer.register_forward_pre_hook(probe)
    for t in range(steps):
        for m in range(micro):
            if no_sync and m < micro - 1:
                with sched.no_sync():
                    (loss_fn(model, *batch(t, comm.rank, m)) / micro).backward()
            else:
                (loss_fn(model, *batch(t, comm.rank, m)) / micro).backward()
        sched.finish()
        for u in units:
            u.shard.sub_(LR * u.grad)
            u.clear_grad()
            u.gather_after_step()
        between = [u.transient_bytes() for u in units]
        assert all(b == 0 for b in between) if mode == "zero3" else True, between
    for u in units:
        u.unshard(async_op=False)
    out = {k: v.clone() for k, v in model.state_dict().items()}
    return out, max(peak)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("mode", ["zero3", "zero2"])
def test_sgd_on_shards_equals_one_process(world, world_size, mode):
    results = world(world_size).run(_train, 3, mode)
    want = reference(world_size, 3)
    for got, peak in results:
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
        if mode == "zero3":
            assert peak <= 3  # the root, the running layer and the prefetched one


@pytest.mark.parametrize("case", [dict(reshard=False), dict(micro=2), dict(micro=3, no_sync=True),
                                  dict(checkpoint=True)])  # fmt: skip
def test_variants(world, case):
    results = world(3).run(_train, 2, "zero3", **case)
    want = reference(3, 2, micro=case.get("micro", 1), checkpoint=case.get("checkpoint", False))
    for got, _ in results:
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_ranks_agree_and_world_matches(world):
    sizes = world(2).run(dist.get_world_size)
    assert sizes == [2, 2]
