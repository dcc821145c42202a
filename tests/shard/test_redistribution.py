"""Redistribution plans: simulated in-process (hypothesis), then executed on gloo worlds."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vescale_optim.shard import (
    Piece,
    RaggedShard,
    full_tensor,
    local_slice,
    plan_gather_to_owner,
    plan_redistribute,
    plan_scatter_from_owner,
    redistribute,
    run_plan,
)
from vescale_optim.shard.collectives import Comm
from vescale_optim.shard.flags import any_rank
from vescale_optim.shard.redistribution import in_arrival_order

WORLDS = [1, 2, 3, 4, 5]


@st.composite
def shapes(draw):
    ndim = draw(st.integers(1, 4))
    return tuple(draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))


@st.composite
def placements(draw, shape, world):
    """Any valid RaggedShard of `shape` on `world` ranks, zeros and one-hot included."""
    numel = math.prod(shape)
    if numel == 0:
        return RaggedShard((0,), (0,) * world)
    k = draw(st.integers(0, len(shape)))
    if k == 0:
        return RaggedShard.owned(draw(st.integers(0, world - 1)), world)
    if draw(st.integers(0, 5)) == 0:  # one-hot with row dims: also "owned"
        owner = draw(st.integers(0, world - 1))
        return RaggedShard(tuple(range(k)), tuple(int(r == owner) for r in range(world)))
    rows = math.prod(shape[:k])
    total = draw(st.sampled_from([d for d in range(1, rows + 1) if rows % d == 0]))
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=world - 1, max_size=world - 1)))
    return RaggedShard(tuple(range(k)), tuple(b - a for a, b in zip([0, *cuts], [*cuts, total])))


@st.composite
def redistributions(draw, worlds=range(1, 9)):
    world = draw(st.sampled_from(list(worlds)))
    shape = draw(shapes())
    return shape, draw(placements(shape, world)), draw(placements(shape, world))


def pieces_of(full, placement):
    return [local_slice(full, placement, r).clone() for r in range(placement.world_size)]


@given(redistributions())
def test_redistribute_plan_delivers_exactly_the_right_elements(case):
    shape, src, dst = case
    full = torch.arange(1, math.prod(shape) + 1, dtype=torch.float64).reshape(shape)
    plan = plan_redistribute(shape, src, dst)
    out = plan.simulate(pieces_of(full, src))
    for r, got in enumerate(out):
        assert torch.equal(got, local_slice(full, dst, r))
    # Round trip back to the source placement.
    back = plan_redistribute(shape, dst, src).simulate(out)
    for r, got in enumerate(back):
        assert torch.equal(got, local_slice(full, src, r))


@st.composite
def owner_cases(draw, worlds=range(1, 9)):
    world = draw(st.sampled_from(list(worlds)))
    n = draw(st.integers(1, 5))
    tensors = [draw(shapes()) for _ in range(n)]
    placed = [draw(placements(s, world)) for s in tensors]
    owners = [draw(st.integers(0, world - 1)) for _ in range(n)]
    return world, tensors, placed, owners


def packed_pieces(tensors, placed, world):
    """Each rank's pieces of all tensors packed one after another in its buffer."""
    pieces, fill = [], [0] * world
    for t, (shape, p) in enumerate(zip(tensors, placed)):
        for r, (a, b) in enumerate(p.ranges(shape)):
            pieces.append(Piece(r, t, fill[r], a, b))
            fill[r] += b - a
    return pieces, fill


def owner_expectations(tensors, placed, owners, world):
    fulls = [
        torch.arange(math.prod(s), dtype=torch.float64).reshape(s) + 1000 * t for t, s in enumerate(tensors)
    ]
    sources = [
        torch.cat(
            [local_slice(f, p, r) for f, p in zip(fulls, placed)] or [torch.empty(0, dtype=torch.float64)]
        )
        for r in range(world)
    ]
    gathered = [
        torch.cat(
            [f.reshape(-1) for f, o in zip(fulls, owners) if o == r] or [torch.empty(0, dtype=torch.float64)]
        )
        for r in range(world)
    ]
    return sources, gathered


def owner_plans(case):
    """The gather-to-owner and scatter-from-owner plans of a case, and what each rank holds
    before (sources) and after the gather (gathered)."""
    world, tensors, placed, owners = case
    pieces, fill = packed_pieces(tensors, placed, world)
    numels = [math.prod(s) for s in tensors]
    sources, gathered = owner_expectations(tensors, placed, owners, world)
    gather = plan_gather_to_owner(pieces, numels, owners, world, fill)
    return gather, plan_scatter_from_owner(pieces, numels, owners, world, fill), sources, gathered


@given(owner_cases())
def test_gather_to_owner_and_back(case):
    world, owners = case[0], case[3]
    gather, scatter, sources, gathered = owner_plans(case)
    out = gather.simulate(sources)
    assert all(torch.equal(a, b) for a, b in zip(out, gathered))
    back = scatter.simulate(out)
    assert all(torch.equal(a, b) for a, b in zip(back, sources))
    # Nobody sends to itself over the network, and only owners receive.
    assert all(gather.program(r).recv_splits == (0,) * world for r in range(world) if r not in owners)


@given(owner_cases())
def test_scatter_back_in_arrival_order_is_received_in_place(case):
    world = case[0]
    _, scatter, _, gathered = owner_plans(case)
    packed, where = in_arrival_order(scatter)
    arrived = packed.simulate(gathered)
    for r in range(world):
        assert packed.program(r).recv_range == (0, packed.dst_numel[r])  # one run, in order: no unpacking
        placed_back = torch.zeros(scatter.dst_numel[r], dtype=torch.float64)
        for offset, at, n in where[r]:
            placed_back[offset : offset + n] = arrived[r][at : at + n]
        assert torch.equal(placed_back, scatter.simulate(gathered)[r])


# --- the same on real gloo worlds ------------------------------------------------------


def _redistribute_on_rank(shape, src, dst, dtype):
    comm = Comm()
    full = (torch.arange(math.prod(shape)) % 100 + 1).to(dtype).reshape(shape)
    local = local_slice(full, src, comm.rank).clone()
    got, _ = redistribute(local, shape, src, dst, comm)
    assert got.shape == dst.local_shape(shape, comm.rank)
    assert torch.equal(got.reshape(-1), local_slice(full, dst, comm.rank)), (
        got,
        local_slice(full, dst, comm.rank),
    )
    whole, handle = full_tensor(local, shape, src, comm, async_op=True)
    handle.wait()
    assert torch.equal(whole, full)
    return True


def _owners_on_rank(world, tensors, placed, owners):
    comm = Comm()
    pieces, fill = packed_pieces(tensors, placed, world)
    numels = [math.prod(s) for s in tensors]
    sources, gathered = owner_expectations(tensors, placed, owners, world)
    gather = plan_gather_to_owner(pieces, numels, owners, world, fill)
    out = torch.full((gather.dst_numel[comm.rank],), -1.0, dtype=torch.float64)
    run_plan(gather, sources[comm.rank], out, comm, async_op=True).wait()
    assert torch.equal(out, gathered[comm.rank])
    back = torch.zeros(fill[comm.rank], dtype=torch.float64)
    run_plan(plan_scatter_from_owner(pieces, numels, owners, world, fill), out, back, comm)
    assert torch.equal(back, sources[comm.rank])
    return True


@pytest.mark.parametrize("world_size", WORLDS)
@settings(max_examples=15)
@given(data=st.data())
def test_redistribute_on_gloo(world, world_size, data):
    shape, src, dst = data.draw(redistributions(worlds=[world_size]))
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64]))
    assert (
        world(world_size).run(_redistribute_on_rank, shape, src, dst, dtype, timeout=60)
        == [True] * world_size
    )


@pytest.mark.parametrize("world_size", WORLDS)
@settings(max_examples=10)
@given(data=st.data())
def test_gather_scatter_owner_on_gloo(world, world_size, data):
    case = data.draw(owner_cases(worlds=[world_size]))
    assert world(world_size).run(_owners_on_rank, *case, timeout=60) == [True] * world_size


def _any_rank_on_rank(per_rank):
    comm = Comm()
    return any_rank(per_rank[comm.rank], comm)


@pytest.mark.parametrize("world_size", WORLDS)
@settings(max_examples=10)
@given(data=st.data())
def test_any_rank_is_the_or_over_ranks(world, world_size, data):
    # bits packed 64 to a word on gloo: sizes around the word boundaries
    n = data.draw(st.sampled_from([0, 1, 63, 64, 65, 130]) | st.integers(0, 200))
    per_rank = [data.draw(st.lists(st.booleans(), min_size=n, max_size=n)) for _ in range(world_size)]
    want = [any(column) for column in zip(*per_rank)] if n else []
    assert world(world_size).run(_any_rank_on_rank, per_rank, timeout=60) == [want] * world_size
    assert any_rank(per_rank[0], Comm()) == per_rank[0]


def _tail_on_rank(flags, tails, as_tensor):
    """4 ranks: `comm` pairs (0, 1) and (2, 3), the tail also over (0, 2) and (1, 3); and the
    same tail with nothing but the second pairs to talk to (`Comm.alone()`)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    pairs = {tuple(g): dist.new_group(g) for g in ([0, 1], [2, 3])}  # every rank makes every group
    across = {tuple(g): dist.new_group(g) for g in ([0, 2], [1, 3])}
    pairs, across = pairs[(rank & 2, rank & 2 | 1)], across[(rank & 1, rank & 1 | 2)]
    tail = [torch.tensor(t) if d else t for t, d in zip(tails[rank], as_tensor)]
    over = [Comm(across)]
    return (
        any_rank(flags[rank], Comm(pairs), tail=tail, tail_over=over),
        any_rank(flags[rank], Comm.alone(), tail=tail, tail_over=over),
    )


@settings(max_examples=5)
@given(data=st.data())
def test_a_tail_is_ored_over_its_groups_too(world, data):
    n, k = data.draw(st.integers(0, 70)), data.draw(st.integers(1, 3))
    flags = [data.draw(st.lists(st.booleans(), min_size=n, max_size=n)) for _ in range(4)]
    tails = [data.draw(st.lists(st.booleans(), min_size=k, max_size=k)) for _ in range(4)]
    as_tensor = data.draw(st.lists(st.booleans(), min_size=k, max_size=k))  # computed on the device
    everywhere = [any(column) for column in zip(*tails)]
    for rank, (paired, alone) in enumerate(world(4).run(_tail_on_rank, flags, tails, as_tensor, timeout=60)):
        partner = rank ^ 1
        assert paired == [a or b for a, b in zip(flags[rank], flags[partner])] + everywhere
        across = rank ^ 2
        assert alone == flags[rank] + [a or b for a, b in zip(tails[rank], tails[across])]


def test_single_process_without_a_process_group():
    shape, src, dst = (6, 4), RaggedShard((0,), (1,)), RaggedShard((0, 1), (1,))
    full = torch.randn(shape)
    got, handle = redistribute(full.clone(), shape, src, dst, Comm())
    handle.wait()
    assert torch.equal(got.reshape(shape), full)
    whole, _ = full_tensor(full.reshape(-1), shape, src, Comm())
    assert torch.equal(whole, full)


def test_full_tensor_rejects_a_piece_of_the_wrong_size():
    with pytest.raises(ValueError, match="holds 5 elements"):
        full_tensor(torch.zeros(5), (6, 4), RaggedShard((0,), (1,)), Comm())
