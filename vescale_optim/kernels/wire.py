"""Wire codecs: how a unit collective's pieces travel as bytes, and the registry that turns
`gather_bits` / `reduce_bits` into one.

A codec encodes a flat tensor cut into `rows` equal pieces (one per rank, or one piece: a
rank's shard) as a `[rows, width]` uint8 tensor, row `r` piece `r`'s bytes, each piece
encoded on its own in blocks of `block` elements counted from the piece's start. Three
operations serve the collectives:

- Gather: each rank packs its shard (the fp32 master) into its row of the all-gather
  buffer, one all-gather brings every rank's row, and `unpack` decodes them into the
  unit's full buffer in the compute dtype. Shards, masters and state stay full precision;
  only the wire is compressed.
- Reduce (qgZ's scheme): each rank packs the gradient buffer as `world` rows, the row
  every other rank owns going to that rank in one `all_to_all_single`; the owner's
  `unpack_sum` decodes the W rows it receives and sums them in fp32, in rank order (the
  same bits on every backend), into its shard (the mean, once divided).

Blocks never straddle ranks: with a codec the planner keeps every tensor of a unit
starting on a block boundary, never cut inside one, and the shard size a multiple of the
block (`ShardingConfig.quantized_block`, read from the codecs). Then the blocks of a
rank's flat shard, counted from its start, are exactly the blocks of each tensor's
row-major flattening counted from the tensor's start (a tensor's partial last block is
filled up by zero padding, which changes no absmax): encoding a shard is encoding each
tensor whole, the same at any world size.

A rank's piece is one byte buffer (for "q8": its int8 codes, then its fp32 scales), so
codes and scales travel together in one collective per unit and direction (one
all-gather; one all-to-all): two collectives issued together would be two latencies and
two chances for the ranks' orders to diverge.

"q8" (`gather_bits=8`, `reduce_bits=8`): int8 codes with one fp32 absmax scale per block;
packing, unpacking and the owner's sum are one kernel each on CUDA (`packed`'s
`pack_blockwise`, `unpack_blockwise`, `unpack_sum_blockwise`: no intermediate codes, scales
or dequantized pieces), the torch reference elsewhere, the same bits.

A new format is a subclass of `WireCodec` (its kernels behind `pack`, `unpack`,
`unpack_sum`) and one `register(...)` call; `gather_bits=` / `reduce_bits=` then take its
bits, `codec(...)` its name or bits.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import Tensor

from .packed import pack_blockwise, packed_width, unpack_blockwise, unpack_sum_blockwise

__all__ = ["Q8", "WireCodec", "codec", "known", "register", "unregister"]


class WireCodec(ABC):
    """A wire format of the unit collectives, in blocks of `block` elements (the
    `comm_block` keyword). Subclasses set `name` and `bits`, take `block` as their one
    constructor argument and implement `bytes_per_block`, `pack`, `unpack` and `unpack_sum`."""

    name: ClassVar[str]
    bits: ClassVar[int]

    def __init__(self, block: int) -> None:
        problem = self.block_problem(block)
        if problem is not None:
            raise ValueError(f"the {self.name} codec's block must be {problem}; got {block!r}")
        self.block = block

    @classmethod
    def block_problem(cls, block: object) -> str | None:
        """What `block` must be, when it is not a block size this format takes."""
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            return "a positive integer"
        return None

    def with_block(self, block: int) -> WireCodec:
        """This format in blocks of `block` elements."""
        return self if block == self.block else type(self)(block)

    @property
    @abstractmethod
    def bytes_per_block(self) -> int:
        """Bytes one whole block of `block` elements takes on the wire."""

    def packed_width(self, numel: int) -> int:
        """Bytes of one packed row of `numel` elements (a partial last block counts whole)."""
        return -(-numel // self.block) * self.bytes_per_block

    @abstractmethod
    def pack(self, x: Tensor, rows: int = 1, out: Tensor | None = None) -> Tensor:
        """Flat `x` cut into `rows` equal pieces, each encoded on its own, as a `[rows,
        packed_width(numel)]` uint8 tensor (written into `out` if given: a contiguous uint8
        buffer such as one rank's row of an all-gather buffer)."""

    @abstractmethod
    def unpack(self, buf: Tensor, dtype: torch.dtype | None = None, out: Tensor | None = None) -> Tensor:
        """The flat values of the `[rows, width]` packed rows `buf`, decoded as `dtype`
        (default fp32), straight into flat `out` if given (e.g. a unit's full buffer)."""

    @abstractmethod
    def unpack_sum(self, bufs: Tensor, out: Tensor | None = None) -> Tensor:
        """The flat fp32 sum over the `[rows, width]` packed rows `bufs` (one per rank),
        decoded, row 0 first and each next row added in order (into fp32 `out` if given)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block={self.block})"


class Q8(WireCodec):
    """int8 codes with one fp32 absmax scale per block; a row is its codes, then its scales
    (`packed`'s layout). The same bits as `quantize_blockwise` of each piece."""

    name = "q8"
    bits = 8

    @classmethod
    def block_problem(cls, block: object) -> str | None:
        if isinstance(block, bool) or not isinstance(block, int) or not 4 <= block <= 8192 or block % 4:
            return (
                "a multiple of 4 between 4 and 8192 (the scales follow the codes as fp32, and the "
                "kernels quantize blocks of up to 8192)"
            )
        return None

    @property
    def bytes_per_block(self) -> int:
        return self.block + 4

    def packed_width(self, numel: int) -> int:
        return packed_width(numel, self.block)

    def pack(self, x: Tensor, rows: int = 1, out: Tensor | None = None) -> Tensor:
        return pack_blockwise(x, rows, self.block, out)

    def unpack(self, buf: Tensor, dtype: torch.dtype | None = None, out: Tensor | None = None) -> Tensor:
        return unpack_blockwise(buf, _rows(buf), self.block, dtype, out)

    def unpack_sum(self, bufs: Tensor, out: Tensor | None = None) -> Tensor:
        return unpack_sum_blockwise(bufs, _rows(bufs), self.block, out)


def _rows(buf: Tensor) -> int:
    if buf.dim() != 2:
        raise ValueError(f"packed rows must be a [rows, width] tensor, got shape {tuple(buf.shape)}")
    return buf.shape[0]


_REGISTRY: dict[str, WireCodec] = {}


def register(wire_codec: WireCodec) -> WireCodec:
    """Make `wire_codec` (at its default block) known by its name and its bits; a name or
    bits already registered is refused. Returns it."""
    if not isinstance(wire_codec, WireCodec):
        raise TypeError(f"register takes a WireCodec instance, got {type(wire_codec).__name__}")
    for c in _REGISTRY.values():
        if c.name == wire_codec.name or c.bits == wire_codec.bits:
            raise ValueError(f"a wire codec {c.name!r} ({c.bits} bits) is registered already: {known()}")
    _REGISTRY[wire_codec.name] = wire_codec
    return wire_codec


def unregister(name: str) -> None:
    """Forget the codec registered as `name` (a test's own codec, once done)."""
    _REGISTRY.pop(name, None)


def known() -> str:
    """The registered codecs, for messages: `'q8' (8 bits), ...`."""
    return ", ".join(f"{c.name!r} ({c.bits} bits)" for c in _REGISTRY.values())


def codec(name_or_bits: str | int, block: int | None = None) -> WireCodec:
    """The registered codec named `name_or_bits`, or taking that many bits (`gather_bits=8`
    is "q8"), in blocks of `block` elements if given (else its default block)."""
    found = None
    if isinstance(name_or_bits, str):
        found = _REGISTRY.get(name_or_bits)
    elif isinstance(name_or_bits, int) and not isinstance(name_or_bits, bool):
        found = next((c for c in _REGISTRY.values() if c.bits == name_or_bits), None)
    if found is None:
        raise ValueError(f"no wire codec {name_or_bits!r}; the known ones are {known()}")
    return found if block is None else found.with_block(block)


register(Q8(256))
