"""Low-precision optimizer state: bf16 moments or block-quantized (int8) moments.

A moment lives in one of three tiers, chosen from the tensor's own shape and never
from its sharding: `fp32`; `bf16` (round to nearest); `q8` — int8 codes with one
fp32 absmax scale per block of `block` elements counted from the tensor's start.
Tensors under `QUANT_MIN_NUMEL` elements keep fp32. In a q8 bucket every offset
and the shard size are multiples of the block, so blocks never straddle ranks and
the local slice can be (de)quantized as a whole: its block grid is the tensors'.

Second moments in q8 are stored as `sqrt(v)` (see `kernels.adamw8bit_update_`).
"""

from __future__ import annotations

import torch

from ..kernels import dequantize_blockwise, quantize_blockwise
from ..units.segment import FROZEN

QUANT_MIN_NUMEL = 4096
BLOCK = 256
STATE_BITS = (32, 16, 8)


def kind(tier: str) -> str:
    """The storage of a segment's state from its tier: frozen parameters keep none (fp32)."""
    return "fp32" if tier == FROZEN else tier


def check_state_bits(state_bits: int) -> None:
    if state_bits not in STATE_BITS:
        raise ValueError(f"state_bits must be one of {STATE_BITS}; got {state_bits!r}")


def tier(p: torch.Tensor, state_bits: int) -> str:
    if state_bits == 32 or p.numel() < QUANT_MIN_NUMEL:
        return "fp32"
    return "bf16" if state_bits == 16 else "q8"


def q8_granule(p: torch.Tensor) -> int:
    """A q8 tensor is cut between blocks; one whose size is not a multiple of the block
    stays whole on one rank, so its partial last block is not split either."""
    return BLOCK if p.numel() % BLOCK == 0 else p.numel()


def new_state(
    names: list[str], kind: str, n: int, device, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Zero state for `names`: `name` itself in bf16 or at full precision (`dtype`, the
    parameters' update precision: fp32, or float64), or `name.q` + `name.scales`."""
    if kind == "q8":
        out = {}
        for name in names:
            out[f"{name}.q"] = torch.zeros(n, dtype=torch.int8, device=device)
            out[f"{name}.scales"] = torch.zeros(-(-n // BLOCK), dtype=torch.float32, device=device)
        return out
    dtype = torch.bfloat16 if kind == "bf16" else dtype
    return {name: torch.zeros(n, dtype=dtype, device=device) for name in names}


def decode(state: dict[str, torch.Tensor], name: str, kind: str, sqrt: bool = False) -> torch.Tensor:
    """Moment `name` in fp32: the stored tensor itself for fp32, a new tensor otherwise."""
    if kind == "q8":
        x = dequantize_blockwise(state[f"{name}.q"], state[f"{name}.scales"], BLOCK)
        return x.square_() if sqrt else x
    return state[name] if kind == "fp32" else state[name].float()


def decode_range(
    state: dict[str, torch.Tensor], name: str, kind: str, start: int, stop: int, sqrt: bool = False
) -> torch.Tensor:
    """Elements `[start, stop)` of the local moment `name` in fp32: a view for fp32, else
    decoded anew (q8: only the blocks that hold the range; the grid starts at element 0)."""
    if kind != "q8":
        x = state[name][start:stop]
        return x if kind == "fp32" else x.float()
    first, last = start // BLOCK, -(-stop // BLOCK)
    q = state[f"{name}.q"][first * BLOCK : last * BLOCK]
    x = dequantize_blockwise(q, state[f"{name}.scales"][first:last], BLOCK)
    x = x[start - first * BLOCK : stop - first * BLOCK]
    return x.square_() if sqrt else x


def encode_(state: dict[str, torch.Tensor], name: str, kind: str, x: torch.Tensor, sqrt: bool = False):
    """Store fp32 `x` as moment `name` (round to nearest)."""
    if kind == "q8":
        q, scales = quantize_blockwise(x.sqrt() if sqrt else x, BLOCK)
        state[f"{name}.q"].copy_(q)
        state[f"{name}.scales"].copy_(scales)
    elif x.data_ptr() != state[name].data_ptr():
        state[name].copy_(x)
