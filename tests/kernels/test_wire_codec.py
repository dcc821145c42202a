"""The wire-codec registry (`kernels.wire`): `gather_bits` / `reduce_bits` resolve to a
registered codec, and a new wire format is its kernel and one registration, nothing
else. The proof is `Q16` below, a format this file alone defines (bf16 truncation: the top
16 bits of each fp32) and registers: the public `gather_bits=16, reduce_bits=16` path then
gathers and reduces through it, in one process and over 2 gloo ranks, to the bits of its
own round trip and within its precision of full precision."""

from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from _tiny_gpt import batch, build

import vescale_optim as vo
from vescale_optim.kernels import wire

BLOCK = 8


class Q16(wire.WireCodec):
    """Test-only: each fp32 truncated to its top 16 bits (a bf16), 2 bytes an element."""

    name = "q16"
    bits = 16

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.block

    def packed_width(self, numel: int) -> int:
        return 2 * numel  # a partial last block takes only its elements

    def pack(self, x, rows=1, out=None):
        top = (x.reshape(rows, -1).float().view(torch.int32) >> 16).to(torch.int16)
        packed = top.view(torch.uint8)
        return packed if out is None else out.view(rows, -1).copy_(packed)

    def unpack(self, buf, dtype=None, out=None):
        values = (buf.view(torch.int16).to(torch.int32) << 16).view(torch.float32).reshape(-1)
        return values.to(dtype or torch.float32) if out is None else out.copy_(values)

    def unpack_sum(self, bufs, out=None):
        rows = self.unpack(bufs).view(bufs.shape[0], -1)
        total = rows[0].clone()
        for row in rows[1:]:
            total.add_(row)
        return total if out is None else out.copy_(total)


@contextmanager
def _registered(codec):
    wire.register(codec)
    try:
        yield codec
    finally:
        wire.unregister(codec.name)


# --- the registry -------------------------------------------------------------------------------


def test_8_bits_resolve_to_the_q8_codec_in_the_block_asked_for():
    q8 = wire.codec(8)
    assert q8 is wire.codec("q8") and q8.name == "q8" and q8.bits == 8 and q8.block == 256
    q8 = wire.codec(8, 64)
    assert isinstance(q8, wire.Q8) and q8.block == 64 and q8.bytes_per_block == 68
    assert q8.packed_width(128) == 2 * 68 and q8.packed_width(100) == 100 + 2 * 4  # codes, then scales


def test_an_unknown_codec_is_a_value_error_naming_the_known_ones():
    for unknown in ("q3", 4, True, None, 8.0):
        with pytest.raises(ValueError, match=r"no wire codec .*known ones are 'q8' \(8 bits\)"):
            wire.codec(unknown)
    with pytest.raises(ValueError, match=r"gather_bits must be None .*'q8' \(8 bits\); got 4"):
        vo.AdamW(build(layers=1).parameters(), gather_bits=4)


def test_a_name_or_bits_taken_is_refused_and_a_codec_checks_its_block():
    with pytest.raises(ValueError, match="registered already"):
        wire.register(wire.Q8(64))
    with pytest.raises(TypeError, match="WireCodec instance"):
        wire.register(wire.Q8)
    with pytest.raises(ValueError, match="q8 codec's block must be a multiple of 4"):
        wire.Q8(6)
    with _registered(Q16(BLOCK)):
        assert wire.codec(16) is wire.codec("q16") and "'q16' (16 bits)" in wire.known()
        with pytest.raises(ValueError, match="registered already"):
            wire.register(Q16(4))
        model = build(layers=1)
        vo.AdamW(model.parameters(), gather_bits=16, comm_block=6)  # q16 takes any block ...
        with pytest.raises(ValueError, match="comm_block must be a multiple of 4"):  # ... q8 does not
            vo.AdamW(model.parameters(), gather_bits=16, reduce_bits=8, comm_block=6)
    with pytest.raises(ValueError, match="no wire codec 16"):
        wire.codec(16)


# --- gather and reduce through a codec this file registered ---------------------------------------


def _through_q16(world_size: int) -> int:
    """Layer 0's gathered parameters and the reduced gradient shards, with `gather_bits=16,
    reduce_bits=16`, against Q16's own round trip (bit for bit) and full precision (within
    bf16 truncation: 2**-7 of each value). Returns the gradient elements checked."""
    with _registered(Q16(BLOCK)) as q16:
        rank = dist.get_rank() if dist.is_initialized() else 0
        model = build(layers=2)
        want = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = vo.AdamW(
            model.parameters(),
            shard_modules=[*model.layers, model],
            gather_bits=16,
            reduce_bits=16,
            comm_block=BLOCK,
        )
        assert all(u.gather_codec.name == "q16" and u.layout.shard_size % BLOCK == 0 for u in opt.units)
        seen = {}
        model.layers[0].register_forward_pre_hook(
            lambda m, a: seen.update({n: p.detach().clone() for n, p in m.named_parameters()})
        )
        with torch.no_grad():
            model(batch(0, 0)[0])
        assert seen
        for name, got in seen.items():
            exact = want[f"layers.0.{name}"]
            assert torch.equal(got, q16.unpack(q16.pack(exact)).view(exact.shape)), name
            assert bool(((got - exact).abs() <= exact.abs() * 2**-7).all()), name

        named = list(model.named_parameters())
        grads = [
            {
                n: torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * r + i))
                for i, (n, p) in enumerate(named)
            }
            for r in range(world_size)
        ]
        for n, p in model.named_parameters():
            p.grad = grads[rank][n].clone()
        opt.reduce_gradients()
        checked = 0
        for u in opt.units:
            for i, p in enumerate(u.params):
                lo, hi = u.full.local_range(i)
                start, stop = u.full.tensor_range(i)
                if hi <= lo:
                    continue
                name = next(n for n, q in model.named_parameters() if q is p)
                pieces = [g[name].reshape(-1)[start:stop] for g in grads]
                got = u.grads.shard[lo:hi]
                own = q16.unpack_sum(q16.pack(torch.stack(pieces), world_size)).div_(world_size)
                assert torch.equal(got, own), name  # the rows decoded and summed in rank order
                bound = torch.stack(pieces).abs().mean(0) * 2**-7 + 1e-7
                assert bool(((got - torch.stack(pieces).mean(0)).abs() <= bound).all()), name
                checked += hi - lo
        return checked


def test_a_codec_registered_here_serves_gather_and_reduce_bits_in_one_process():
    assert _through_q16(1) > 0
    with pytest.raises(ValueError, match="no wire codec 16"):
        wire.codec(16)  # unregistered again


def test_a_codec_registered_here_serves_gather_and_reduce_bits_over_two_ranks(world):
    checked = world(2).run(_through_q16, 2, timeout=120)
    assert all(n > 0 for n in checked), checked
