"""Misuse that used to give a silent wrong value, a hang or an unnamed error: each ends in a
named error on every rank, before anything changes (issue: never a silent wrong value).

- `mesh=` that is not a `DeviceMesh`, a `shard_modules` entry holding none of the parameters;
- `shard_modules` that differ between ranks (one rank used to pass, the other time out);
- a second optimizer over parameters another one already shards (its weights became NaN);
- `lr` changed on one rank only (each rank's shard used to step with its own lr).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import vescale_optim as vo


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _loss(model, t, rank):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * t + rank))
    return model(x).square().mean()


def _rank():
    return dist.get_rank() if dist.is_initialized() else 0


def test_a_mesh_that_is_not_a_device_mesh_is_a_type_error():
    with pytest.raises(TypeError, match="mesh must be a torch.distributed.device_mesh.DeviceMesh.*str 'cpu'"):
        vo.AdamW(_model().parameters(), mesh="cpu")
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        vo.AdamW(_model().parameters(), process_group="gloo")


def test_a_shard_modules_entry_without_the_optimizers_parameters_is_refused():
    model, other = _model(), torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match=r"shard_modules\[1\] \(Linear\) holds none of the optimizer's"):
        vo.AdamW(model.parameters(), shard_modules=[model[0], other, model])


def _differing_shard_modules():
    model = _model()
    units = [model[0], model] if _rank() == 0 else [model[2], model]
    with pytest.raises(ValueError, match="unit 0 differs between rank 0 .* and rank 1 .*shard_modules"):
        vo.AdamW(model.parameters(), shard_modules=units)
    counted = [model] if _rank() == 0 else [model[0], model]
    with pytest.raises(ValueError, match="rank 1 split the parameters into 2 units, rank 0 into 1"):
        vo.AdamW(model.parameters(), shard_modules=counted)
    return True


def test_shard_modules_that_differ_between_ranks_raise_on_every_rank(world):
    assert world(2).run(_differing_shard_modules, timeout=60) == [True, True]


def _second_optimizer():
    rank = _rank()
    model = _model()
    opt = vo.AdamW(model.parameters(), lr=0.01, shard_modules=[model[0], model])
    _loss(model, 0, rank).backward()
    opt.step()
    opt.zero_grad()
    with pytest.raises(ValueError, match=r"#0 of param group 0 \(shape \(8, 6\)\) is already sharded by"):
        vo.AdamW(model.parameters(), lr=0.01, shard_modules=[model[0], model])
    _loss(model, 1, rank).backward()  # the first optimizer goes on as if nothing happened
    opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_second_optimizer_over_sharded_parameters_is_refused_and_the_first_goes_on(world):
    from _reference import mean_grad_reference

    model = _model()
    ref = torch.optim.AdamW(model.parameters(), lr=0.01)
    for t in range(2):
        mean_grad_reference(model.parameters(), 2, lambda r, t=t: _loss(model, t, r).backward())
        ref.step()
    for got in world(2).run(_second_optimizer, timeout=60):
        for k, v in model.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-7, msg=k)  # AdamW's rounding only


def _lr_on_one_rank(sharded):
    rank = _rank()
    model = _model()
    opt = vo.AdamW(model.parameters(), lr=0.01, shard_modules=[model[0], model] if sharded else None)
    _loss(model, 0, rank).backward()
    opt.step()
    opt.zero_grad()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if rank == 1:
        opt.param_groups[0]["lr"] = 0.02
    _loss(model, 1, rank).backward()
    with pytest.raises(RuntimeError, match=r"param group 0: 'lr' is 0.02 on rank 1 but 0.01 on rank 0"):
        opt.step()
    unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    opt.param_groups[0]["lr"] = 0.01  # agreed again: the step goes through
    opt.step()
    return unchanged, any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("sharded", [False, True], ids=["zero2", "zero3"])
def test_an_lr_changed_on_one_rank_only_is_refused_on_every_rank(world, sharded):
    assert world(2).run(_lr_on_one_rank, sharded, timeout=60) == [(True, True)] * 2
