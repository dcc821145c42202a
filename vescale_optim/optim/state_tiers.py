"""The storage tiers of element-wise optimizer state, one codec each: fp32, bf16, 8-bit blocks.

A state tensor lives in one of three tiers, chosen from the parameter's own size and the
optimizer's `state_bits`, never from its sharding: `fp32` (the parameters' update precision:
fp32, or float64), `bf16` (round to nearest) or `q8` — int8 codes with one fp32 absmax scale
per block of `BLOCK` elements counted from the tensor's start. Tensors under `QUANT_MIN_NUMEL`
elements keep fp32. In a q8 segment every offset and the shard size are multiples of the
block, so blocks never straddle ranks and the local slice can be (de)quantized as a whole:
its block grid is the tensors'.

Each tier is a codec (`units.segment.StateCodec`) that a segment holds: it allocates the
state, decodes it to the update precision and encodes it back; the optimizers and the state
dicts reach the state only through it (`Segment.read` / `Segment.store`). This module is
the one place that names the tiers. `Kept` holds one state tensor kept whole on one rank
through a segment's codec. A q8 codec stores a `StateSpec(stored_as_sqrt=True)` as
`sqrt(v)` (see `kernels.adamw8bit_update_`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kernels import dequantize_blockwise, quantize_blockwise
from ..units.segment import FROZEN, StateSpec

QUANT_MIN_NUMEL = 4096
BLOCK = 256
STATE_BITS = (32, 16, 8)


def check_state_bits(state_bits: int) -> None:
    if state_bits not in STATE_BITS:
        raise ValueError(f"state_bits must be one of {STATE_BITS}; got {state_bits!r}")


class Exact:
    """State at the parameters' update precision: stored tensors are the working copies."""

    tier, exact, block, align = "fp32", True, None, 1

    def granule(self, p: torch.Tensor, structural: int) -> int:
        """The layout granule of `p`, given the optimizer's own (`structural`)."""
        return structural

    def allocate(self, specs: Sequence[StateSpec], n: int, device, dtype: torch.dtype) -> dict:
        return {s.name: torch.zeros(n, dtype=dtype, device=device) for s in specs}

    def decode(self, state: dict[str, torch.Tensor], spec: StateSpec) -> torch.Tensor:
        return state[spec.name]

    def decode_range(self, state: dict[str, torch.Tensor], spec: StateSpec, start: int, stop: int):
        return state[spec.name][start:stop]

    def encode_(self, state: dict[str, torch.Tensor], spec: StateSpec, x: torch.Tensor) -> None:
        if x.data_ptr() != state[spec.name].data_ptr():
            state[spec.name].copy_(x)


class Rounded(Exact):
    """bf16 state, rounded to nearest; decoded to fp32 copies."""

    tier, exact = "bf16", False

    def allocate(self, specs: Sequence[StateSpec], n: int, device, dtype: torch.dtype) -> dict:
        return {s.name: torch.zeros(n, dtype=torch.bfloat16, device=device) for s in specs}

    def decode(self, state: dict[str, torch.Tensor], spec: StateSpec) -> torch.Tensor:
        return state[spec.name].float()

    def decode_range(self, state: dict[str, torch.Tensor], spec: StateSpec, start: int, stop: int):
        return state[spec.name][start:stop].float()


class Blocks:
    """8-bit state: `name.q` int8 codes and `name.scales`, one fp32 absmax scale per block
    of `block` elements; a spec `stored_as_sqrt` is quantized as its square root."""

    tier, exact, block, align = "q8", False, BLOCK, BLOCK

    def granule(self, p: torch.Tensor, structural: int) -> int:
        """Cut between blocks; a tensor whose size is not a multiple of the block stays
        whole on one rank, so its partial last block is not split either."""
        return self.block if p.numel() % self.block == 0 else p.numel()

    def allocate(self, specs: Sequence[StateSpec], n: int, device, dtype: torch.dtype) -> dict:
        out = {}
        for s in specs:
            out[f"{s.name}.q"] = torch.zeros(n, dtype=torch.int8, device=device)
            out[f"{s.name}.scales"] = torch.zeros(-(-n // self.block), dtype=torch.float32, device=device)
        return out

    def parts(self, state: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes and scales of state `name` (for kernels that update them in place)."""
        return state[f"{name}.q"], state[f"{name}.scales"]

    def decode(self, state: dict[str, torch.Tensor], spec: StateSpec) -> torch.Tensor:
        x = dequantize_blockwise(*self.parts(state, spec.name), self.block)
        return x.square_() if spec.stored_as_sqrt else x

    def decode_range(self, state: dict[str, torch.Tensor], spec: StateSpec, start: int, stop: int):
        """Only the blocks that hold `[start, stop)` are decoded (the grid starts at element 0)."""
        blk, (q, scales) = self.block, self.parts(state, spec.name)
        first, last = start // blk, -(-stop // blk)
        x = dequantize_blockwise(q[first * blk : last * blk], scales[first:last], blk)
        x = x[start - first * blk : stop - first * blk]
        return x.square_() if spec.stored_as_sqrt else x

    def encode_(self, state: dict[str, torch.Tensor], spec: StateSpec, x: torch.Tensor) -> None:
        q, scales = quantize_blockwise(x.sqrt() if spec.stored_as_sqrt else x, self.block)
        codes, kept = self.parts(state, spec.name)
        codes.copy_(q)
        kept.copy_(scales)


class Kept:
    """One state tensor of `n` elements kept whole on one rank (NorMuon's per-row `v`), in a
    codec's tier, as one buffer: `buffer` is the tensor held (fp32 or bf16; for q8 int8: the
    blocks' fp32 scales as bytes, then the codes), so counting it counts the state's bytes.
    Its block grid starts at its own element 0, so it codes the same at any world size."""

    def __init__(self, codec: Exact | Blocks, spec: StateSpec, n: int, device):
        self.codec, self.spec = codec, spec
        if isinstance(codec, Blocks):
            head = 4 * -(-n // codec.block)
            self.buffer = torch.zeros(head + n, dtype=torch.int8, device=device)
            self._state = {
                f"{spec.name}.scales": self.buffer[:head].view(torch.float32),
                f"{spec.name}.q": self.buffer[head:],
            }
        else:
            self._state = codec.allocate([spec], n, device, torch.float32)
            self.buffer = self._state[spec.name]

    def decode(self) -> torch.Tensor:
        """The values in fp32 (the buffer itself in the fp32 tier, so in-place math keeps)."""
        return self.codec.decode(self._state, self.spec)

    def encode_(self, x: torch.Tensor) -> None:
        """Store `x` (a no-op for the fp32 buffer itself)."""
        self.codec.encode_(self._state, self.spec, x.reshape(-1))


FP32, BF16, Q8 = Exact(), Rounded(), Blocks()
_BY_TIER = {FP32.tier: FP32, BF16.tier: BF16, Q8.tier: Q8, FROZEN: FP32}  # frozen: no state at all
_BY_BITS = {32: FP32, 16: BF16, 8: Q8}


def codec_for(p: torch.Tensor, state_bits: int) -> Exact | Blocks:
    """The tier a trainable parameter's state lives in."""
    return FP32 if p.numel() < QUANT_MIN_NUMEL else _BY_BITS[state_bits]


def precision_problem(params: Sequence[torch.Tensor], state_bits: int, labels: dict[int, str]) -> str | None:
    """Why `state_bits` does not fit some trainable float64 parameter (it would keep its state
    below the update precision), or None."""
    for p in params:
        if p.requires_grad and p.dtype == torch.float64 and not codec_for(p, state_bits).exact:
            return (
                f"parameter {labels[id(p)]} is float64, but state_bits={state_bits} would keep its "
                "state below fp32; use state_bits=32"
            )
    return None


def codec_of(tier: str) -> Exact | Blocks:
    """The codec of a segment's tier."""
    return _BY_TIER[tier]
