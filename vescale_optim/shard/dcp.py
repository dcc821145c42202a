"""This rank's piece of a ragged-sharded tensor, as `torch.distributed.checkpoint` sees it.

A piece is the row-major flat range `[start, stop)` of a tensor; that tensor may itself be a
box of a larger global one (`origin` and `whole`: a tensor-parallel rank's local shard), and
then the piece's chunks carry the global shape and offsets. DCP learns about
it through its extension protocol — `__create_write_items__` (save plan),
`__create_chunk_list__` (load plan) and `__get_tensor_shard__` (the data of one chunk) —
each rectangular box of the range (`flat_range_boxes`) being one chunk. So DCP writes
only local data, reshards on load at any world size, and needs no deprecated type.

The piece holds no copy of the values. It is either a view (`values`: DCP writes from it
and loads into it in place) or a reader (`read(lo, hi)` decodes elements on demand when
DCP writes a chunk; on load DCP fills a buffer that the owner takes with
`take_loaded()`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .spec import Shape, flat_range_boxes

Reader = Callable[[int, int], torch.Tensor]

# What DCP asks of a state-dict value besides the protocol: its metadata, never its data.
_METADATA = {
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.shape.__get__,
    torch.Tensor.ndim.__get__,
    torch.Tensor.dtype.__get__,
    torch.Tensor.device.__get__,
    torch.Tensor.layout.__get__,
    torch.Tensor.requires_grad.__get__,
}


class DcpPiece(torch.Tensor):
    """A tensor of the global shape, dtype and device that stands for this rank's piece.

    Only metadata can be read from it directly; any other tensor operation raises, since
    it has no values of its own. Build it with `dcp_piece`.
    """

    _start: int
    _numel: int
    _box: tuple[tuple[int, ...], tuple[int, ...]]  # (shape of the ranged tensor, its origin in the whole)
    _chunks: list[tuple[torch.Size, torch.Size, int]]  # (offsets, sizes, position in the piece)
    _values: torch.Tensor | None
    _read: Reader | None
    _loaded: torch.Tensor | None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func not in _METADATA:
            name = getattr(func, "__name__", repr(func))
            raise TypeError(
                f"{name}() on a DcpPiece: it stands for this rank's piece in torch.distributed.checkpoint "
                "and holds no values; only dcp.save and dcp.load read it (not dcp.async_save, which "
                "stages plain tensors)"
            )
        return super().__torch_function__(func, types, args, kwargs or {})

    def __repr__(self) -> str:
        return (
            f"DcpPiece(shape={tuple(self.shape)}, dtype={self.dtype}, elements [{self._start}, "
            f"{self._start + self._numel}) in {len(self._chunks)} chunks)"
        )

    @property
    def loaded(self) -> torch.Tensor | None:
        """The flat buffer DCP loaded into (reader pieces, between `dcp.load` and `take_loaded`)."""
        return self._loaded

    def take_loaded(self) -> torch.Tensor | None:
        """Hand over the loaded buffer (None if nothing was loaded, or the piece is a view)."""
        out, self._loaded = self._loaded, None
        return out

    def copy(self, device: torch.device | str | None = None) -> DcpPiece:
        """A piece of the same chunks over a copy of this one's values (decoded, for a
        reader) on `device` (default: this piece's): what `dcp.async_save` can write while
        training goes on changing the original."""
        fresh = self._values is None and self._loaded is None  # a reader returns new memory
        values = self._flat(0, self._numel)
        values = values.to(device or values.device, copy=not fresh)
        return self._over(values)

    def _over(self, values: torch.Tensor) -> DcpPiece:
        """A piece of the same range (and box of the whole) over `values`."""
        shape, origin = self._box
        return dcp_piece(
            shape, self._start, self._start + self._numel, values, origin=origin, whole=tuple(self.shape)
        )

    def copy_into(self, out: torch.Tensor, *, non_blocking: bool = False) -> DcpPiece:
        """A piece of the same chunks over `out` (flat, this piece's dtype and number of
        elements, any device), filled with this piece's values (decoded, for a reader) by
        one `copy_`. With `non_blocking` a device-to-host copy into pinned memory is only
        queued: the caller waits for the device before reading `out`, as a checkpoint's
        staging does once for all its copies."""
        if out.dim() != 1 or out.numel() != self._numel or out.dtype != self.dtype:
            raise ValueError(
                f"cannot copy {self!r} into a tensor of shape {tuple(out.shape)} and dtype {out.dtype}"
            )
        out.copy_(self._flat(0, self._numel), non_blocking=non_blocking)
        return self._over(out)

    def blank(self, device: torch.device | str | None = None) -> DcpPiece:
        """A piece of the same chunks over new zeroed memory on `device` (default: this
        piece's): `dcp.load` fills it without touching this piece's values."""
        values = torch.zeros(self._numel, dtype=self.dtype, device=device or self.device)
        return self._over(values)

    def load_from(self, other: DcpPiece) -> None:
        """Take the values `other` (a piece of the same range) holds: written into this
        piece's memory, or, for a reader, kept as what it loaded until `take_loaded()`."""
        if other._chunks != self._chunks:
            raise ValueError(f"{other!r} does not cover the same range as {self!r}")
        values = other._flat(0, other._numel)
        if self._values is not None:
            self._values.copy_(values)
        else:
            self._loaded = values.to(device=self.device, dtype=self.dtype)

    def _flat(self, pos: int, n: int) -> torch.Tensor:
        if self._loaded is not None:
            return self._loaded[pos : pos + n]
        if self._values is not None:
            return self._values[pos : pos + n]
        return self._read(pos, pos + n)

    # --- torch.distributed.checkpoint's extension protocol -----------------------------

    def __create_write_items__(self, fqn: str, object: object) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                    properties=props,
                    size=self.shape,
                ),
            )
            for offsets, sizes, _ in self._chunks
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        # DCP plans a load: a reader piece gets a buffer to load into, starting from its values.
        if self._values is None and self._loaded is None:
            self._loaded = self._read(0, self._numel).clone()
        return [ChunkStorageMetadata(offsets=offsets, sizes=sizes) for offsets, sizes, _ in self._chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        offsets = torch.Size(index.offset or ())
        for chunk_offsets, sizes, pos in self._chunks:
            if chunk_offsets == offsets:
                return self._flat(pos, math.prod(sizes)).view(sizes)
        raise ValueError(f"{index.fqn}: this rank holds no chunk at offsets {tuple(offsets)}")


@functools.cache
def _scalar(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One element that every piece of this dtype and device expands to its shape."""
    return torch.empty((), dtype=dtype, device=device)


def dcp_piece(
    shape: Shape,
    start: int,
    stop: int,
    values: torch.Tensor | None = None,
    *,
    read: Reader | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    origin: Shape | None = None,
    whole: Shape | None = None,
) -> DcpPiece:
    """This rank's elements `[start, stop)` of a row-major tensor of `shape`, for DCP.

    With `origin` and `whole`, that tensor is the box of `shape` at offsets `origin` inside a
    global tensor of shape `whole` (a tensor-parallel rank's local shard): the piece then has
    the global shape and its chunks the global offsets, so DCP reshards across TP layouts too.

    Give either `values` (a flat tensor of `stop - start` elements, viewed, never copied)
    or `read` (`read(lo, hi)` returns elements `[start + lo, start + hi)` as a new flat
    tensor; then `dtype` and `device` say what it returns).
    """
    shape = tuple(shape)
    if (values is None) == (read is None):
        raise ValueError("give exactly one of values and read")
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"range [{start}, {stop}) is not inside a tensor of shape {shape}")
    if values is not None:
        if values.dim() != 1 or values.numel() != stop - start:
            raise ValueError(
                f"values must be flat with {stop - start} elements; got shape {tuple(values.shape)}"
            )
        dtype, device = values.dtype, values.device
    elif dtype is None:
        raise ValueError("a piece given by read needs its dtype")
    origin = tuple(origin) if origin is not None else (0,) * len(shape)
    whole = tuple(whole) if whole is not None else shape
    if (
        len(origin) != len(shape)
        or len(whole) != len(shape)
        or any(o < 0 or o + n > w for o, n, w in zip(origin, shape, whole))
    ):
        raise ValueError(f"a box of shape {shape} at {origin} is not inside a tensor of shape {whole}")
    piece = _scalar(dtype, torch.device(device or "cpu")).expand(whole).as_subclass(DcpPiece)
    chunks, pos = [], 0
    for offsets, sizes in flat_range_boxes(shape, start, stop):
        at = torch.Size(a + o for a, o in zip(offsets, origin))
        chunks.append((at, torch.Size(sizes), pos))
        pos += math.prod(sizes)
    piece._start, piece._numel, piece._chunks, piece._box = start, stop - start, chunks, (shape, origin)
    piece._values, piece._read, piece._loaded = values, read, None
    return piece


__all__ = ["DcpPiece", "dcp_piece"]
