"""Fully sharded training (`shard_modules`) equals one process fed the mean gradient:
AdamW vs torch.optim.AdamW, Muon vs torch.optim.Muon (+ AdamW), Shampoo vs the plain
reference, on a GPT-like model with tied embeddings, at W 1-4, resharding after forward
or not, accumulating (both ways), with activation checkpointing, built on the meta
device, and in bf16 over fp32 shards."""

import contextlib
import weakref

import pytest
import torch
import torch.distributed as dist
from _fsdp_cases import (
    ADAMW,
    STEPS,
    TOL,
    Reference,
    assert_equal,
    make_ours,
    reference,
    reference_model,
    train_sharded,
)
from _tiny_gpt import batch, build, loss_fn, train, world_grads

import vescale_optim as vo
from vescale_optim.shard.handle import delayed
from vescale_optim.units import State


@pytest.mark.parametrize("kind", ["adamw", "muon", "shampoo"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fully_sharded_equals_one_process(world, kind, world_size):
    want = reference(kind, world_size)
    for got, _ in world(world_size).run(train_sharded, kind):
        assert_equal(got, want, TOL[kind])


CASES = {
    "keep gathered after forward": dict(reshard_after_forward=False),
    "no backward prefetch": dict(backward_prefetch=False),
    "accumulate": dict(micro=2),
    "accumulate under no_sync": dict(micro=3, accumulate="no_sync"),
    "activation checkpointing": dict(checkpoint=True),
    "meta-device model": dict(meta=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_variants_equal_one_process(world, kind, case):
    args = CASES[case]
    keys = ("micro", "meta", "checkpoint")
    want = reference(kind, 3, **{k: args[k] for k in keys if k in args})
    for got, _ in world(3).run(train_sharded, kind, **args):
        assert_equal(got, want, TOL[kind])


def _bf16_dtypes():
    model = build()
    opt = make_ours("adamw", model, shard_modules=[*model.layers, model], param_dtype=torch.bfloat16)
    return {(u.full.data.dtype, u.shard.dtype, u.grads.shard.dtype) for u in opt.units}


def test_bf16_compute_over_fp32_shards_tracks_fp32(world):
    """param_dtype=bf16 gathers and computes in bf16 (half the all-gather bytes); shards,
    gradients' shards, state and the update stay fp32. AdamW moves an element by at most
    about lr per step, so bf16 rounding can at worst reverse a step (|Δ| <= 2 lr per step,
    for gradients near zero); on average the run stays within 5 % of how far fp32 moved."""
    assert world(2).run(_bf16_dtypes)[0] == {(torch.bfloat16, torch.float32, torch.float32)}
    want = reference("adamw", 2)
    init = build().state_dict()
    for got, _ in world(2).run(train_sharded, "adamw", param_dtype=torch.bfloat16):
        diff = torch.cat([(got[k] - want[k]).abs().flatten() for k in want])
        moved = torch.cat([(want[k] - init[k]).abs().flatten() for k in want])
        assert diff.max() <= 2 * ADAMW["lr"] * STEPS
        assert 0 < diff.mean() <= 0.05 * moved.mean()


def _reduced_in_fp32():
    """A unit's bf16 gradients reduce-scattered in fp32: what is alive while that runs."""
    model = build()
    opt = make_ours(
        "adamw",
        model,
        shard_modules=[*model.layers, model],
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
    )
    with opt.no_sync():  # keep the full gradients, to reduce one unit by hand
        loss_fn(model, *batch(0, dist.get_rank())).backward()
    unit = opt.units[0]
    unit.reshard()  # free its parameters, as the step would: only gradients are left
    buf, numel = unit.grads.full, unit.grads.full.data.numel()
    sent = unit.grads.sent_bytes
    unit.grads.reduce(async_op=True)
    during = (buf.data.dtype, buf.nbytes, unit.grads.scattering.dtype, unit.transient_bytes(), numel * 4)
    unit.grads.wait()
    return during, unit.transient_bytes(), unit.grads.sent_bytes - sent, numel * 4


def test_bf16_gradients_reduced_in_fp32(world):
    """reduce_dtype=fp32 over bf16 compute: the fp32 cast is reduce-scattered, the bf16
    buffer is freed as soon as it is cast, the cast once the reduction is done; the run
    tracks fp32 within the bf16 bounds above."""
    for during, after, sent, fp32_bytes in world(2).run(_reduced_in_fp32):
        assert during == (torch.bfloat16, 0, torch.float32, fp32_bytes, fp32_bytes), during
        assert after == 0 and sent == fp32_bytes // 2  # ring bytes of one fp32 shard at W=2
    want = reference("adamw", 2)
    init = build().state_dict()
    for got, _ in world(2).run(
        train_sharded, "adamw", param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    ):
        diff = torch.cat([(got[k] - want[k]).abs().flatten() for k in want])
        moved = torch.cat([(want[k] - init[k]).abs().flatten() for k in want])
        assert diff.max() <= 2 * ADAMW["lr"] * STEPS
        assert 0 < diff.mean() <= 0.05 * moved.mean()


# --- memory, asserted from storage sizes inside forward hooks ---------------------------


def _memory(backward_prefetch: bool = True, slow_scatter: bool = False):
    rank = dist.get_rank()
    model = build(layers=4)
    opt = make_ours("adamw", model, shard_modules=[*model.layers, model], backward_prefetch=backward_prefetch)
    units = {u.name: u for u in opt.units}
    gathered_at = {}

    def holding():
        """Names of units whose unsharded parameters hold memory, and total unsharded gradient bytes."""
        gathered = {n for n, u in units.items() if u.full.nbytes}
        return gathered, sum(u.grads.full.nbytes for u in units.values())

    def probe(k):
        def hook(module, args):  # runs after the unit's own pre-forward hook: inside its forward
            gathered_at.setdefault(k, holding())

        return hook

    for k, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(probe(k))
    blocks = [u for name, u in units.items() if name.startswith("layers.")]
    in_backward = []  # unit-sized buffers of blocks alive, after each block parameter's gradient

    def buffers(u):
        scattering = u.grads.scattering is not None and u.grads.scattering.untyped_storage().nbytes() > 0
        return (u.full.nbytes > 0) + (u.grads.full.nbytes > 0) + scattering

    for p in model.layers.parameters():
        p.register_post_accumulate_grad_hook(lambda p: in_backward.append(sum(buffers(u) for u in blocks)))
    early = []  # blocks with unsharded parameters as gradients of a block's first half arrive
    accumulated = {}  # block name -> gradient elements accumulated in this backward

    def arriving(unit):
        def hook(grad):  # after the schedule's own hook, before the gradient is accumulated
            done = accumulated.get(unit.name, 0)
            if done < sum(p.numel() for p in unit.params) // 2:
                early.append(sum(u.full.nbytes > 0 for u in blocks))
            accumulated[unit.name] = done + grad.numel()

        return hook

    for u in blocks:
        for p in u.params:
            p.register_hook(arriving(u))
    shard_bytes = sum(u.shard.numel() * 4 + u.grads.shard.numel() * 4 for u in units.values())
    between = []
    # slow_scatter: every collective runs only when waited for, as on a device still busy with it
    with delayed() if slow_scatter else contextlib.nullcontext():
        for t in range(2):
            gathered_at.clear()
            accumulated.clear()
            loss_fn(model, *batch(t, rank)).backward()
            opt.step()
            stepped = opt.memory_stats()
            opt.zero_grad()
            between.append((holding(), stepped, opt.memory_stats()))
    total = sum(p.numel() for p in model.parameters())
    return gathered_at, between, shard_bytes, total, opt.world_size, max(in_backward), early


@pytest.mark.parametrize("world_size", [2, 4])
def test_only_shards_between_steps_and_two_units_in_forward(world, world_size):
    for result in world(world_size).run(_memory):
        gathered_at, between, shard_bytes, total, w, in_backward, early = result
        # in backward: the parameters and gradient buffer of the unit computing, the
        # parameters of the next (prefetched) and the gradient buffer being reduced: the
        # prefetch does not wait for the reduce-scatter in flight (so on a GPU the two
        # overlap, issue 41 item 6); only the next reduce-scatter does (FSDP2's four)
        assert in_backward == 4, in_backward
        # the block before is gathered as the one computing starts its backward (FSDP2's
        # pre-backward prefetch), so two blocks are unsharded as its first gradients arrive,
        # one for the first block (nothing before it): on a GPU the gather then runs beside the
        # whole backward of the block (issued half-way, it came after the block's last kernel)
        assert len(early) >= 8 and set(early) == {1, 2}, early
        for k, (names, grad_bytes) in gathered_at.items():
            # the root (outermost: kept for backward), layer k and the one prefetched after it
            want = {"TinyGPT[0]", f"layers.{k}"} | ({f"layers.{k + 1}"} if k + 1 < 4 else set())
            assert names == want and grad_bytes == 0, (k, names)
        for (names, grad_bytes), stepped, zeroed in between:
            assert names == set() and grad_bytes == 0
            assert stepped["unsharded"] == zeroed["unsharded"] == 0
            assert stepped["parameters"] + stepped["gradients"] == shard_bytes
            # zero_grad() frees the gradient shards, as torch's set_to_none frees gradients
            assert zeroed["gradients"] == 0 and zeroed["parameters"] == stepped["parameters"]
            # a rank's shards: its 1/W of parameters and gradients, plus the planner's padding
            assert shard_bytes <= 2 * 4 * (total / w) * 1.15 + 2 * 4 * 64 * len(gathered_at)


def test_two_units_in_backward_without_prefetch(world):
    for result in world(3).run(_memory, False, True):
        gathered_at, between, shard_bytes, total, w, in_backward, early = result
        # in backward: only the parameters and gradient buffer of the unit computing
        assert in_backward == 2, in_backward
        assert len(early) >= 8 and set(early) == {1}, early
        for k, (names, _) in gathered_at.items():  # forward still prefetches
            assert names == {"TinyGPT[0]", f"layers.{k}"} | ({f"layers.{k + 1}"} if k + 1 < 4 else set())
        for (names, grad_bytes), stepped, _ in between:
            assert names == set() and grad_bytes == 0
            assert stepped["parameters"] + stepped["gradients"] == shard_bytes


def _first_block_prefetched():
    """Per step: whether the first block in backward is being gathered once the head's
    gradient is accumulated, on a model whose head is untied: the outer unit's gradients
    then arrive around the blocks' (the head's first, under half of them; the embedding's
    last)."""
    model = build(layers=4)
    model.head.weight = torch.nn.Parameter(model.embed.weight.detach().clone())
    opt = make_ours("adamw", model, shard_modules=[*model.layers, model])
    first = next(u for u in opt.units if u.name == "layers.3")
    seen = []
    gathering = lambda p: seen.append(first.state is not State.RESHARDED)  # noqa: E731
    model.head.weight.register_post_accumulate_grad_hook(gathering)  # after the schedule's hook
    train(model, opt, range(2), dist.get_rank())
    return seen


def test_a_unit_around_the_blocks_prefetches_after_its_first_gradient(world):
    for seen in world(2).run(_first_block_prefetched):
        assert seen == [True, True], seen


# --- model state: full tensors outside forward/backward, sharded through DCP ---------------


def _held_gradients():
    """Per step: at each block's backward, the names of the parameters of other units whose
    incoming gradients (what autograd passes to accumulation) are still alive."""
    model = build()
    opt = make_ours("adamw", model, shard_modules=[*model.layers, model])
    incoming = []
    for name, p in model.named_parameters():
        p.register_hook(lambda g, n=name: incoming.append((n, weakref.ref(g))))
    steps = []

    def probe(k):
        def hook(module, grad_output):
            alive = {n for n, ref in incoming if ref() is not None and not n.startswith(f"layers.{k}.")}
            steps[-1].append(sorted(alive))

        return hook

    for k, layer in enumerate(model.layers):
        layer.register_full_backward_pre_hook(probe(k))
    for t in range(3):
        steps.append([])
        loss_fn(model, *batch(t, dist.get_rank())).backward()
        opt.step()
        opt.zero_grad()
    return steps


def test_backward_holds_no_gradient_of_a_finished_unit(world):
    # a multi-grad hook over the whole model would keep each of these until the last arrived
    for first, *later in world(2).run(_held_gradients):
        # the first backward learns which parameters of the outermost unit take part
        assert len(first) == 3 and not any(n.startswith("layers.") for names in first for n in names), first
        assert later == [[[], [], []]] * 2, later


def _state_dict_round_trip():
    rank = dist.get_rank()
    model = build()
    opt = make_ours("adamw", model, shard_modules=[*model.layers, model])
    loss_fn(model, *batch(0, rank)).backward()
    opt.step()
    full = model.state_dict()
    fresh = build(seed=3)
    model.load_state_dict(fresh.state_dict())
    loaded = model.state_dict()
    same = all(torch.equal(loaded[k], v) for k, v in fresh.state_dict().items())
    # training continues from the loaded weights
    loss = loss_fn(model, *batch(1, rank)).item()
    return {k: v.clone() for k, v in full.items()}, same, loss, loss_fn(fresh, *batch(1, rank)).item()


def test_model_state_dict_is_full_and_loads_into_the_shards(world):
    want = reference("adamw", 3, steps=1)
    for full, same, loss, fresh_loss in world(3).run(_state_dict_round_trip):
        assert_equal(full, want)
        assert same and loss == pytest.approx(fresh_loss, rel=1e-6)


def _save(path, steps):
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    model = build()
    opt = make_ours("adamw", model, shard_modules=[*model.layers, model])
    train(model, opt, range(steps), rank)
    dcp.save({"model": opt.sharded_model_state_dict(), "optim": opt.sharded_state_dict()}, checkpoint_id=path)
    return model.state_dict(), opt.state_dict()


def _resume(path, full, steps, more):
    """Load the checkpoint (`path`: DCP, else the full state dicts `full`) and train `more` steps."""
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    model = build(seed=5)  # other weights: everything must come from the checkpoint
    opt = make_ours("adamw", model, shard_modules=[*model.layers, model])
    if path is not None:
        sd = {"model": opt.sharded_model_state_dict(), "optim": opt.sharded_state_dict()}
        dcp.load(sd, checkpoint_id=path)
        opt.load_sharded_model_state_dict(sd["model"])
        opt.load_sharded_state_dict(sd["optim"])
    else:
        model.load_state_dict(full[0])
        opt.load_state_dict(full[1])
    loaded = (model.state_dict(), opt.state_dict())
    train(model, opt, range(steps, steps + more), rank)
    return loaded, {k: v.clone() for k, v in model.state_dict().items()}


def test_dcp_saved_at_4_loads_at_3_and_training_continues_exactly(world, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = world(4).run(_save, path, 2)[0]
    from_dcp = world(3).run(_resume, path, None, 2, 2)[0]
    from_full = world(3).run(_resume, None, saved, 2, 2)[0]
    (model_sd, opt_sd), after = from_dcp
    for k, v in saved[0].items():
        assert torch.equal(model_sd[k], v), k
    for i, st in saved[1]["state"].items():
        for k, v in st.items():
            assert torch.equal(opt_sd["state"][i][k], v), (i, k)
    for k, v in from_full[1].items():
        assert torch.equal(after[k], v), k


# --- errors ------------------------------------------------------------------------------------


def _step_inside_forward():
    model = build()
    opt = make_ours("adamw", model, shard_modules=[*model.layers, model])
    loss_fn(model, *batch(0, dist.get_rank())).backward()

    def step_now(module, args):
        opt.step()

    model.layers[1].register_forward_pre_hook(step_now)
    with pytest.raises(RuntimeError, match=r"step\(\) while units .*'layers.1'.* are still gathered"):
        model(batch(1, 0)[0])
    return True


def test_step_inside_a_forward_is_refused_on_every_rank(world):
    assert world(2).run(_step_inside_forward, timeout=60) == [True, True]


def _bad_units(case):
    model = build()
    if case == "missing":
        with pytest.raises(ValueError, match="parameter 0 .* not inside any module of shard_modules"):
            vo.AdamW(model.parameters(), shard_modules=list(model.layers))
    else:  # a weight shared by two layers, with no listed module above both
        model.layers[1].proj.weight = model.layers[0].proj.weight
        params = [p for layer in model.layers for p in layer.parameters()]
        with pytest.raises(ValueError, match="'proj.weight' is shared by modules with no common module"):
            vo.AdamW(dict.fromkeys(params), shard_modules=list(model.layers))
    return True


@pytest.mark.parametrize("case", ["missing", "tie"])
def test_units_that_miss_or_split_a_parameter_are_refused(world, case):
    assert _bad_units(case)
    assert world(2).run(_bad_units, case, timeout=60) == [True, True]


def _between_steps():
    rank = dist.get_rank()
    model = build()
    opt = make_ours("adamw", model, shard_modules=[*model.layers, model])
    loss_fn(model, *batch(0, rank)).backward()
    opt.step()
    weight = model.layers[0].proj.weight
    with pytest.raises(vo.ReshardedParameterError, match=r"'layers.0.proj.weight' \(shape .*\) is resharded"):
        weight.isnan()  # no memory behind it: reading it is a named error, never NaN nor a crash
    readable = tuple(weight.shape) == tuple(weight.detach().shape)  # its metadata reads as before
    with torch.no_grad():  # evaluation runs through the same hooks and frees after itself
        logits = model(batch(1, rank)[0])
    freed = opt.memory_stats()["unsharded"] == 0
    cast = r"parameter '.*' \(shape .*\) is resharded.*\.double\(\)"
    with pytest.raises(vo.ReshardedParameterError, match=cast):
        model.double()  # refused at once, naming the parameter (not a silent revert)
    return readable, freed, logits


def test_between_steps_parameters_refuse_reads_eval_works_and_casts_are_refused(world):
    model = reference_model()
    opt = Reference("adamw", model)
    world_grads(model, 0, 2)
    opt.step()
    for rank, (readable, freed, logits) in enumerate(world(2).run(_between_steps, timeout=60)):
        assert readable and freed
        with torch.no_grad():
            torch.testing.assert_close(logits, model(batch(1, rank)[0]), rtol=1e-5, atol=1e-5)
