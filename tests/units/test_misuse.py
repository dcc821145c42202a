"""Misuse that used to give a silent wrong value, a hang or an unnamed error: each ends in a
named error on every rank, before anything changes (issue: never a silent wrong value).

- `mesh=` that is not a `DeviceMesh`, a `shard_modules` entry holding none of the parameters;
- `shard_modules` that differ between ranks (one rank used to pass, the other time out);
- a second optimizer over parameters another one already shards (its weights became NaN);
- `lr` changed on one rank only (each rank's shard used to step with its own lr).
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.distributed as dist
from _small_model import small_loss, small_model

import vescale_optim as vo


def _stepped_once():
    """This rank, a model sharded by units [model[0], model], and its optimizer after one step."""
    rank = _rank()
    model = small_model()
    opt = vo.AdamW(model.parameters(), lr=0.01, shard_modules=[model[0], model])
    small_loss(model, 0, rank).backward()
    opt.step()
    opt.zero_grad()
    return rank, model, opt


def _rank():
    return dist.get_rank() if dist.is_initialized() else 0


def test_a_mesh_that_is_not_a_device_mesh_is_a_type_error():
    with pytest.raises(TypeError, match="mesh must be a torch.distributed.device_mesh.DeviceMesh.*str 'cpu'"):
        vo.AdamW(small_model().parameters(), mesh="cpu")
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        vo.AdamW(small_model().parameters(), process_group="gloo")


def test_a_shard_modules_entry_without_the_optimizers_parameters_is_refused():
    model, other = small_model(), torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match=r"shard_modules\[1\] \(Linear\) holds none of the optimizer's"):
        vo.AdamW(model.parameters(), shard_modules=[model[0], other, model])


def _differing_shard_modules():
    model = small_model()
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
    rank, model, opt = _stepped_once()
    with pytest.raises(ValueError, match=r"#0 of param group 0 \(shape \(8, 6\)\) is already sharded by"):
        vo.AdamW(model.parameters(), lr=0.01, shard_modules=[model[0], model])
    small_loss(model, 1, rank).backward()  # the first optimizer goes on as if nothing happened
    opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_second_optimizer_over_sharded_parameters_is_refused_and_the_first_goes_on(world):
    from _reference import mean_grad_reference

    model = small_model()
    ref = torch.optim.AdamW(model.parameters(), lr=0.01)
    for t in range(2):
        mean_grad_reference(model.parameters(), 2, lambda r, t=t: small_loss(model, t, r).backward())
        ref.step()
    for got in world(2).run(_second_optimizer, timeout=60):
        for k, v in model.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-7, msg=k)  # AdamW's rounding only


def _lr_on_one_rank(sharded):
    rank = _rank()
    model = small_model()
    opt = vo.AdamW(model.parameters(), lr=0.01, shard_modules=[model[0], model] if sharded else None)
    small_loss(model, 0, rank).backward()
    opt.step()
    opt.zero_grad()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if rank == 1:
        opt.param_groups[0]["lr"] = 0.02
    small_loss(model, 1, rank).backward()
    with pytest.raises(RuntimeError, match=r"param group 0: 'lr' is 0.02 on rank 1 but 0.01 on rank 0"):
        opt.step()
    unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    opt.param_groups[0]["lr"] = 0.01  # agreed again: the step goes through
    opt.step()
    return unchanged, any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("sharded", [False, True], ids=["zero2", "zero3"])
def test_an_lr_changed_on_one_rank_only_is_refused_on_every_rank(world, sharded):
    assert world(2).run(_lr_on_one_rank, sharded, timeout=60) == [(True, True)] * 2


# --- with opt.gathered(): whole parameters between steps -------------------------------------


def _ema_and_init(steps, sharded, ref_model=None):
    """Per step: backward, step, then inside `gathered()` an EMA over `model.parameters()`
    and (after step 1) an `nn.init` of the last layer; `ref_model` (one process, torch's
    AdamW fed the mean gradient) does the same with its plain parameters."""
    rank = _rank()
    model = ref_model if ref_model is not None else small_model()
    if ref_model is not None:
        from _reference import mean_grad_reference

        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        whole = contextlib.nullcontext
    else:
        opt = vo.AdamW(model.parameters(), lr=0.01, shard_modules=[model[0], model] if sharded else None)
        whole = opt.gathered
    ema = None
    for t in range(steps):
        if ref_model is not None:
            mean_grad_reference(model.parameters(), 2, lambda r, t=t: small_loss(model, t, r).backward())
        else:
            small_loss(model, t, rank).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad(), whole():
            if ema is None:
                ema = [p.detach().clone() for p in model.parameters()]
            for e, p in zip(ema, model.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)
            if t == 1:
                torch.nn.init.zeros_(model[2].bias)
                torch.nn.init.constant_(model[2].weight, 0.05)
    return ema, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("sharded", [False, True], ids=["zero2", "zero3"])
def test_an_ema_and_an_init_inside_gathered_match_the_unsharded_run(world, sharded):
    ema, state = _ema_and_init(4, sharded, ref_model=small_model())
    for got_ema, got_state in world(2).run(_ema_and_init, 4, sharded, timeout=60):
        for a, b in zip(got_ema, ema):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for k, v in state.items():
            torch.testing.assert_close(got_state[k], v, rtol=1e-6, atol=1e-7, msg=k)


def _pieces(opt, model):
    """Each parameter's piece of its unit's shard (the fp32 master of a bf16 parameter), cloned,
    by its name in `model`."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for u in opt.units:
        for i, p in enumerate(u.params):
            lo, hi = u.full.local_range(i)
            out[names[id(p)]] = u.shard[lo:hi].clone()
    return out


def _masters_kept(gather_bits, sharded):
    """bf16 parameters over fp32 masters: a write inside `gathered()` reaches the written
    parameter's master; every other master keeps all its bits (none is rounded to bf16)."""
    model = small_model().bfloat16()
    units = [model[0], model] if sharded else None
    opt = vo.AdamW(model.parameters(), lr=0.01, shard_modules=units, gather_bits=gather_bits)
    model(torch.randn(4, 6, generator=torch.Generator().manual_seed(_rank())).bfloat16()).sum().backward()
    opt.step()
    opt.zero_grad()
    before = _pieces(opt, model)
    with torch.no_grad(), opt.gathered():
        model[2].weight.fill_(0.5)
        norm = float(model[0].weight.float().norm())
    after = _pieces(opt, model)
    kept = {k: torch.equal(before[k], v) for k, v in after.items() if v.numel()}  # this rank's pieces
    name = "2.weight"
    written = bool((after[name] == 0.5).all()) and bool((model.state_dict()["2.weight"] == 0.5).all())
    return kept, name, written, norm


@pytest.mark.parametrize("gather_bits", [None, 8], ids=["bf16", "8bit"])
@pytest.mark.parametrize("sharded", [False, True], ids=["zero2", "zero3"])
def test_a_write_inside_gathered_reaches_its_master_and_leaves_others_unrounded(world, gather_bits, sharded):
    norms = set()
    for kept, name, written, norm in world(2).run(_masters_kept, gather_bits, sharded, timeout=60):
        assert written
        assert kept and kept == {k: k != name for k in kept}, kept
        norms.add(norm)
    assert len(norms) == 1 and all(n > 0 for n in norms)  # the same whole parameter on every rank


def _subset_and_discard():
    rank, model, opt = _stepped_once()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad(), opt.gathered(model[0]):
        states = [u.state.value for u in opt.units]
        model[0].weight.add_(1.0)
    with torch.no_grad(), opt.gathered(writeback=False):
        model[2].weight.zero_()
        out = model(torch.ones(1, 6))  # a forward inside keeps the units gathered
        still = [u.state.value for u in opt.units]
    after = model.state_dict()
    added = torch.equal(after["0.weight"], before["0.weight"] + 1)
    discarded = torch.equal(after["2.weight"], before["2.weight"])
    return states, still, bool(torch.isfinite(out).all()), added, discarded, opt.memory_stats()["unsharded"]


def test_gathered_takes_modules_and_discards_writes_without_writeback(world):
    for states, still, finite, added, discarded, unsharded in world(2).run(_subset_and_discard, timeout=60):
        assert states == ["gathered", "resharded"] and still == ["gathered", "gathered"]
        assert finite and added and discarded and unsharded == 0


# --- a resharded parameter refuses to be misread or miswritten --------------------------------


def _misreads():
    """Every misuse between steps on a sharded model: the error each raises (its type and
    message), then what still reads right."""
    import copy

    rank, model, opt = _stepped_once()
    w, ema = model[0].weight, [torch.zeros(q.shape) for q in model.parameters()]
    cases = {
        "ema": lambda: [e.mul_(0.9).add_(q, alpha=0.1) for e, q in zip(ema, model.parameters())],
        "norm": lambda: w.norm(),
        "l2": lambda: sum(q.square().sum() for q in model.parameters()),
        "deepcopy": lambda: copy.deepcopy(model),
        "children": lambda: model[2](model[1](model[0](torch.randn(2, 6)))),
        "zeros_": lambda: torch.nn.init.zeros_(model[2].bias),
        "data.mul_": lambda: model[2].weight.data.mul_(2),
        "copy_": lambda: w.detach().copy_(torch.ones(8, 6)),
        "double": lambda: model.double(),
    }
    errors = {}
    for name, case in cases.items():
        try:
            with torch.no_grad():
                case()
            errors[name] = None
        except Exception as e:  # noqa: BLE001 (the outcome is what the test compares)
            errors[name] = (type(e).__name__, str(e))
    own = len({q.data_ptr() for q in model.parameters()}) == len(list(model.parameters()))
    meta = (tuple(w.shape), w.dtype, w.device.type, w.requires_grad, w.is_leaf, w.numel(), w.dim())
    like = [torch.zeros_like(w), torch.full_like(w, 2.0), w.new_zeros(3)]  # shaped like it: no value read
    assert [type(t) for t in like] == [torch.Tensor] * 3
    assert like[1].shape == (8, 6) and bool((like[1] == 2).all())
    small_loss(model, 1, rank).backward()  # the model still trains, and torch's clipping reads .grad
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    opt.step()
    return errors, own, meta, norm, {k: v.clone() for k, v in model.state_dict().items()}


def test_a_resharded_parameter_refuses_reads_and_writes_by_name(world):
    from _reference import mean_grad_reference

    model = small_model()
    ref = torch.optim.AdamW(model.parameters(), lr=0.01)
    norms = []
    for t in range(2):
        mean_grad_reference(model.parameters(), 2, lambda r, t=t: small_loss(model, t, r).backward())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        ref.step()
    for errors, own, meta, norm, state in world(2).run(_misreads, timeout=60):
        for name, err in errors.items():
            assert err is not None, f"{name}: no error"
            kind, message = err
            assert kind == "ReshardedParameterError", (name, kind, message)
            named = r"parameter '[02]\.(weight|bias)' \(shape \(\d+,( \d+)?\)\) is resharded"
            assert re.search(named, message), message
            assert "model.state_dict()" in message and "opt.gathered()" in message and "model(x)" in message
        assert own and meta == ((8, 6), torch.float32, "cpu", True, True, 48, 2)
        assert norm == pytest.approx(norms[1], rel=1e-5)
        for k, v in model.state_dict().items():  # nothing refused changed a value
            torch.testing.assert_close(state[k], v, rtol=1e-6, atol=1e-7, msg=k)


def _stale_graph(sharded):
    rank = _rank()
    model = small_model()
    opt = vo.AdamW(model.parameters(), lr=0.01, shard_modules=[model[0], model] if sharded else None)
    old = small_loss(model, 0, rank)  # a graph built before the step
    small_loss(model, 1, rank).backward()
    opt.step()
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        old.backward()
    opt.zero_grad()
    small_loss(model, 2, rank).backward()  # a graph built after it is fine
    opt.step()
    return True


@pytest.mark.parametrize("sharded", [False, True], ids=["zero2", "zero3"])
def test_a_backward_through_a_graph_from_before_the_step_raises_as_in_torch(world, sharded):
    model = small_model()
    old = small_loss(model, 0, 0)
    small_loss(model, 1, 0).backward()
    torch.optim.AdamW(model.parameters(), lr=0.01).step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        old.backward()  # torch's behaviour, which the library's matches
    assert world(2).run(_stale_graph, sharded, timeout=60) == [True, True]


def _grad_at_iteration_0():
    rank = _rank()
    model = small_model()
    vo.AdamW(model.parameters(), lr=0.01, shard_modules=[model[0], model])
    small_loss(model, 0, rank).backward()
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def test_grad_at_iteration_0_is_the_averaged_gradient_of_every_unit(world):
    from _reference import mean_grad_reference

    model = small_model()
    mean_grad_reference(model.parameters(), 2, lambda r: small_loss(model, 0, r).backward())
    for got in world(2).run(_grad_at_iteration_0, timeout=60):
        for n, p in model.named_parameters():
            torch.testing.assert_close(got[n], p.grad, rtol=1e-6, atol=1e-7, msg=n)


def _no_sync_on_one_rank(micro: int):
    """`micro` backward passes, all inside `no_sync()` on rank 0 only (a group of its own):
    every rank raises the named error in the first backward, before any reduce-scatter, the
    weights unchanged (`test_no_sync_agreement.py`: every micro-batch, ZeRO-2, host syncs)."""
    rank = _rank()
    model = small_model()
    group = dist.new_group([0, 1])
    opt = vo.AdamW(model.parameters(), lr=0.01, shard_modules=[model[0], model], process_group=group)
    shards = [u.shard.clone() for u in opt.runtime.units]
    named = r"ranks \[0\] ran a backward inside .*no_sync.* ranks \[1\] did not"
    with pytest.raises(vo.NoSyncMismatchError, match=named):
        for m in range(micro):
            with opt.no_sync() if rank == 0 else contextlib.nullcontext():
                small_loss(model, m, rank).backward()
        opt.step()
    return bool(shards) and all(torch.equal(s, u.shard) for s, u in zip(shards, opt.runtime.units))


@pytest.mark.parametrize("micro", [1, 2])
def test_no_sync_on_one_rank_only_raises_on_every_rank(world, micro):
    assert world(2).run(_no_sync_on_one_rank, micro, timeout=60) == [True, True]
