"""RaggedShard: a tensor cut into contiguous row ranges, one per rank, in rank order."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Shape = tuple[int, ...]
Box = tuple[Shape, Shape]  # (offsets, sizes) of a rectangular block of a tensor


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


@dataclass(frozen=True)
class RaggedShard:
    """Placement of a tensor whose first `len(dims)` dimensions are flattened into rows.

    Rank `r` holds `local_units[r]` consecutive granules of `R / sum(local_units)` rows
    each, where `R = prod(shape[:len(dims)])`; ranks follow each other in order (the
    field keeps the design's name; a granule is the cut's grain, not a communication
    unit). `dims=()` makes the whole tensor a single row, so `local_units` must be
    one-hot: the tensor lives on one rank. A tensor with no elements has all-zero counts.
    """

    dims: tuple[int, ...]
    local_units: tuple[int, ...]

    def __post_init__(self) -> None:
        dims, units = tuple(self.dims), tuple(self.local_units)
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "local_units", units)
        if dims != tuple(range(len(dims))):
            raise ValueError(f"RaggedShard dims must be a prefix (0, 1, ..., k-1); got dims={dims}")
        if not units:
            raise ValueError("RaggedShard local_units must have one entry per rank; got ()")
        bad = [(r, u) for r, u in enumerate(units) if not isinstance(u, int) or u < 0]
        if bad:
            r, u = bad[0]
            raise ValueError(f"RaggedShard local_units must be non-negative integers; rank {r} has {u!r}")
        if not dims and sum(units) != 0 and sorted(units)[-2:] != ([0, 1] if len(units) > 1 else [1]):
            raise ValueError(
                f"RaggedShard with dims=() keeps the whole tensor on one rank, so local_units "
                f"must be one-hot; got {units}"
            )

    @staticmethod
    def owned(owner: int, world_size: int) -> RaggedShard:
        """The whole tensor on rank `owner`."""
        return RaggedShard((), tuple(int(r == owner) for r in range(world_size)))

    @property
    def world_size(self) -> int:
        return len(self.local_units)

    @property
    def owner(self) -> int | None:
        """The only rank holding data, or None if several (or none) do."""
        holders = [r for r, u in enumerate(self.local_units) if u]
        return holders[0] if len(holders) == 1 else None

    def check(self, shape: Sequence[int], world_size: int | None = None) -> None:
        """Raise ValueError if this placement cannot describe a tensor of `shape`."""
        shape = tuple(shape)
        if world_size is not None and world_size != self.world_size:
            raise ValueError(
                f"RaggedShard has {self.world_size} local_units but the world has "
                f"{world_size} ranks: {self.local_units}"
            )
        if len(self.dims) > len(shape):
            raise ValueError(f"RaggedShard dims={self.dims} flatten more dimensions than shape {shape} has")
        rows, total = self._rows(shape), sum(self.local_units)
        if _numel(shape) == 0:
            return
        if total == 0:
            raise ValueError(
                f"RaggedShard local_units {self.local_units} are all zero but shape {shape} has elements"
            )
        if rows % total:
            raise ValueError(
                f"RaggedShard local_units sum to {total}, which does not divide the {rows} rows "
                f"of shape {shape} flattened over dims={self.dims}"
            )

    def _rows(self, shape: Shape) -> int:
        return _numel(shape[: len(self.dims)])

    def granule_numel(self, shape: Sequence[int]) -> int:
        """Elements in one granule."""
        shape = tuple(shape)
        total = sum(self.local_units)
        return _numel(shape) // total if total else 0

    def local_range(self, shape: Sequence[int], rank: int) -> tuple[int, int]:
        """Flat [start, stop) element range of rank `rank`'s piece."""
        self.check(shape)
        granule = self.granule_numel(shape)
        start = sum(self.local_units[:rank]) * granule
        return start, start + self.local_units[rank] * granule

    def ranges(self, shape: Sequence[int]) -> list[tuple[int, int]]:
        """`local_range` of every rank."""
        return [self.local_range(shape, r) for r in range(self.world_size)]

    def global_offset(self, shape: Sequence[int], rank: int) -> int:
        """Flat offset in the full tensor where rank `rank`'s piece begins."""
        return self.local_range(shape, rank)[0]

    def local_shape(self, shape: Sequence[int], rank: int) -> Shape:
        """Shape of rank `rank`'s piece: `(rows_held, *shape[len(dims):])`.

        With `dims=()` the owner's piece is the whole `shape`, every other rank's is
        empty.
        """
        shape = tuple(shape)
        self.check(shape)
        if not self.dims:
            return shape if self.local_units[rank] else (0, *shape[1:])
        total = sum(self.local_units)
        rows = self.local_units[rank] * self._rows(shape) // total if total else 0
        return (rows, *shape[len(self.dims) :])

    def boxes(self, shape: Sequence[int], rank: int) -> list[Box]:
        """Rank `rank`'s piece as rectangular boxes of the N-D tensor, in flat order."""
        start, stop = self.local_range(shape, rank)
        return flat_range_boxes(tuple(shape), start, stop)


def flat_range_boxes(shape: Shape, start: int, stop: int) -> list[Box]:
    """Split the row-major element range [start, stop) of `shape` into boxes.

    At most `2 * ndim - 1` boxes come back, in flat order, and their elements
    concatenated in that order are exactly the range.
    """
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner = _numel(shape[1:])
    first, last = start // inner, (stop - 1) // inner

    def in_row(row: int, lo: int, hi: int) -> list[Box]:
        return [((row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], lo, hi)]

    if first == last:
        return in_row(first, start - first * inner, stop - first * inner)
    out: list[Box] = []
    lo, hi = first, last + 1
    if start % inner:
        out += in_row(first, start % inner, inner)
        lo += 1
    if stop % inner:
        hi -= 1
    if hi > lo:
        out.append(((lo, *(0,) * (len(shape) - 1)), (hi - lo, *shape[1:])))
    if stop % inner:
        out += in_row(last, 0, stop % inner)
    return out
