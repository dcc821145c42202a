"""Meta-device initialisation of each rank's own TP shard (`units/shard_init`).

One process: a stand-in of the whole shape on the meta device, cut to a box, run through torch's
own `nn.init` functions in chunks of a few elements, holds the box of the whole tensor those
functions fill under the same seed, bitwise, and leaves the random state where the whole draw
leaves it (hypothesis over shapes, boxes, chunks and dtypes); an op its shard cannot reproduce is
refused by `NeedsWhole`. Four gloo ranks: an expert stack `[8, 256, 256]` cut `Shard(0)` and a
matrix cut `Shard(1)`, built on the meta device and materialised by vo.AdamW at dp1 x tp4 and
dp2 x tp2, equal the model built normally under seed 0 bitwise, and no allocation during
materialisation is as large as the expert stack (the old path made it whole on every rank); a
module whose initialisation needs whole tensors (`orthogonal_`, its own generator, a plain
parameter drawn in between) is rewound and made whole, bitwise the same. On a GPU: boxes of a
64 Mi-element tensor drawn only through their chunks (`units/cuda_draw`) are bitwise their boxes
of the whole draw, with the CUDA generator's state after, in float32, bfloat16 and float64; no
scratch beyond one chunk is allocated; a geometry the self-check refutes is drawn whole with a
warning; a parameter over 2^31 bytes is drawn in the pieces torch launches."""

import math

import pytest
import torch
from _tp import full, mesh
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.profiler import ProfilerActivity, profile

import vescale_optim as vo
from vescale_optim.units import cuda_draw
from vescale_optim.units.shard_init import Attempt, NeedsWhole, ShardTarget, stand_in

CPU = torch.device("cpu")
SHARD_PATH = {  # initialisations the shard path reproduces
    "uniform_": lambda w: nn.init.uniform_(w, -0.3, 0.7),
    "normal_": lambda w: nn.init.normal_(w, 0.1, 0.02),
    "kaiming_uniform_": lambda w: nn.init.kaiming_uniform_(w, a=math.sqrt(5)),
    "kaiming_normal_": lambda w: nn.init.kaiming_normal_(w),
    "xavier_uniform_": lambda w: nn.init.xavier_uniform_(w),
    "trunc_normal_": lambda w: nn.init.trunc_normal_(w, std=0.02),  # no draw rejected
    "ones_then_mul": lambda w: nn.init.ones_(w).mul_(0.5).add_(0.25),
    "data.normal_": lambda w: w.data.normal_(0.0, 0.02),
    "own_generator": lambda w: w.uniform_(-1, 1, generator=torch.Generator().manual_seed(5)).clamp_(-1, 0.4),
    "copy_": lambda w: w.copy_(torch.arange(w.shape[-1], dtype=w.dtype)),
    "in_place_operators": lambda w: w.normal_().__imul__(0.5).__iadd__(torch.ones(w.shape[-1])),
}
WHOLE_ONLY = {  # initialisations that need the whole tensor
    "orthogonal_": nn.init.orthogonal_,
    "trunc_normal_rejecting": nn.init.trunc_normal_,  # std 1 in [-2, 2]: draws are rejected
    "write_through_a_view": lambda w: w[0].zero_(),
    "eye_": nn.init.eye_,
    "bernoulli_": lambda w: w.bernoulli_(0.5),
    "exp_": lambda w: w.normal_().exp_(),  # its vector and scalar kernels round apart
    "add_alpha": lambda w: w.zero_().add_(torch.ones(w.shape[-1]), alpha=0.3),
    "reads_values": lambda w: w.normal_().copy_(w.flip(0)),
}


def _box_of(t, origin, sizes):
    for d, (o, n) in enumerate(zip(origin, sizes)):
        t = t.narrow(d, o, n)
    return t


def _rng_state(device):
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _on_shard(shape, origin, sizes, fn, dtype=torch.float32, chunk=16, seed=1, device=CPU):
    """`fn` applied to the whole tensor and to a stand-in of `shape` cut to the box
    (`origin`, `sizes`) under `seed`, on `device`: (the whole's box, the shard, the random
    states after each), or NeedsWhole's reason."""
    torch.manual_seed(seed)
    whole = torch.empty(shape, dtype=dtype, device=device)
    with torch.no_grad():
        fn(whole)
    after_whole = _rng_state(device)
    torch.manual_seed(seed)
    shard = torch.full(sizes, float("nan"), dtype=dtype, device=device)
    target = ShardTarget("w", shape, dtype, origin, shard, Attempt(device), chunk=chunk)
    try:
        with torch.no_grad():
            fn(stand_in(target, requires_grad=True))
    except NeedsWhole as e:
        return str(e)
    assert target.written
    return _box_of(whole, origin, sizes), shard, after_whole, _rng_state(device)


@st.composite
def boxes(draw, min_dims=1):
    shape = draw(st.lists(st.integers(1, 24), min_size=min_dims, max_size=3))
    origin, sizes = [], []
    for n in shape:
        o = draw(st.integers(0, n))
        origin.append(o)
        sizes.append(draw(st.integers(0, n - o)))
    return tuple(shape), tuple(origin), tuple(sizes)


@given(
    box=boxes(min_dims=2),
    name=st.sampled_from(sorted(SHARD_PATH)),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    chunk=st.sampled_from([16, 32, 48, 80, None]),
)
def test_a_shard_drawn_in_chunks_is_bitwise_its_box_of_the_whole_draw(box, name, dtype, chunk):
    """`chunk` None: the whole tensor drawn into one scratch buffer (CUDA's way)."""
    shape, origin, sizes = box
    got = _on_shard(shape, origin, sizes, SHARD_PATH[name], dtype, chunk)
    assert not isinstance(got, str), got
    want, shard, rng_whole, rng_shard = got
    assert torch.equal(shard, want)
    assert torch.equal(rng_shard, rng_whole)  # the random state moved on as after the whole draw


@given(n=st.integers(1, 700), chunk=st.sampled_from([16, 32, 64]), seed=st.integers(0, 9))
def test_one_dimension_across_many_chunks(n, chunk, seed):
    """`normal_` redraws the last 16 of a count that is no multiple of 16, and uses another
    method below 16: chunks of multiples of 16, the last one 16 or longer, draw the same."""
    for fn in (SHARD_PATH["normal_"], SHARD_PATH["uniform_"]):
        box = (n,), (n // 3,), (n - n // 3,)
        want, shard, rng_whole, rng_shard = _on_shard(*box, fn, chunk=chunk, seed=seed)
        assert torch.equal(shard, want) and torch.equal(rng_shard, rng_whole)


@pytest.mark.parametrize("name", sorted(WHOLE_ONLY))
def test_what_the_shard_cannot_reproduce_is_refused_by_name(name):
    got = _on_shard((12, 20), (3, 5), (6, 10), WHOLE_ONLY[name])
    assert isinstance(got, str) and "w" in got, name


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's draws")
BIG = (64, 1024, 1024)  # 64 Mi elements: several chunks of about 32 MiB (`cuda_draw.CHUNK_BYTES`)
CUDA_BOXES = {  # of BIG: a Shard(0), Shard(1) and Shard(2) cut over tp4, and the last element
    "rows": ((16, 0, 0), (16, 1024, 1024)),
    "columns": ((0, 256, 0), (64, 256, 1024)),
    "tail": ((0, 0, 768), (64, 1024, 256)),
    "last": ((63, 1023, 1023), (1, 1, 1)),
}


def _own_generator_twice(w):
    """Two fills from one generator of the device: the second draws where the first left it."""
    g = torch.Generator(w.device).manual_seed(5)
    return w.uniform_(generator=g).normal_(generator=g)


def _cuda():
    return torch.device("cuda", torch.cuda.current_device())


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    "name", ["uniform_", "normal_", "kaiming_uniform_", "trunc_normal_", "own_generator", "copy_"]
)
def test_on_cuda_a_shard_drawn_chunk_by_chunk_is_bitwise_its_box(name, dtype):
    """Only the chunks that hold the shard are drawn, each at its offset in the whole draw's
    stream (`cuda_draw`): the shard is bitwise its box of the whole draw, the generator's state
    after is the whole draw's; a small tensor is drawn whole; a module that needs whole tensors
    rewinds CUDA's generator too."""
    fn = _own_generator_twice if name == "own_generator" else SHARD_PATH[name]
    for box, (origin, sizes) in CUDA_BOXES.items():
        want, shard, rng_whole, rng_shard = _on_shard(BIG, origin, sizes, fn, dtype, device=_cuda())
        assert torch.equal(shard, want) and torch.equal(rng_shard, rng_whole), box
    small = (6, 100, 70), (0, 25, 0), (6, 50, 70)  # under a chunk: drawn whole
    want, shard, rng_whole, rng_shard = _on_shard(*small, fn, dtype, device=_cuda())
    assert torch.equal(shard, want) and torch.equal(rng_shard, rng_whole)
    attempt = Attempt(_cuda())
    torch.empty(100, device=_cuda()).normal_()
    attempt.rewind()
    assert torch.equal(torch.cuda.get_rng_state(_cuda()), attempt.cuda)


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_no_scratch_is_larger_than_one_chunk(dtype):
    """A rank's Shard(0) quarter of BIG by `trunc_normal_` (a fill, then the whole draw's bounds
    replayed chunk by chunk for its rejection test): the most memory allocated beyond the shard
    is one chunk, where the whole-parameter draw needed all of BIG."""
    cuda, (origin, sizes) = _cuda(), CUDA_BOXES["rows"]
    fn = SHARD_PATH["trunc_normal_"]
    _on_shard(BIG, origin, sizes, fn, dtype, device=cuda)  # the self-check, once per process, first
    chunk_bytes = cuda_draw.geometry_of(cuda, dtype).chunk() * dtype.itemsize
    whole_bytes = math.prod(BIG) * dtype.itemsize
    shard = torch.empty(sizes, dtype=dtype, device=cuda)
    target = ShardTarget("w", BIG, dtype, origin, shard, Attempt(cuda))
    torch.cuda.synchronize(cuda)
    torch.cuda.reset_peak_memory_stats(cuda)
    before = torch.cuda.memory_allocated(cuda)
    with torch.no_grad():
        fn(stand_in(target, requires_grad=True))
    peak = torch.cuda.max_memory_allocated(cuda) - before
    # the allocator may leave up to 1 MiB of a block unsplit; aminmax's results are a few bytes
    assert peak <= chunk_bytes + (4 << 20) and 2 * chunk_bytes < whole_bytes, (peak, chunk_bytes, whole_bytes)


@CUDA
def test_on_cuda_a_geometry_its_self_check_refutes_is_drawn_whole_with_a_warning(monkeypatch):
    """Were torch's kernels to lay elements otherwise, the calibration would find it: a wrong
    grid fails it, the fill is drawn whole (bitwise still), and a warning names the cost, once."""
    real = cuda_draw.geometry_of

    def wrong(device, dtype):
        g = real(device, dtype)
        return cuda_draw.Geometry(g.blocks + 1, g.unroll, g.element_size)

    monkeypatch.setattr(cuda_draw, "geometry_of", wrong)
    monkeypatch.setattr(cuda_draw, "_VERDICTS", {})
    origin, sizes = CUDA_BOXES["rows"]
    with pytest.warns(RuntimeWarning, match="drawn whole"):
        got = _on_shard(BIG, origin, sizes, SHARD_PATH["normal_"], device=_cuda())
    want, shard, rng_whole, rng_shard = got
    assert torch.equal(shard, want) and torch.equal(rng_shard, rng_whole)
    assert cuda_draw._VERDICTS[(_cuda(), torch.float32, "normal_", False)] is not None


@CUDA
@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory < 32 << 30, reason="32 GiB"
)
@pytest.mark.parametrize("name", ["uniform_", "normal_"])
def test_on_cuda_a_parameter_over_2_gib_is_drawn_in_the_pieces_torch_launches(name):
    """fp32 [4, 2^27 + 2^20]: over 2^31 bytes, torch draws it as two tensors of its halves (rows
    0-1 and 2-3), after taking the whole's offset increment; shards across and beside the halves'
    seam are bitwise their boxes, the generator's state after the whole draw's."""
    shape = (4, 2**27 + 2**20)
    for origin, sizes in [((1, 0), (2, shape[1])), ((0, 5), (4, 1000)), ((3, shape[1] - 7), (1, 7))]:
        want, shard, rng_whole, rng_shard = _on_shard(shape, origin, sizes, SHARD_PATH[name], device=_cuda())
        assert torch.equal(shard, want) and torch.equal(rng_shard, rng_whole), origin


# --- materialised by the optimizer: 4 gloo ranks --------------------------------------------------------

E, D, H, ROWS, COLS = 8, 256, 256, 512, 384


class Stack(nn.Module):
    """An expert stack initialised as torchtitan's experts are (`trunc_normal_`, std 0.02), and a
    matrix as `nn.Linear` is (`kaiming_uniform_`)."""

    def __init__(self):
        super().__init__()
        self.experts = nn.Parameter(torch.empty(E, D, H))
        self.proj = nn.Parameter(torch.empty(ROWS, COLS))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.trunc_normal_(self.experts, std=0.02)
        nn.init.kaiming_uniform_(self.proj, a=math.sqrt(5))


class Odd(nn.Module):
    """An initialisation the shard path cannot finish: a DTensor parameter filled from the
    module's generator on the shard path, a plain one from another generator of its own and one
    replaced by a new parameter drawn from the default generator, then `orthogonal_`; the rewind
    must restore all three generators, and the parameters the optimizer holds."""

    def __init__(self):
        super().__init__()
        self.gen, self.plain_gen = torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)
        self.a, self.c = nn.Parameter(torch.empty(16, 12)), nn.Parameter(torch.empty(12, 16))
        self.b, self.d = nn.Parameter(torch.empty(5)), nn.Parameter(torch.empty(3))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.a, generator=self.gen)
        nn.init.uniform_(self.b, generator=self.plain_gen)
        self.d = nn.Parameter(torch.rand(3))
        nn.init.orthogonal_(self.c, generator=self.gen)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.stack, self.odd = Stack(), Odd()


LAYOUT = {"stack.experts": Shard(0), "stack.proj": Shard(1), "odd.a": Shard(1), "odd.c": Shard(0)}


def _allocations(prof) -> tuple[int, int]:
    """(the largest allocation, the peak of what was allocated) in `prof`'s CPU memory events."""
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    largest = now = peak = 0
    for e in events:
        now += e.self_cpu_memory_usage
        largest, peak = max(largest, e.self_cpu_memory_usage), max(peak, now)
    return largest, peak


def _materialised(shape):
    """The model built on the meta device under this rank's own seed (rank 0's is the reference's:
    every rank draws from it), its parameters cut by
    LAYOUT over tp, then materialised by vo.AdamW over dp (a unit per module): its whole state,
    and the allocations while the optimizer was built."""
    world = mesh(*shape)
    rank = torch.distributed.get_rank()
    torch.manual_seed(0 if rank == 0 else 100 + rank)
    with torch.device("meta"):
        model = Model()
    for name, placement in LAYOUT.items():
        owner, leaf = model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
        dt = distribute_tensor(getattr(owner, leaf), world["tp"], [placement])
        setattr(owner, leaf, nn.Parameter(dt))
    assert model.stack.experts.is_meta and isinstance(model.stack.experts, DTensor)
    held = list(model.parameters())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        vo.AdamW(held, mesh=world["dp"], shard_modules=[model.stack, model.odd, model], lr=0.1)
    assert all(p is q for p, q in zip(model.parameters(), held, strict=True))  # the optimizer's own
    return full(model.state_dict()), _allocations(prof)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(1, 4), (2, 2)], ids=["dp1xtp4", "dp2xtp2"])
def test_meta_expert_stack_materialises_only_each_ranks_shard(world, shape):
    torch.manual_seed(0)
    want = {k: v.detach().clone() for k, v in Model().state_dict().items()}
    stack_bytes = E * D * H * 4
    unit_bytes = (E * D * H + ROWS * COLS) * 4 // shape[1]  # the stack's unit: this rank's TP shards
    for got, (largest, peak) in world(4).run(_materialised, shape, timeout=120):
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k
        # the old path made the stack whole on every rank; now the unit and a chunk's scratch
        assert largest <= unit_bytes < stack_bytes, (largest, peak)
