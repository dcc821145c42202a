import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vescale_optim.shard import RaggedShard, flat_range_boxes


def test_rows_split_in_rank_order():
    p = RaggedShard((0,), (1, 0, 2, 1))
    shape = (8, 3)
    assert p.granule_numel(shape) == 6
    assert [p.local_range(shape, r) for r in range(4)] == [(0, 6), (6, 6), (6, 18), (18, 24)]
    assert p.local_shape(shape, 2) == (4, 3)
    assert p.local_shape(shape, 1) == (0, 3)
    assert p.global_offset(shape, 3) == 18


def test_elementwise_dims_and_one_hot_owner():
    p = RaggedShard((0, 1), (3, 3))
    assert p.local_shape((2, 3), 0) == (3,)
    assert p.local_shape((2, 3, 4), 1) == (3, 4)
    owned = RaggedShard.owned(2, 3)
    assert owned == RaggedShard((), (0, 0, 1)) and owned.owner == 2
    assert owned.local_shape((5, 7), 2) == (5, 7)
    assert owned.local_shape((5, 7), 0) == (0, 7)
    assert owned.local_range((5, 7), 2) == (0, 35)


@pytest.mark.parametrize(
    "make, shape, world, match",
    [
        (lambda: RaggedShard((1,), (1, 1)), None, None, r"prefix.*dims=\(1,\)"),
        (lambda: RaggedShard((0, 2), (1, 1)), None, None, r"prefix.*dims=\(0, 2\)"),
        (lambda: RaggedShard((0,), (1, -2)), None, None, r"non-negative.*rank 1 has -2"),
        (lambda: RaggedShard((0,), ()), None, None, "one entry per rank"),
        (lambda: RaggedShard((), (1, 1)), None, None, r"one-hot.*\(1, 1\)"),
        (lambda: RaggedShard((), (0, 2)), None, None, r"one-hot.*\(0, 2\)"),
        (lambda: RaggedShard((0,), (1, 2)), (4, 5), None, r"sum to 3.*4 rows.*\(4, 5\)"),
        (lambda: RaggedShard((0,), (1, 1)), (4, 5), 3, r"2 local_units.*3 ranks"),
        (lambda: RaggedShard((0, 1, 2), (1, 1)), (4, 5), None, r"more dimensions than shape"),
        (lambda: RaggedShard((0,), (0, 0)), (4, 5), None, "all zero"),
    ],
)
def test_bad_placements_name_the_offender(make, shape, world, match):
    with pytest.raises(ValueError, match=match):
        make().check(shape, world)


def test_empty_tensor_allows_zero_units():
    RaggedShard((0,), (0, 0)).check((0, 5))
    assert RaggedShard((0,), (0, 0)).local_range((0, 5), 1) == (0, 0)


@st.composite
def placed(draw):
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
    k = draw(st.integers(0, ndim))
    world = draw(st.integers(1, 6))
    rows = math.prod(shape[:k])
    if k == 0 or math.prod(shape) == 0:
        owner = draw(st.integers(0, world - 1))
        units = tuple(int(r == owner) for r in range(world)) if math.prod(shape) else (0,) * world
        return shape, RaggedShard(tuple(range(k)), units)
    divisors = [d for d in range(1, rows + 1) if rows % d == 0]
    total = draw(st.sampled_from(divisors))
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=world - 1, max_size=world - 1)))
    units = tuple(b - a for a, b in zip([0, *cuts], [*cuts, total]))
    return shape, RaggedShard(tuple(range(k)), units)


@given(placed())
def test_pieces_tile_the_tensor_and_boxes_match(case):
    shape, p = case
    full = torch.arange(math.prod(shape)).reshape(shape)
    pos = 0
    for r in range(p.world_size):
        start, stop = p.local_range(shape, r)
        assert start == pos
        pos = stop
        assert math.prod(p.local_shape(shape, r)) == stop - start
        boxes = p.boxes(shape, r)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)
        got = [full[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1) for off, size in boxes]
        got = torch.cat(got) if got else torch.empty(0, dtype=torch.long)
        assert got.tolist() == list(range(start, stop))
    assert pos == math.prod(shape)


@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_flat_range_boxes_cover_any_range(shape, data):
    n = math.prod(shape)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    full = torch.arange(n).reshape(shape)
    boxes = flat_range_boxes(tuple(shape), start, stop)
    assert len(boxes) <= 2 * len(shape) - 1
    got = [full[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1) for off, size in boxes]
    assert (torch.cat(got).tolist() if got else []) == list(range(start, stop))
