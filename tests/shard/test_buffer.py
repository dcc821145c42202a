"""Flat buffers: every tensor is a view, and the collectives move the tensors themselves."""

import math

import pytest
import torch

from vescale_optim.shard import FlatBuffer, plan_layout
from vescale_optim.shard.collectives import Comm, all_gather_into_, reduce_scatter_into_

SHAPES = [(7, 5), (3,), (4, 3, 2), (11, 5), (1,), (6, 6)]


def make_params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def layout_for(world):
    sizes = [math.prod(s) for s in SHAPES]
    granules = [s[-1] for s in SHAPES]
    return plan_layout(sizes, granules, world, align=2)


def bind(params, layout, rank):
    """Parameters as views of one buffer and gradients as views of another, values kept."""
    pbuf = FlatBuffer(layout, [p.shape for p in params], rank, torch.float32)
    gbuf = FlatBuffer(layout, [p.shape for p in params], rank, torch.float32)
    with torch.no_grad():
        for i, p in enumerate(params):
            pbuf.view(i).copy_(p)
            p.data, p.grad = pbuf.view(i), gbuf.view(i)
    return pbuf, gbuf


def test_views_share_the_buffer_and_autograd_accumulates_into_it():
    params = make_params(0)
    before = [p.detach().clone() for p in params]
    pbuf, gbuf = bind(params, layout_for(3), rank=1)
    for i, (p, want) in enumerate(zip(params, before)):
        assert p.untyped_storage().data_ptr() == pbuf.data.untyped_storage().data_ptr()
        assert p.data_ptr() == pbuf.view(i).data_ptr() and torch.equal(p, want)
    sum((p * p).sum() for p in params).backward()
    for i, p in enumerate(params):
        assert p.grad.data_ptr() == gbuf.view(i).data_ptr()
    assert torch.allclose(gbuf.view(0), 2 * before[0])


def test_local_pieces_are_views_of_the_local_slice():
    params = make_params(1)
    layout = layout_for(4)
    for rank in range(4):
        pbuf, _ = bind(make_params(1), layout, rank)
        for i in range(len(SHAPES)):
            start, stop = pbuf.tensor_range(i)
            piece = pbuf.local_piece(i)
            assert torch.equal(piece, params[i].detach().reshape(-1)[start:stop])
            if piece.numel():
                assert piece.data_ptr() == pbuf.local.data_ptr() + pbuf.local_range(i)[0] * 4
            assert pbuf.placement(i).local_range(SHAPES[i], rank) == (start, stop)


def test_an_unallocated_buffer_takes_no_memory_until_allocated():
    """`allocate=False` (a gradient buffer made in backward, at the peak) allocates nothing,
    not even for a moment; `allocate`, `free` and `allocate` again behave as for any buffer."""
    layout = layout_for(2)
    nbytes = layout.numel * 4
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, profile_memory=True) as prof:
        buf = FlatBuffer(layout, SHAPES, 0, torch.float32, allocate=False)
    assert not [e for e in prof.events() if e.cpu_memory_usage >= nbytes]
    assert not buf.allocated and buf.nbytes == 0
    buf.allocate(zero=True)
    assert buf.allocated and buf.nbytes == nbytes and not buf.data.any()
    view = buf.view(3)
    view.fill_(2.0)
    buf.free()
    assert not buf.allocated and buf.nbytes == 0 and view.shape == SHAPES[3]
    buf.allocate(zero=True)
    assert buf.nbytes == nbytes and view.untyped_storage().nbytes() == nbytes and not view.any()


def test_bad_buffers():
    with pytest.raises(ValueError, match="rank 3 outside"):
        FlatBuffer(layout_for(2), SHAPES, 3, torch.float32)
    with pytest.raises(ValueError, match="do not match"):
        FlatBuffer(layout_for(2), SHAPES[:-1], 0, torch.float32)


def _sync_on_rank(world, gloo_workarounds=True):
    comm = Comm()
    comm.gloo = gloo_workarounds  # False runs the reduce-scatter/all-gather path NCCL takes
    layout = layout_for(world)
    params = make_params(0)  # same values on every rank
    pbuf, gbuf = bind(params, layout, comm.rank)
    # Wipe everything but the local slice, then gather it back from the owners, in place.
    keep = pbuf.local.clone()
    pbuf.data.fill_(float("nan"))
    pbuf.local.copy_(keep)
    ptr = pbuf.data.data_ptr()
    all_gather_into_(pbuf.data, pbuf.local, comm, async_op=True).wait()
    assert pbuf.data.data_ptr() == ptr
    for p, want in zip(params, make_params(0)):
        assert torch.equal(p.detach(), want.detach())
    # Each rank has its own gradients; a separate shard becomes their mean.
    grads = [make_params(100 + r) for r in range(world)]
    for p, g in zip(params, grads[comm.rank]):
        p.grad.copy_(g.detach())
    shard = torch.empty(layout.shard_size)
    reduce_scatter_into_(gbuf.data, shard, comm, op="mean")
    for i in range(len(SHAPES)):
        start, stop = gbuf.tensor_range(i)
        lo, hi = gbuf.local_range(i)
        mean = torch.stack([g[i].detach().reshape(-1)[start:stop] for g in grads]).mean(0)
        assert torch.allclose(shard[lo:hi], mean, atol=1e-6)
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("gloo_workarounds", [True, False])
def test_all_gather_and_reduce_scatter_through_the_buffers(world, world_size, gloo_workarounds):
    results = world(world_size).run(_sync_on_rank, world_size, gloo_workarounds, timeout=60)
    assert results == [True] * world_size


def test_unknown_reduction():
    with pytest.raises(ValueError, match="unknown reduction 'median'"):
        reduce_scatter_into_(torch.zeros(4), torch.zeros(4), Comm(), op="median")
