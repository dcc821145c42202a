"""8-bit collectives (`gather_bits=8`, `reduce_bits=8`): quantization blocks never straddle
ranks, so the parameters a forward sees are the same bits at any world size and equal a
one-process blockwise quantize-dequantize of each tensor; the gradient shard is within
the documented bound of the exact mean; training tracks full precision; bytes shrink."""

import math

import pytest
import torch
import torch.distributed as dist
from _tiny_gpt import batch, build, loss_fn
from hypothesis import given
from hypothesis import strategies as st

import vescale_optim as vo
from vescale_optim.kernels import dequantize_blockwise, quantize_blockwise
from vescale_optim.kernels.wire import codec

BLOCK = 64
Q8 = codec(8, BLOCK)


# --- the wire format, in one process -----------------------------------------------------

blocks = st.sampled_from(["normal", "zero", "constant", "tiny", "huge", "nan", "inf"])


@given(st.lists(blocks, min_size=1, max_size=6), st.integers(1, 3), st.integers(0, 10**6))
def test_a_block_round_trips_within_half_a_code_step(kinds, rows, seed):
    g = torch.Generator().manual_seed(seed)
    pieces = []
    for kind in kinds:
        x = torch.randn(BLOCK, generator=g)
        x = {
            "zero": x * 0,
            "constant": torch.full_like(x, 3.5),
            "tiny": x * 1e-30,
            "huge": x * 1e30,
            "nan": x.index_fill(0, torch.tensor([5]), float("nan")),
            "inf": x.index_fill(0, torch.tensor([7]), float("inf")),
        }.get(kind, x)
        pieces.append(x)
    flat = torch.cat(pieces * rows)
    back = Q8.unpack(Q8.pack(flat, rows), torch.float32)
    for b in range(flat.numel() // BLOCK):
        x, y = flat[b * BLOCK : (b + 1) * BLOCK], back[b * BLOCK : (b + 1) * BLOCK]
        if not torch.isfinite(x).all():  # a non-finite block stays non-finite: skip_nonfinite sees it
            assert not torch.isfinite(y).all()
            continue
        step = x.abs().max() / 127
        assert (x - y).abs().max() <= step / 2 * (1 + 2**-7), (x, y)
        if x.abs().max() == 0:
            assert torch.equal(y, torch.zeros_like(y))


def test_a_bad_comm_block_is_refused():
    model = build(layers=1)
    for bad in (0, -4, 6, 3.0, 10**6):
        with pytest.raises(ValueError, match="comm_block"):
            vo.AdamW(model.parameters(), gather_bits=8, comm_block=bad)
    with pytest.raises(ValueError, match="gather_bits must be None"):
        vo.AdamW(model.parameters(), gather_bits=4)


# --- gathered parameters ----------------------------------------------------------------------


def _gathered():
    """The parameters as layer 0's forward sees them, with 8-bit all-gathers."""
    model = build(layers=2)
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    vo.AdamW(model.parameters(), shard_modules=[*model.layers, model], gather_bits=8, comm_block=BLOCK)
    seen = {}
    model.layers[0].register_forward_pre_hook(  # after the unit's own hook: gathered
        lambda m, a: seen.update({n: p.detach().clone() for n, p in m.named_parameters()})
    )
    with torch.no_grad():
        model(batch(0, 0)[0])
    one_process = {}
    for name, p in want.items():
        if name.startswith("layers.0."):
            q, s = quantize_blockwise(p.reshape(-1), BLOCK)
            one_process[name.removeprefix("layers.0.")] = dequantize_blockwise(q, s, BLOCK).view(p.shape)
    return seen, one_process


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gathered_parameters_are_the_same_bits_at_any_world_size(world, world_size):
    for seen, one_process in world(world_size).run(_gathered):
        assert seen.keys() == one_process.keys()
        for k in seen:
            assert torch.equal(seen[k], one_process[k]), k


# --- reduced gradients ------------------------------------------------------------------------


def _code_step(x):
    """Per element, the code step of its block (a tensor's partial last block counts too)."""
    n = x.numel()
    padded = torch.cat([x, x.new_zeros(-n % BLOCK)])
    return (padded.view(-1, BLOCK).abs().amax(1) / 127).repeat_interleave(BLOCK)[:n]


def _reduced(world_size):
    """Each rank's known gradients reduced through 8-bit pieces, against the exact mean and
    the bound: per element, the mean over ranks of half a code step of its block."""
    model = build(layers=2)
    opt = vo.AdamW(model.parameters(), shard_modules=[*model.layers, model], reduce_bits=8, comm_block=BLOCK)
    grads = [
        {
            n: torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * r + i))
            for i, (n, p) in enumerate(model.named_parameters())
        }
        for r in range(world_size)
    ]
    for n, p in model.named_parameters():
        p.grad = grads[dist.get_rank()][n].clone()
    opt.reduce_gradients()
    worst = 0.0
    for u in opt.units:
        for i, p in enumerate(u.params):
            lo, hi = u.full.local_range(i)
            start, stop = u.full.tensor_range(i)
            if hi <= lo:
                continue
            name = next(n for n, q in model.named_parameters() if q is p)
            pieces = [g[name].reshape(-1)[start:stop] for g in grads]
            exact = torch.stack(pieces).mean(0)
            bound = torch.stack([_code_step(x) for x in pieces]).mean(0) / 2 * (1 + 2**-7)
            err = (u.grads.shard[lo:hi] - exact).abs()
            assert bool((err <= bound + 1e-7).all()), (name, float(err.max()), float(bound.min()))
            worst = max(worst, float(err.max()))
    return worst


def test_reduced_gradients_are_within_the_bound_of_the_exact_mean(world):
    worst = world(3).run(_reduced, 3)
    assert all(0 < w < 0.05 for w in worst), worst  # quantized, and close


# --- training and bytes ------------------------------------------------------------------------


def _train(kind, bits, steps=30, layout="zero3"):
    torch.manual_seed(0)
    model = build(layers=2, dim=128)  # wide enough that blocks, not padding, set the bytes
    sharding = dict(gather_bits=bits, reduce_bits=bits)
    if layout != "zero2":
        sharding["shard_modules"] = [*model.layers, model]
    if layout == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        sharding["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    if kind == "adamw":
        opt = vo.AdamW(model.parameters(), lr=3e-3, **sharding)
    else:
        opt = vo.Muon(vo.muon_param_groups(model, lr=0.02), **sharding)
    losses, moved = [], []
    for t in range(steps):
        loss = loss_fn(model, *batch(t % 4, dist.get_rank()))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        moved.append((opt.step_stats["gather_bytes"], opt.step_stats["reduce_bytes"]))
    return sum(losses[-5:]) / 5, moved[-1]


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_8bit_collectives_train_like_full_precision_for_a_quarter_of_the_bytes(world, kind):
    full = world(4).run(_train, kind, None)
    eight = world(4).run(_train, kind, 8)
    for (loss, (gather, reduce)), (loss8, (gather8, reduce8)) in zip(full, eight):
        assert math.isfinite(loss8) and abs(loss8 - loss) <= 0.02 * loss, (loss, loss8)
        ratios = (gather8 / gather, reduce8 / reduce)
        assert 0 < gather8 <= 0.27 * gather and 0 < reduce8 <= 0.27 * reduce, ratios


@pytest.mark.parametrize("layout", ["zero2", "hsdp"])
def test_8bit_collectives_without_units_and_on_a_mesh(world, layout):
    full = world(4).run(_train, "adamw", None, 12, layout)
    eight = world(4).run(_train, "adamw", 8, 12, layout)
    for (loss, (gather, reduce)), (loss8, (gather8, reduce8)) in zip(full, eight):
        assert abs(loss8 - loss) <= 0.02 * loss, (loss, loss8)
        assert reduce8 < reduce and (gather8 < gather if layout == "hsdp" else gather8 <= 0.27 * gather)


def _skips_nonfinite():
    model = build(layers=1)
    opt = vo.AdamW(
        model.parameters(),
        shard_modules=[*model.layers, model],
        reduce_bits=8,
        comm_block=BLOCK,
        skip_nonfinite=True,
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss_fn(model, *batch(0, dist.get_rank())).backward()
    if dist.get_rank() == 1:
        model.layers[0].proj.weight.grad = torch.full_like(model.layers[0].proj.weight, float("nan"))
    with pytest.warns(UserWarning, match="skipped step"):
        opt.step()
    return opt.skipped_steps, all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_nonfinite_gradient_is_not_hidden_by_quantization(world):
    assert world(2).run(_skips_nonfinite) == [(1, True)] * 2
