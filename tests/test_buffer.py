"""Flat buffers: binding is zero-copy and collectives move the parameters themselves."""

import math

import pytest
import torch

from vescale_optim.shard import Comm, FlatBuffer, all_gather_, bind_parameters, plan_layout, reduce_scatter_

SHAPES = [(7, 5), (3,), (4, 3, 2), (11, 5), (1,), (6, 6)]


def make_params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def layout_for(world):
    sizes = [math.prod(s) for s in SHAPES]
    units = [s[-1] for s in SHAPES]
    return plan_layout(sizes, units, world, align=2)


def test_binding_keeps_values_and_makes_views():
    params = make_params(0)
    before = [p.detach().clone() for p in params]
    params[1].grad = torch.full((3,), 2.0)
    pbuf, gbuf = bind_parameters(params, layout_for(3), rank=1)
    storage = pbuf.data.untyped_storage().data_ptr()
    for i, (p, want) in enumerate(zip(params, before)):
        assert p.untyped_storage().data_ptr() == storage
        assert p.grad.untyped_storage().data_ptr() == gbuf.data.untyped_storage().data_ptr()
        assert torch.equal(p, want)
        assert p.data_ptr() == pbuf.view(i).data_ptr()
    assert torch.equal(params[1].grad, torch.full((3,), 2.0))
    # autograd accumulates into the buffer in place
    loss = sum((p * p).sum() for p in params)
    loss.backward()
    for i, p in enumerate(params):
        assert p.grad.data_ptr() == gbuf.view(i).data_ptr()
    assert torch.allclose(gbuf.view(0), 2 * before[0])


def test_local_pieces_are_views_of_the_local_slice():
    params = make_params(1)
    layout = layout_for(4)
    for rank in range(4):
        pbuf, _ = bind_parameters(make_params(1), layout, rank)
        for i in range(len(SHAPES)):
            start, stop = pbuf.tensor_range(i)
            piece = pbuf.local_piece(i)
            assert torch.equal(piece, params[i].detach().reshape(-1)[start:stop])
            if piece.numel():
                assert piece.data_ptr() == pbuf.local.data_ptr() + pbuf.local_range(i)[0] * 4
            p = pbuf.placement(i)
            assert p.local_range(SHAPES[i], rank) == (start, stop)


def test_bad_bindings():
    with pytest.raises(ValueError, match="empty"):
        bind_parameters([], layout_for(1), 0)
    mixed = [torch.nn.Parameter(torch.zeros(7, 5)), torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))]
    with pytest.raises(ValueError, match="one dtype"):
        bind_parameters(mixed, plan_layout([35, 3], [5, 1], 1), 0)
    with pytest.raises(ValueError, match="rank 3 outside"):
        FlatBuffer(layout_for(2), SHAPES, 3, torch.float32)


def _sync_on_rank(world, gloo_workarounds=True):
    comm = Comm()
    comm.gloo = gloo_workarounds  # False runs the reduce-scatter/all-gather path NCCL takes
    layout = layout_for(world)
    params = make_params(0)  # same values on every rank
    pbuf, gbuf = bind_parameters(params, layout, comm.rank)
    # Wipe everything but the local slice, then gather it back from the owners.
    keep = pbuf.local.clone()
    pbuf.data.fill_(float("nan"))
    pbuf.local.copy_(keep)
    ptr = pbuf.data.data_ptr()
    all_gather_(pbuf, comm, async_op=True).wait()
    assert pbuf.data.data_ptr() == ptr
    for p, want in zip(params, make_params(0)):
        assert torch.equal(p.detach(), want.detach())
    # Each rank has its own gradients; the local slice becomes their mean.
    grads = [make_params(100 + r) for r in range(world)]
    for p, g in zip(params, grads[comm.rank]):
        p.grad.copy_(g.detach())
    reduce_scatter_(gbuf, comm, op="mean")
    for i in range(len(SHAPES)):
        start, stop = gbuf.tensor_range(i)
        mean = torch.stack([g[i].detach().reshape(-1)[start:stop] for g in grads]).mean(0)
        assert torch.allclose(gbuf.local_piece(i), mean, atol=1e-6)
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("gloo_workarounds", [True, False])
def test_all_gather_and_reduce_scatter_through_the_buffers(world, world_size, gloo_workarounds):
    results = world(world_size).run(_sync_on_rank, world_size, gloo_workarounds, timeout=60)
    assert results == [True] * world_size


def test_unknown_reduction():
    params = make_params(0)
    _, gbuf = bind_parameters(params, layout_for(1), 0)
    with pytest.raises(ValueError, match="unknown reduction 'median'"):
        reduce_scatter_(gbuf, Comm(), op="median")
