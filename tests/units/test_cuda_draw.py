"""The chunk and offset arithmetic of CUDA's shard-sized random fills (`units/cuda_draw`), on CPU.

`launch` and `fill` below emulate torch's CUDA fill kernels as their source reads
(aten/src/ATen/native/cuda/DistributionTemplates.h: a grid-stride loop of blocks of `block`
threads, a grid of min(saturated, ceil(n / block)) blocks, thread t's Philox stream at (seed,
t, offset), one counter per loop iteration giving `unroll` values, the offset moved on by
ceil(n / (threads * unroll)) * 4; TensorIterator's SplitUntil32Bit: a launch that 32-bit indexing
cannot address takes its whole increment, then is halved until each piece can be, each piece
launched in turn). Each value encodes exactly which (thread, Philox counter, value of the
counter) drew it, so an element drawn from any other stream position differs. Against a whole
emulated fill, the plan's launches, each drawn at its own offset into a scratch of one chunk,
give every element the shard needs bitwise, and the generator's offset after; a box of a
tensor kept through `ShardTarget.meets` / `keep` is its box of the whole fill. Small geometries
(blocks of 4 or 8 threads, a 32-bit limit of a few KiB) reach the saturated grid, many chunks
and the pieces within a few thousand elements."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vescale_optim.units.cuda_draw import Geometry, Launch, plan, run
from vescale_optim.units.shard_init import Attempt, ShardTarget

SEED = 3


class Generator:
    """A CUDA generator's offset, as `get_offset`/`set_offset` and the kernels move it."""

    def __init__(self, offset: int):
        self.offset = offset


def launch(n, offset, blocks, unroll, block):
    """One launch of the grid-stride fill kernel over `n` elements at `offset`: its values
    (seed, thread, Philox counter and value index packed exactly), and its offset increment."""
    grid = min(blocks, -(-n // block))
    threads = block * grid
    element = torch.arange(n, dtype=torch.int64)
    iteration, rest = element // (threads * unroll), element % (threads * unroll)
    value, thread = rest // threads, rest % threads
    counter = offset // 4 + iteration
    return ((SEED * 2**20 + thread) * 2**24 + counter) * 8 + value, -(-n // (threads * unroll)) * 4


def fill(generator, n, blocks, unroll, block, element_size, limit):
    """`distribution_nullary_kernel` on a contiguous tensor of `n` elements."""

    def fits(m):
        return m <= limit and 1 + (m - 1) * element_size <= limit

    out = torch.empty(n, dtype=torch.int64)
    _, increment = launch(n, 0, blocks, unroll, block)
    taken = generator.offset
    generator.offset += increment
    if fits(n):
        out[:], _ = launch(n, taken, blocks, unroll, block)
        return out
    stack = [(0, n)]  # SplitUntil32Bit: the back is split, its first half pushed on top
    while stack:
        start, count = stack.pop()
        if fits(count):
            out[start : start + count] = fill(generator, count, blocks, unroll, block, element_size, limit)
        else:
            stack += [(start + count // 2, count - count // 2), (start, count // 2)]
    return out


@st.composite
def setups(draw):
    block, blocks = draw(st.sampled_from([4, 8])), draw(st.integers(1, 5))
    unroll = draw(st.sampled_from([2, 4]))
    element_size = draw(st.sampled_from([2, 4, 8]))
    period = block * blocks * unroll
    periods = draw(st.integers(1, 3))
    limit = periods * period * element_size + draw(st.integers(1, 3000))  # a chunk is one launch
    geometry = Geometry(blocks, unroll, element_size, block=block, index_limit=limit)
    n = draw(st.integers(1, 3000))
    ranges = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n)), max_size=3))
    return geometry, periods * period, n, [(a, max(a, b)) for a, b in ranges], 4 * draw(st.integers(0, 50))


def _emulated(geometry, launches):
    """`run`'s draw over the emulated kernel, from a scratch of the longest launch."""
    generator = Generator(0)
    scratch = max((launch.length for launch in launches), default=0)

    def draw(length, offset):
        assert length <= scratch
        generator.offset = offset
        g = geometry
        return fill(generator, length, g.blocks, g.unroll, g.block, g.element_size, g.index_limit)

    return draw


@settings(max_examples=300, deadline=None)
@given(setup=setups())
def test_the_chunks_of_a_shard_draw_what_the_whole_fill_draws_there(setup):
    geometry, chunk, n, ranges, base = setup
    generator = Generator(base)
    whole = fill(
        generator,
        n,
        geometry.blocks,
        geometry.unroll,
        geometry.block,
        geometry.element_size,
        geometry.index_limit,
    )

    def needed(start, stop):
        return any(a < stop and start < b for a, b in ranges)

    launches, final = plan(geometry, n, base, chunk, needed)
    assert final == generator.offset  # the offset the whole fill leaves
    got = torch.full((n,), -1, dtype=torch.int64)
    run(launches, _emulated(geometry, launches), lambda part, a, b: got[a:b].copy_(part))
    for a, b in ranges:
        assert torch.equal(got[a:b], whole[a:b]), (a, b)
    assert all(launch.length <= chunk and launch.stop - launch.start <= launch.length for launch in launches)
    assert all(needed(launch.start, launch.stop) for launch in launches)  # no chunk drawn for nothing


def test_the_plan_draws_only_a_shards_chunks_and_a_small_tensor_whole():
    geometry = Geometry(blocks=3, unroll=4, element_size=4, block=8)  # a period of 96
    launches, final = plan(geometry, 1000, 40, 192, lambda a, b: a < 500 and b > 300)
    assert launches == [Launch(192, 384, 192, 40 + 4 * 2), Launch(384, 576, 192, 40 + 4 * 4)]
    assert final == 40 + 4 * math.ceil(1000 / 96)
    assert plan(geometry, 100, 0, 192, lambda a, b: True) == ([Launch(0, 100, 100, 0)], 4 * 2)
    assert plan(geometry, 20, 0, 192, lambda a, b: True) == ([Launch(0, 20, 20, 0)], 4)
    assert plan(geometry, 1000, 0, 192, lambda a, b: False) == ([], final - 40)


def test_a_fill_over_32_bit_indexing_is_drawn_in_the_pieces_torch_launches():
    geometry = Geometry(blocks=2, unroll=4, element_size=4, block=4, index_limit=400)  # 100 elements fit
    assert geometry.pieces(250) == [(0, 62), (62, 63), (125, 62), (187, 63)]
    assert geometry.pieces(100) == [(0, 100)]
    generator = Generator(0)
    whole = fill(generator, 250, 2, 4, 4, 4, 400)
    launches, final = plan(geometry, 250, 0, 64, lambda a, b: True)
    assert final == generator.offset == 4 * (8 + 2 + 2 + 2 + 2)  # the whole's 8 iterations, then each piece's
    got = torch.empty(250, dtype=torch.int64)
    run(launches, _emulated(geometry, launches), lambda part, a, b: got[a:b].copy_(part))
    assert torch.equal(got, whole)


def test_chunks_are_whole_periods_one_launch_can_index():
    h200 = Geometry(blocks=132 * 8, unroll=4, element_size=4)  # 132 multiprocessors of 2048 threads
    assert h200.period == 256 * 1056 * 4 and h200.chunk() == 7 * h200.period  # about 32 MiB
    assert Geometry(1056, 2, 8).chunk() == 7 * 256 * 1056 * 2
    assert h200.chunk(1) == h200.period
    small = Geometry(blocks=2, unroll=4, element_size=4, block=4, index_limit=400)  # 100 elements fit
    assert small.chunk(10_000) == 3 * small.period


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 12), min_size=1, max_size=3),
    cut=st.data(),
    blocks=st.integers(1, 4),
    limit=st.sampled_from([2**31 - 1, 800]),
)
def test_a_box_kept_from_the_chunks_is_its_box_of_the_whole_fill(shape, cut, blocks, limit):
    """`ShardTarget.meets` picks the chunks and `ShardTarget.keep` cuts them into the shard."""
    origin = [cut.draw(st.integers(0, n - 1)) for n in shape]
    sizes = [cut.draw(st.integers(1, n - o)) for n, o in zip(shape, origin)]
    geometry = Geometry(blocks, 4, 8, block=4, index_limit=limit)
    n = math.prod(shape)
    generator = Generator(12)
    whole = fill(generator, n, blocks, 4, 4, 8, limit).double().reshape(shape)
    shard = torch.full(sizes, -1.0, dtype=torch.float64)
    target = ShardTarget("w", tuple(shape), torch.float64, tuple(origin), shard, Attempt(torch.device("cpu")))
    launches, final = plan(geometry, n, 12, geometry.period, target.meets)
    draw = _emulated(geometry, launches)
    run(launches, lambda length, offset: draw(length, offset).double(), target.keep)
    want = whole
    for d, (o, s) in enumerate(zip(origin, sizes)):
        want = want.narrow(d, o, s)
    assert torch.equal(shard, want) and final == generator.offset
