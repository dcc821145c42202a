"""The packed 8-bit wire format of the unit collectives: ``pack_blockwise``,
``unpack_blockwise`` and ``unpack_sum_blockwise``.

The layout is checked byte for byte against ``quantize_blockwise`` (row ``r``: its codes,
then its fp32 scales as little-endian bytes); the Triton kernels (interpreted, small sizes;
compiled on CUDA with ``TRITON_INTERPRET=0``) against the torch reference, bit for bit:
quantizing is exact (see test_kernels_quant), ``q * s`` is exact, and the row sum is the
same sequence of fp32 additions. NaN payloads are the one thing a GPU may make differently
(it computes a canonical NaN), so scales and values are compared NaN for NaN.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vescale_optim.kernels import (
    _quant_triton,
    dequantize_blockwise,
    pack_blockwise,
    packed_width,
    quantize_blockwise,
    unpack_blockwise,
    unpack_sum_blockwise,
)
from vescale_optim.kernels.quant import MAX_TRITON_BLOCK
from vescale_optim.kernels.wire import codec

NAN, INF = float("nan"), float("inf")
DEVICE = torch.device("cpu" if _quant_triton.INTERPRET else "cuda")
pytestmark = [
    pytest.mark.skipif(
        DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="TRITON_INTERPRET=0 needs a GPU"
    ),
    # the interpreter computes with numpy, which warns about the NaN these tests are about
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning"),  # huge values to fp16
]
BLOCK_SIZES = [1, 3, 32, 64, 100, 256]
KINDS = ["normal", "zero", "constant", "tiny", "huge", "nan", "inf", "-inf", "low-nan", "neg-zero"]
LOW_NANS = torch.tensor([0x7F800001, -0x007FFFFF], dtype=torch.int32).view(torch.float32)
"""NaNs whose payload is only in the low mantissa bits (clearing a scale's low bits must keep
them NaN), one of them negative."""


def _block(kind: str, size: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(size, generator=g)
    at = int(torch.randint(size, (1,), generator=g))
    if kind == "zero":
        return x * 0
    if kind == "neg-zero":
        return torch.full_like(x, -0.0)
    if kind == "constant":
        return torch.full_like(x, -3.5)
    if kind in ("tiny", "huge"):
        return x * (1e-40 if kind == "tiny" else 1e37)
    if kind in ("nan", "inf", "-inf"):
        x[at] = {"nan": NAN, "inf": INF, "-inf": -INF}[kind]
    if kind == "low-nan":
        x[at] = LOW_NANS[at % 2]
    return x


def _input(kinds, rows, block_size, tail, dtype, seed):
    """``rows`` rows of the given blocks, the last cut to ``tail`` elements when ``tail``."""
    g = torch.Generator().manual_seed(seed)
    numel = len(kinds) * block_size - (block_size - tail if tail else 0)
    pieces = [torch.cat([_block(k, block_size, g) for k in kinds])[:numel] for _ in range(rows)]
    return torch.cat(pieces).to(dtype), numel


def _layout(x: torch.Tensor, rows: int, block_size: int) -> torch.Tensor:
    """The packed layout by its definition: each row quantized alone, codes then scale bytes."""
    out = []
    for piece in x.reshape(rows, -1):
        q, scales = quantize_blockwise(piece, block_size, backend="torch")
        out.append(torch.cat([q.view(torch.uint8), scales.view(torch.uint8)]))
    return torch.stack(out)


def _scales(packed: torch.Tensor, numel: int) -> torch.Tensor:
    scale_bytes = packed[:, numel:]
    return torch.empty(scale_bytes.shape, dtype=torch.uint8).copy_(scale_bytes).view(torch.float32)


def _assert_packed_equal(a: torch.Tensor, b: torch.Tensor, numel: int) -> None:
    """Codes byte for byte; scales bit for bit, NaN for NaN."""
    a, b = a.cpu(), b.cpu()
    assert a.shape == b.shape and torch.equal(a[:, :numel], b[:, :numel])
    sa, sb = _scales(a, numel), _scales(b, numel)
    assert torch.equal(sa.isnan(), sb.isnan())
    assert torch.equal(sa[~sa.isnan()].view(torch.int32), sb[~sb.isnan()].view(torch.int32))


def _assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal bits (so -0.0 is not 0.0), NaN for NaN."""
    a, b = a.cpu(), b.cpu()
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.isnan(), b.isnan())
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    assert torch.equal(a[~a.isnan()].view(ints), b[~b.isnan()].view(ints))


def _row_order_sum(packed: torch.Tensor, rows: int, block_size: int, numel: int) -> torch.Tensor:
    """The definition of the owner's sum: each row dequantized in fp32, added in row order."""
    packed = packed.cpu().view(rows, -1)
    total = None
    for r in range(rows):
        q = packed[r, :numel].contiguous().view(torch.int8)
        row = dequantize_blockwise(
            q, _scales(packed[r : r + 1], numel).reshape(-1), block_size, backend="torch"
        )
        total = row if total is None else total + row
    return total


@settings(max_examples=60)
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=5),
    rows=st.integers(1, 4),
    block_size=st.sampled_from(BLOCK_SIZES),
    tail=st.integers(0, 255),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_triton_matches_torch_bit_for_bit(kinds, rows, block_size, tail, dtype, seed):
    """Random sizes, blocks and dtypes, with zero, NaN and Inf blocks and partial last blocks:
    packing, unpacking (into every float dtype) and the row sum agree bit for bit, and the
    packed bytes are the layout's definition."""
    x, numel = _input(kinds, rows, block_size, tail % block_size, dtype, seed)
    ref = pack_blockwise(x, rows, block_size, backend="torch")
    assert ref.shape == (rows, packed_width(numel, block_size)) and ref.dtype == torch.uint8
    _assert_packed_equal(ref, _layout(x, rows, block_size), numel)
    got = pack_blockwise(x.to(DEVICE), rows, block_size, backend="triton")
    _assert_packed_equal(got, ref, numel)
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        want = unpack_blockwise(
            ref, rows, block_size, out_dtype, backend="torch", out=torch.empty(rows * numel, dtype=out_dtype)
        )
        out = torch.empty(rows * numel, dtype=out_dtype, device=DEVICE)
        got = unpack_blockwise(ref.to(DEVICE), rows, block_size, out=out, backend="triton")
        _assert_bits_equal(got, want)
    want = unpack_sum_blockwise(ref, rows, block_size, out=torch.empty(numel), backend="torch")
    _assert_bits_equal(want, _row_order_sum(ref, rows, block_size, numel))
    out = torch.empty(numel, device=DEVICE)
    got = unpack_sum_blockwise(ref.to(DEVICE), rows, block_size, out=out, backend="triton")
    _assert_bits_equal(got, want)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("rows, blocks, block_size", [(1, 3, 256), (4, 2, 100), (3, 5, 3), (2, 9, 1)])
def test_whole_blocks_are_quantize_blockwise_of_the_whole(backend, rows, blocks, block_size):
    """Rows of whole blocks: row r holds codes r*numel.. and scales r*blocks.. of one
    ``quantize_blockwise`` of the whole tensor (as ``pack_rows`` did with copies), the
    round trip is ``dequantize_blockwise``'s, and the "q8" wire codec's calls are these."""
    numel = blocks * block_size
    x = torch.randn(rows * numel, generator=torch.Generator().manual_seed(rows))
    x[block_size // 2] = NAN
    x[-1] = -INF
    q, scales = quantize_blockwise(x, block_size, backend="torch")
    packed = pack_blockwise(x.to(DEVICE), rows, block_size, backend=backend).cpu()
    want = torch.cat([q.view(torch.uint8).view(rows, numel), scales.view(torch.uint8).view(rows, -1)], 1)
    _assert_packed_equal(packed, want, numel)
    q8 = codec("q8", block_size) if block_size % 4 == 0 else None  # the codec takes blocks of 4k
    if DEVICE.type == "cpu" and q8 is not None:
        assert torch.equal(q8.pack(x, rows), packed)
    for dtype in (torch.float32, torch.bfloat16):
        back = unpack_blockwise(packed.to(DEVICE), rows, block_size, dtype, backend=backend)
        assert back.shape == (rows * numel,) and back.dtype == dtype
        _assert_bits_equal(back, dequantize_blockwise(q, scales, block_size, dtype=dtype))
    if q8 is not None:
        back = q8.unpack(packed, torch.bfloat16)
        assert back.shape == (rows * numel,)
        _assert_bits_equal(back, dequantize_blockwise(q, scales, block_size, dtype=torch.bfloat16))
        _assert_bits_equal(q8.unpack_sum(packed), _row_order_sum(packed, rows, block_size, numel))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_pack_and_unpack_write_in_place_at_any_byte(backend):
    """Pack straight into one rank's row of an all-gather buffer (rows start at odd bytes,
    so the scales are not 4-byte aligned), unpack straight into a full buffer and sum into
    a given shard: the buffers given are the ones written, nothing else is touched."""
    world, block_size, numel = 3, 3, 9  # 21-byte rows
    shards = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    wire = torch.full((world, packed_width(numel, block_size)), 0xAB, dtype=torch.uint8, device=DEVICE)
    for rank in (1, 2, 0):
        row = pack_blockwise(shards[rank].to(DEVICE), 1, block_size, out=wire[rank], backend=backend)
        assert row.data_ptr() == wire[rank].data_ptr() and row.shape == (1, wire.shape[1])
        _assert_packed_equal(wire[rank : rank + 1], _layout(shards[rank], 1, block_size), numel)
    full = torch.zeros(world * numel + 5, dtype=torch.bfloat16, device=DEVICE)
    got = unpack_blockwise(wire, world, block_size, out=full[2 : 2 + world * numel], backend=backend)
    assert got.data_ptr() == full[2:].data_ptr()
    assert (full[:2] == 0).all() and (full[2 + world * numel :] == 0).all()
    want = torch.cat([dequantize_blockwise(*quantize_blockwise(s, block_size), block_size) for s in shards])
    _assert_bits_equal(full[2 : 2 + world * numel], want.bfloat16())
    shard = torch.empty(numel, device=DEVICE)
    assert unpack_sum_blockwise(wire, world, block_size, out=shard, backend=backend) is shard
    _assert_bits_equal(shard, _row_order_sum(wire, world, block_size, numel))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_sum_is_in_row_order(backend):
    """Column 0 holds 2**24, 3 and -1 (exact: each row's scale is a power of two, set by its
    127 * 2**k in column 1). In fp32 (ulp 2 from 2**24 on, ties to even) row order gives
    (2**24 + 3 -> 2**24 + 4) - 1 = 2**24 + 3 -> 2**24 + 4, while (r0 + r2) + r1 =
    (2**24 - 1) + 3 and r0 + (r1 + r2) = 2**24 + 2 both give 2**24 + 2: only row order
    (or r1 + r0 first, the same addition) reaches 2**24 + 4."""
    block_size = 2
    rows = [torch.tensor([2.0**24, 127 * 2.0**18]), torch.tensor([3.0, 127.0]), torch.tensor([-1.0, 127.0])]
    packed = pack_blockwise(torch.cat(rows).to(DEVICE), 3, block_size, backend=backend)
    total = unpack_sum_blockwise(packed, 3, block_size, backend=backend).cpu()
    values = unpack_blockwise(packed, 3, block_size, backend=backend).cpu().view(3, -1)
    assert values[:, 0].tolist() == [2.0**24, 3.0, -1.0]  # dequantized exactly
    _assert_bits_equal(total, (values[0] + values[1]) + values[2])
    assert total[0].item() == 2.0**24 + 4
    for other in ((values[0] + values[2]) + values[1], values[0] + (values[1] + values[2])):
        assert other[0].item() == 2.0**24 + 2  # any other order would give this


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_empty_rows(backend):
    packed = pack_blockwise(torch.empty(0, device=DEVICE), 3, 32, backend=backend)
    assert packed.shape == (3, 0)
    assert unpack_blockwise(packed, 3, 32, backend=backend).numel() == 0
    assert unpack_sum_blockwise(packed, 3, 32, backend=backend).numel() == 0


def test_auto_takes_torch_on_cpu_and_for_big_blocks(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("Triton was chosen")

    for name in ("pack", "unpack", "unpack_sum"):
        monkeypatch.setattr(_quant_triton, name, boom)
    big = 2 * MAX_TRITON_BLOCK
    for x, block_size in ((torch.randn(64), 16), (torch.randn(2 * big), big)):
        packed = pack_blockwise(x, 2, block_size)
        _assert_bits_equal(
            unpack_blockwise(packed, 2, block_size),
            dequantize_blockwise(*quantize_blockwise(x, block_size), block_size),
        )
        unpack_sum_blockwise(packed, 2, block_size)
    with pytest.raises(ValueError, match="block_size <= 8192"):
        pack_blockwise(torch.randn(big), 1, big, backend="triton")


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(_quant_triton, "INTERPRET", False)
    packed = pack_blockwise(torch.randn(64), 2, 16, backend="torch")
    for call in (
        lambda: pack_blockwise(torch.randn(64), 2, 16, backend="triton"),
        lambda: unpack_blockwise(packed, 2, 16, backend="triton"),
        lambda: unpack_sum_blockwise(packed, 2, 16, backend="triton"),
    ):
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            call()


PACKED = pack_blockwise(torch.randn(64), 2, 16, backend="torch")  # rows of 32 + 8 bytes


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: pack_blockwise(torch.randn(64), 0, 16), "rows"),
        (lambda: pack_blockwise(torch.randn(64), True, 16), "rows"),
        (lambda: pack_blockwise(torch.randn(65), 2, 16), "multiple of rows"),
        (lambda: pack_blockwise(torch.arange(64), 2, 16), "floating-point"),
        (lambda: pack_blockwise(torch.randn(64), 2, 0), "block_size"),
        (lambda: pack_blockwise(torch.randn(64), 2, 16, backend="gpu"), "backend"),
        (lambda: pack_blockwise(torch.randn(64), 2, 16, out=torch.empty(79, dtype=torch.uint8)), "80"),
        (lambda: pack_blockwise(torch.randn(64), 2, 16, out=torch.empty(80, dtype=torch.int8)), "uint8"),
        (
            lambda: pack_blockwise(torch.randn(64), 2, 16, out=torch.empty(160, dtype=torch.uint8)[::2]),
            "contiguous",
        ),
        (lambda: unpack_blockwise(PACKED.float(), 2, 16), "uint8"),
        (lambda: unpack_blockwise(PACKED, 3, 16), "rows=3"),
        (lambda: unpack_blockwise(PACKED, 2, 8), "whole number"),
        (lambda: unpack_blockwise(PACKED, 2, 16, out=torch.empty(62)), "bytes"),
        (lambda: unpack_blockwise(PACKED, 2, 16, out=torch.empty(63)), "multiple of rows"),
        (lambda: unpack_blockwise(PACKED, 2, 16, out=torch.empty(64, dtype=torch.int32)), "floating-point"),
        (lambda: unpack_blockwise(PACKED, 2, 16, torch.bfloat16, out=torch.empty(64)), "bfloat16"),
        (lambda: unpack_blockwise(PACKED, 2, 16, torch.int8), "dtype"),
        (lambda: unpack_sum_blockwise(PACKED, 2, 16, out=torch.empty(32, dtype=torch.bfloat16)), "float32"),
        (lambda: unpack_sum_blockwise(PACKED, 2, 16, out=torch.empty(33)), "bytes"),
    ],
)
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
