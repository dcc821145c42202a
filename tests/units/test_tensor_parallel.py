"""Data-parallel sharding of a tensor-parallel model (dp2 x tp2 on 4 gloo ranks): torch's own
TP plan on world["tp"], vo.AdamW on world["dp"]; the same numbers as one process fed the mean
gradient, step for step as FSDP2 after the same plan, DTensor parameters and state dicts kept,
and named errors for what is not supported."""

import pytest
import torch
from _tp import (
    ADAMW,
    DIM,
    PLAN,
    PROJECTIONS,
    STEPS,
    WIDE,
    WIDE_PLAN,
    Wide,
    adamw_reference,
    batch,
    build,
    full,
    local,
    loss,
    mesh,
    placements,
    replicated_mesh,
    train,
)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

import vescale_optim as vo
from vescale_optim.units import ReducedGrad

pytestmark = pytest.mark.slow


def _train(kind, steps=STEPS, clip=None):
    world = mesh()
    model = parallelize_module(build(), world["tp"], PLAN)
    before = placements(model)
    if kind == "ours":
        opt = vo.AdamW(model.parameters(), mesh=world["dp"], **ADAMW)
    else:  # FSDP2 after the same plan
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=world["dp"])
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    dp_rank = world["dp"].get_local_rank()
    per_step = []
    for t in range(steps):
        loss(model, *batch(t, dp_rank)).backward()
        norm = opt.clip_grad_norm_(clip) if clip is not None else None
        opt.step()
        opt.zero_grad()
        per_step.append(full(model.state_dict()))
        if norm is not None:
            per_step[-1]["norm"] = full({"norm": norm})["norm"]
    if kind == "ours":
        assert placements(model) == before  # DTensors with their TP placements after every step
        assert all(isinstance(model.get_parameter(n), DTensor) == (p is not None) for n, p in before.items())
    return per_step


def test_dp2_tp2_adamw_equals_one_process(world):
    want = adamw_reference()
    for got in world(4).run(_train, "ours"):
        for k in want:
            torch.testing.assert_close(got[-1][k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_dp2_tp2_adamw_equals_fsdp2_step_for_step(world):
    ours, theirs = world(4).run(_train, "ours"), world(4).run(_train, "fsdp2")
    for a, b in zip(ours, theirs):
        for t in range(STEPS):
            for k in b[t]:
                torch.testing.assert_close(a[t][k], b[t][k], rtol=1e-5, atol=1e-6, msg=f"step {t}: {k}")


def _local_views_and_state():
    """The parameters' local tensors are the unit's memory; .grad reads as a DTensor of the same
    placements; the state dicts round trip."""
    world = mesh()
    model = parallelize_module(build(), world["tp"], PLAN)
    opt = vo.AdamW(model.parameters(), mesh=world["dp"], **ADAMW)
    unit = opt.units[0]
    base = unit.full.data.untyped_storage().data_ptr()
    for p in model.parameters():
        assert local(p).untyped_storage().data_ptr() == base  # zero copy: a view of the unit's buffer
    dp_rank = world["dp"].get_local_rank()
    loss(model, *batch(0, dp_rank)).backward()
    grads = {
        n: (type(p.grad), tuple(p.grad.placements))
        for n, p in model.named_parameters()
        if isinstance(p, DTensor)
    }
    opt.step()
    opt.zero_grad()
    sd = model.state_dict()
    kinds = {k: tuple(v.placements) if isinstance(v, DTensor) else None for k, v in sd.items()}
    saved = opt.state_dict()
    model2 = parallelize_module(build(), world["tp"], PLAN)
    opt2 = vo.AdamW(model2.parameters(), mesh=world["dp"], **ADAMW)
    model2.load_state_dict(sd)
    opt2.load_state_dict(saved)
    for t in (1, 2):
        for m, o in ((model, opt), (model2, opt2)):
            loss(m, *batch(t, dp_rank)).backward()
            o.step()
            o.zero_grad()
    same = all(
        torch.equal(local(a), local(b))
        for a, b in zip(model.state_dict().values(), model2.state_dict().values())
    )
    return grads, kinds, same


def test_local_tensors_are_views_and_state_dicts_round_trip(world):
    for grads, kinds, same in world(4).run(_local_views_and_state):
        assert {k: v[1] for k, v in grads.items()} == {
            **{f"{n}.weight": (Shard(0),) for n in ("wq", "wk", "wv", "w1", "w3")},
            **{f"{n}.weight": (Shard(1),) for n in ("wo", "w2")},
        }
        # not a DTensor instance: a ReducedGrad that reads as one (global shape, placements, to_local)
        assert all(issubclass(t, ReducedGrad) for t, _ in grads.values())
        assert kinds["wq.weight"] == (Shard(0),) and kinds["w2.weight"] == (Shard(1),)
        assert kinds["norm1.weight"] is None  # not parallelised: a plain tensor, as without the optimizer
        assert same


def _refused(case):
    world = mesh()
    model = parallelize_module(build(), world["tp"], PLAN)
    if case == "unrelated mesh":
        other = init_device_mesh("cpu", (4,))  # spans the dp ranks too
        weight = distribute_tensor(model.norm1.weight.detach(), other, [Replicate()])
        model.norm1.weight = nn.Parameter(weight)
        make = lambda: vo.AdamW(model.parameters(), mesh=world["dp"])  # noqa: E731
    elif case == "partial":
        local = model.norm1.weight.detach().clone()
        model.norm1.weight = nn.Parameter(DTensor.from_local(local, world["tp"], [Partial()]))
        make = lambda: vo.AdamW(model.parameters(), mesh=world["dp"])  # noqa: E731
    elif case == "no mesh":
        make = lambda: vo.AdamW(model.parameters())  # noqa: E731
    elif case == "muon":
        groups = [{"params": [model.wq.weight], "split_sizes": (6, 10)}]  # ColwiseParallel cuts a block
        make = lambda: vo.Muon(groups, mesh=world["dp"], normuon=True)  # noqa: E731
    else:
        make = lambda: vo.Shampoo(model.parameters(), mesh=world["dp"])  # noqa: E731
    wq = model.wq.weight.to_local().clone()
    try:
        make()
    except (ValueError, NotImplementedError) as e:
        assert torch.equal(model.wq.weight.to_local(), wq)  # nothing changed
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize(
    "case, error, words",
    [
        ("unrelated mesh", "ValueError", "not orthogonal to the data-parallel mesh"),
        ("partial", "ValueError", "Partial placement"),
        ("no mesh", "ValueError", "pass the data-parallel mesh as mesh="),
        ("muon", "NotImplementedError", "cuts a block of split_sizes / num_heads"),
        ("shampoo", "NotImplementedError", "Shampoo under tensor parallelism needs every tile"),
    ],
)
def test_what_cannot_be_sharded_is_refused_on_every_rank(world, case, error, words):
    for got in world(4).run(_refused, case):
        assert got is not None and got[0] == error and words in got[1], got


def test_clip_grad_norm_sums_tp_shards_and_counts_replicated_parameters_once(world):
    """opt.clip_grad_norm_ under TP (FSDP2 2-D cannot run torch's clip_grad_norm_ here: its
    per-parameter norms live on two meshes, dp and dp x tp, which torch.stack refuses)."""
    want = adamw_reference(clip=0.05)
    for got in world(4).run(_train, "ours", clip=0.05):
        for t in range(STEPS):  # the norm before clipping
            torch.testing.assert_close(got[t]["norm"], want[f"norm{t}"], rtol=1e-5, atol=1e-7)
        for k in got[-1]:
            if k != "norm":
                torch.testing.assert_close(got[-1][k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def _torch_utils(shape, zero3, how, clip=0.05):
    """torch's own gradient utilities on the TP model's gradients, as users call them: `how` is
    "clip_grad_norm_" (torch.nn.utils.clip_grad_norm_), "titan" (torchtitan's way:
    get_total_norm with foreach, then clip_grads_with_norm_) or "clip_grad_value_"; the first
    step's `p.grad.full_tensor()` too. Gradients are DTensors' under TP (global shape,
    placements) with their values in the optimizer's shards."""
    world = mesh(*shape)
    model = parallelize_module(build(), world["tp"], PLAN)
    projections = [getattr(model, n) for n in PROJECTIONS]
    extra = dict(shard_modules=[*projections, model]) if zero3 else {}
    opt = vo.AdamW(model.parameters(), mesh=world["dp"], **extra, **ADAMW)
    dp_rank, out = world["dp"].get_local_rank(), {}
    utils = torch.nn.utils
    for t in range(STEPS):
        loss(model, *batch(t, dp_rank)).backward()
        if t == 0:
            out.update({f"grad.{n}": p.grad.full_tensor() for n, p in model.named_parameters()})
            w = model.wq.weight.grad
            assert tuple(w.shape) == (DIM, DIM) and w.placements == (Shard(0),)
            assert w.to_local().shape == (DIM // shape[1], DIM)
        if how == "clip_grad_norm_":
            out[f"norm{t}"] = utils.clip_grad_norm_(model.parameters(), clip, foreach=t % 2 == 1)
        elif how == "titan":
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            out[f"norm{t}"] = utils.get_total_norm(grads, 2.0, False, True)
            utils.clip_grads_with_norm_(model.parameters(), clip, out[f"norm{t}"], True)
        else:
            utils.clip_grad_value_(model.parameters(), 1e-3)
        opt.step()
        opt.zero_grad()
    return {**out, **full(model.state_dict())}


@pytest.mark.parametrize(
    "shape, zero3, how",
    [
        ((2, 2), False, "clip_grad_norm_"),
        ((2, 2), True, "titan"),
        ((1, 4), False, "clip_grad_norm_"),
        ((2, 2), True, "clip_grad_value_"),
    ],
)
def test_torch_gradient_utilities_see_the_whole_model(world, shape, zero3, how):
    """The norm torch's clipping computes is the whole model's (TP shards summed over TP, a
    replicated parameter counted once), the same on every rank as one process's; the clipped
    step and `p.grad.full_tensor()` equal one process's on the mean gradient."""
    want = adamw_reference(
        dp=shape[0],
        clip=None if how == "clip_grad_value_" else 0.05,
        clip_value=1e-3 if how == "clip_grad_value_" else None,
        grads=True,
    )
    for got in world(4).run(_torch_utils, shape, zero3, how):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


# --- ZeRO-3: DTensor parameters sharded between uses ------------------------------------------


def _train_zero3(steps=STEPS):
    """ZeRO-3 over the TP model (a unit per projection, the norms in the root's): per step the
    whole model state, and what a weight between steps, `opt.gathered()` and the state dict give."""
    world = mesh()
    model = parallelize_module(build(), world["tp"], PLAN)
    before = placements(model)
    projections = [getattr(model, n) for n in PROJECTIONS]
    opt = vo.AdamW(model.parameters(), mesh=world["dp"], shard_modules=[*projections, model], **ADAMW)
    dp_rank = world["dp"].get_local_rank()
    per_step, refused, seen = [], [], {}
    for t in range(steps):
        loss(model, *batch(t, dp_rank)).backward()
        opt.step()
        opt.zero_grad()
        assert placements(model) == before  # DTensors with their TP placements after every step
        assert len(opt.units) == 8 and all(u.sharded and u.full.nbytes == 0 for u in opt.units)  # freed
        w = model.wq.weight
        assert isinstance(w, DTensor) and isinstance(w, nn.Parameter) and w.shape == (DIM, DIM)
        assert w.to_local().shape == (DIM // 2, DIM)  # metadata of the local tensor reads
        for read in (lambda w: w * 2, lambda w: w.to_local() + 1, lambda w: w.full_tensor(), torch.sum):
            try:
                read(w)
            except vo.ReshardedParameterError as e:
                refused.append("wq.weight" in str(e))
            else:
                refused.append(False)
        state = model.state_dict()
        seen = {k: tuple(v.placements) if isinstance(v, DTensor) else None for k, v in state.items()}
        per_step.append(full(state))
        with opt.gathered():
            whole = {n: local(p).detach().clone() for n, p in model.named_parameters()}
        assert all(torch.equal(whole[k], local(state[k])) for k in whole)  # TP-local values, whole
    return per_step, refused, seen


def test_zero3_dp2_tp2_equals_one_process_and_fsdp2_step_for_step(world):
    want, theirs = adamw_reference(), world(4).run(_train, "fsdp2")
    for (ours, refused, seen), fsdp in zip(world(4).run(_train_zero3), theirs):
        for k in want:
            torch.testing.assert_close(ours[-1][k], want[k], rtol=1e-5, atol=1e-6, msg=k)
        for t in range(STEPS):
            for k in fsdp[t]:
                torch.testing.assert_close(ours[t][k], fsdp[t][k], rtol=1e-5, atol=1e-6, msg=f"step {t}: {k}")
        assert refused and all(refused)  # the named stand-in error, to_local() and full_tensor() too
        assert seen["wq.weight"] == (Shard(0),) and seen["w2.weight"] == (Shard(1),)
        assert seen["norm1.weight"] is None


# --- HSDP next to TP: mesh=world["dp_replicate", "dp_shard"] -------------------------------------


def _train_hsdp(shape, zero3):
    """HSDP x TP on a 3-D root mesh of `shape` (replicate, shard, tp): the model state after STEPS."""
    world, dp_rank = replicated_mesh(shape)
    model = parallelize_module(build(), world["tp"], PLAN)
    before = placements(model)
    shard_modules = [*(getattr(model, n) for n in PROJECTIONS), model] if zero3 else None
    opt = vo.AdamW(
        model.parameters(), mesh=world["dp_replicate", "dp_shard"], shard_modules=shard_modules, **ADAMW
    )
    for t in range(STEPS):
        train(model, opt, dp_rank, [t])
        assert placements(model) == before
    return full(model.state_dict())


@pytest.mark.parametrize("shape", [(2, 1, 2), (1, 2, 2)])
@pytest.mark.parametrize("zero3", [False, True])
def test_hsdp_tp_adamw_equals_one_process(world, shape, zero3):
    want = adamw_reference()
    for got in world(4).run(_train_hsdp, shape, zero3):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


# --- skip_nonfinite, 8-bit state and 8-bit collectives under TP --------------------------------


def _train_with(dp, options, steps=STEPS, poison=None, same_batch=False, wide=False):
    """dp x tp2 (dp * 2 ranks) with vo.AdamW(**options): the model state after `steps` (whole),
    and the optimizer's state dict (with `wide`, of the Wide block, and the segments' tiers too).
    `poison=(step, rank)`: that global rank's local gradient of wq holds a NaN at that step (its
    TP peer's does not). `same_batch`: every dp rank trains on step t's batch of rank 0, so the
    mean gradient does not depend on dp."""
    world = mesh(dp, 2)
    model = parallelize_module(Wide() if wide else build(), world["tp"], WIDE_PLAN if wide else PLAN)
    opt = vo.AdamW(model.parameters(), mesh=world["dp"], **ADAMW, **options)
    dp_rank = 0 if same_batch else world["dp"].get_local_rank()
    for t in range(steps):
        if poison is not None and poison == (t, torch.distributed.get_rank()):
            hook = model.wq.weight.register_hook(lambda g: g * float("nan"))
        loss(model, *batch(t, dp_rank, dim=WIDE if wide else DIM)).backward()
        if poison is not None and poison == (t, torch.distributed.get_rank()):
            hook.remove()
        opt.step()
        opt.zero_grad()
    if wide:
        return full(model.state_dict()), opt.state_dict(), [seg.tier for seg in opt.segments]
    return full(model.state_dict()), opt.state_dict()


def test_skip_nonfinite_skips_on_every_tp_rank(world):
    """A NaN in one TP rank's shard of a gradient skips the step on all four ranks: the run equals
    one that never took that step's data (the TP shards of wq stay one matrix)."""
    want = adamw_reference(steps=1)
    for got, _ in world(4).run(_train_with, 2, dict(skip_nonfinite=True), 2, (1, 0)):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_8bit_state_is_identical_at_any_dp_size_for_one_tp_size(world):
    options = dict(state_bits=8)
    one = world(2).run(_train_with, 1, options, same_batch=True, wide=True)
    two = world(4).run(_train_with, 2, options, same_batch=True, wide=True)
    (model1, state1, tiers), (model2, state2, _) = one[0], two[0]
    assert "q8" in tiers  # the projections' state in int8 blocks, not the fp32 tier of small tensors
    for k in model1:
        assert torch.equal(model1[k], model2[k]), k
    for i, entry in state1["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, state2["state"][i][name]), (i, name)
    near = world(4).run(_train_with, 2, {}, same_batch=True, wide=True)[0][0]
    for k in near:  # and near the fp32 state's run: Adam's update of a tiny gradient may flip with
        # the int8 rounding (measured: at most 6.8e-3, lr 1e-2), the mean stays small (1.2e-4)
        diff = (model2[k] - near[k]).abs()
        assert diff.max() <= STEPS * ADAMW["lr"] and diff.mean() <= 1e-3, (k, diff.max(), diff.mean())


@pytest.mark.parametrize("options", [dict(gather_bits=8), dict(reduce_bits=8)], ids=["gather8", "reduce8"])
def test_8bit_collectives_under_tp_stay_near_fp32(world, options):
    """Within STEPS steps of lr of the fp32 run (Adam's updates of tiny gradients may flip with the
    wire's rounding), and the parameters left out of the plan still equal on every TP rank."""
    want, runs = adamw_reference(), world(4).run(_train_with, 2, options)
    for got, _ in runs:
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=STEPS * ADAMW["lr"], msg=k)
            assert torch.equal(got[k], runs[0][0][k]), k


# --- ranks with different TP plans --------------------------------------------------------------


def _different_plans(case):
    """Rank 0's plan differs from the others' (`case`): every rank must raise at construction
    ("no plan": rank 0 holds a plain model, no DTensor at all, while its TP peer holds DTensors;
    they keep their own chunks, src_data_rank=None, or torch's plan would wait for rank 0's)."""
    world = mesh()
    plan, rank0 = dict(PLAN), torch.distributed.get_rank() == 0
    if rank0 and case == "colwise vs rowwise":
        plan["wq"] = RowwiseParallel()
    if case in ("no plan", "no plan, no mesh"):
        model = build() if rank0 else parallelize_module(build(), world["tp"], plan, src_data_rank=None)
    else:
        model = parallelize_module(build(), world["tp"], plan)
    if rank0 and case == "dtensor vs plain":  # wq a plain tensor of the same shape on rank 0 alone
        model.wq.weight = nn.Parameter(torch.zeros(DIM, DIM))
    try:  # "no plan, no mesh": nobody passes mesh= either (the peers' DTensors need it)
        vo.AdamW(model.parameters(), mesh=None if case == "no plan, no mesh" else world["dp"], **ADAMW)
    except ValueError as e:
        return str(e)
    return None


PLAN_WORDS = "parallelize_module plan"


@pytest.mark.parametrize(
    "case, words",
    [
        ("colwise vs rowwise", (PLAN_WORDS, "placements (Shard(dim=1))")),
        ("dtensor vs plain", (PLAN_WORDS, "as a plain tensor")),
        ("no plan", (PLAN_WORDS, "rank 0 holds no DTensor parameters, but its tensor-parallel peer rank 1")),
        ("no plan, no mesh", ("pass the data-parallel mesh as mesh=",)),
    ],
)
def test_different_tp_plans_are_refused_on_every_rank(world, case, words):
    got = world(4).run(_different_plans, case, timeout=60)  # a rank left waiting fails by the timeout
    assert all(g is not None and all(w in g for w in words) for g in got), got  # on every rank
    if PLAN_WORDS in words:
        assert all(g == got[0] for g in got), got  # the same words on every rank
