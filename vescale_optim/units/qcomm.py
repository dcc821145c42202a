"""8-bit unit collectives whose quantization blocks never straddle ranks.

With `gather_bits=8` or `reduce_bits=8` the planner keeps every tensor of a unit
starting on a block of `comm_block` elements, never cut inside one, and the shard size a
multiple of the block (see `Runtime`). Then the blocks of a rank's flat shard, counted
from its start, are exactly the blocks of each tensor's row-major flattening counted
from the tensor's start (a tensor's partial last block is filled up by zero padding,
which changes no absmax): quantizing a shard is quantizing each tensor whole, the same at
any world size.

On the wire a rank's piece is one byte buffer: its int8 codes, then its fp32 scales.
Codes and scales travel together in one collective per unit and direction (one
all-gather; one all-to-all), since two collectives issued together would be two
latencies and two chances for the ranks' orders to diverge.

- Gather: each rank packs its shard (the fp32 master) into bytes, one all-gather brings
  every rank's bytes, and the unit dequantizes them into its full buffer in the compute
  dtype. Shards, masters and state stay full precision; only the wire is 8-bit.
- Reduce (qgZ's scheme): each rank quantizes the gradient buffer blockwise, the piece
  every other rank owns going to that rank in one `all_to_all_single`; the owner
  dequantizes the W pieces it receives and sums them in fp32 into its shard (the mean).

Packing, unpacking and the owner's sum are one kernel each on CUDA (`kernels.pack_blockwise`,
`unpack_blockwise`, `unpack_sum_blockwise`: no intermediate codes, scales or dequantized
pieces), the torch reference elsewhere, the same bits.
"""

from __future__ import annotations

import torch

from ..kernels import pack_blockwise, packed_width, unpack_blockwise, unpack_sum_blockwise

BITS = (None, 8)


def packed_numel(numel: int, block: int) -> int:
    """Bytes of `numel` elements packed: codes and one fp32 scale per block."""
    return packed_width(numel, block)


def pack_rows(x: torch.Tensor, rows: int, block: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Flat `x` cut into `rows` equal pieces (each a whole number of blocks), quantized
    blockwise and packed as `[rows, codes | scales]` bytes (into `out` if given: the
    collective's send buffer). On CUDA one kernel writes codes and scales in place."""
    return pack_blockwise(x, rows, block, out)


def unpack_rows(
    packed: torch.Tensor, rows: int, block: int, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The `[rows, numel]` values `pack_rows` packed into `packed`, as `dtype`; dequantized
    straight into `out` (flat, `dtype`: e.g. the unit's full buffer) if given."""
    flat = unpack_blockwise(packed, rows, block, dtype, out)
    return flat.view(rows, flat.numel() // rows)


def unpack_sum_rows(
    packed: torch.Tensor, rows: int, block: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The fp32 sum over the `rows` pieces `pack_rows` packed into `packed`, dequantized, in
    row order (into flat fp32 `out` if given): the owner's qgZ sum, the same bits on every
    backend. On CUDA one kernel, no dequantized pieces in memory."""
    return unpack_sum_blockwise(packed, rows, block, out)


def check_bits(name: str, bits) -> None:
    if bits not in BITS:
        raise ValueError(f"{name} must be None (full precision) or 8; got {bits!r}")
