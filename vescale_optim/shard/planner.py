"""Layout planner: place tensors in a `W*S` flat buffer so that no rank boundary splits a unit.

For a fixed order, putting each tensor at its earliest valid start is optimal, and
`S` is searched over multiples of the alignment by that greedy check. A few orders
are tried (model order first, which keeps layers together) and the best is kept.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .spec import RaggedShard


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a bucket sits in a global buffer of `world_size * shard_size`."""

    world_size: int
    shard_size: int
    sizes: tuple[int, ...]
    units: tuple[int, ...]
    offsets: tuple[int, ...]

    @property
    def numel(self) -> int:
        return self.world_size * self.shard_size

    @property
    def padding(self) -> int:
        return self.numel - sum(self.sizes)

    def rank_range(self, i: int, rank: int) -> tuple[int, int]:
        """Global [start, stop) of tensor `i`'s piece on `rank` (empty when start == stop)."""
        lo, hi = self.offsets[i], self.offsets[i] + self.sizes[i]
        start = min(max(lo, rank * self.shard_size), hi)
        return start, max(min(hi, (rank + 1) * self.shard_size), start)

    def local_units(self, i: int) -> tuple[int, ...]:
        g = self.units[i]
        return tuple(
            (stop - start) // g for start, stop in (self.rank_range(i, r) for r in range(self.world_size))
        )

    def placement(self, i: int, shape: Sequence[int] | None = None) -> RaggedShard:
        """RaggedShard of tensor `i`: over its flat view, or over `shape` when given.

        With a shape, `dims` is the shortest prefix whose rows divide the unit, so a
        unit of whole rows shows as row counts.
        """
        units = self.local_units(i)
        if shape is None:
            return RaggedShard((0,), units)
        shape = tuple(shape)
        if math.prod(shape) != self.sizes[i]:
            raise ValueError(f"shape {shape} has {math.prod(shape)} elements, tensor {i} has {self.sizes[i]}")
        for k in range(len(shape) + 1):
            row = math.prod(shape[k:])
            if row and self.units[i] % row == 0:
                return RaggedShard(tuple(range(k)), units)
        return RaggedShard(tuple(range(len(shape))), units)


def _earliest_start(cursor: int, size: int, unit: int, shard: int, align: int, limit: int):
    """Smallest aligned start >= cursor at which every rank boundary strictly inside the
    tensor falls between two of its units, or None if the tensor cannot end by `limit`."""
    step = math.lcm(align, unit)
    start = -(-cursor // align) * align
    jumped = False
    while start + size <= limit:
        b = (start // shard + 1) * shard  # first boundary strictly after start
        if b >= start + size:
            return start
        if (b - start) % unit:
            start += (b - start) % step  # now b - start is a multiple of unit (or start == b)
            continue
        if b + shard < start + size and shard % unit:
            # A second boundary would split a unit; only a start at b can avoid it, and a
            # second jump to a boundary would repeat the same situation forever.
            if jumped:
                return None
            start, jumped = b, True
            continue
        return start
    return None


def _fits(order: Sequence[int], sizes, units, world_size: int, shard: int, align: int):
    cursor, total = 0, world_size * shard
    offsets = [0] * len(sizes)
    for i in order:
        if sizes[i] == 0:
            offsets[i] = -(-cursor // align) * align
            continue
        start = _earliest_start(cursor, sizes[i], units[i], shard, align, total)
        if start is None:
            return None
        offsets[i] = start
        cursor = start + sizes[i]
    return offsets


_SCAN = 32  # bottom-up candidates tried after the bisection ...
_SCAN_WORK = 20_000  # ... fewer for large buckets, bounding the tensor placements spent


def _candidates(sizes, units, align: int, lo: int) -> list[int]:
    """Shard sizes just above `lo` that are multiples of a unit (or of all units).

    A tensor that spans two rank boundaries needs `S` to be a multiple of its unit,
    so for buckets of large row-unit tensors the feasible sizes cluster there, where
    bisection over a non-monotone predicate can miss them.
    """
    distinct = sorted({g for e, g in zip(sizes, units) if e})
    steps = {math.lcm(align, g) for g in distinct}
    combined = math.lcm(align, *distinct)
    if combined <= max(lo, 1):
        steps.add(combined)
    return sorted({-(-lo // m) * m for m in steps})


def _search(order, sizes, units, world_size: int, align: int, lo: int, hi: int, candidates):
    """Smallest feasible S in [lo, hi] (multiples of align) found for this order.

    Feasibility is not monotone in S, so the search combines the unit-multiple
    candidates, galloping up from `lo` and bisecting, and a short scan from the bottom.
    """
    fits = lambda s: _fits(order, sizes, units, world_size, s, align)  # noqa: E731
    best = (hi, fits(hi))
    for s in candidates:
        if s >= best[0]:
            break
        offsets = fits(s)
        if offsets is not None:
            best = (s, offsets)
            break
    step, prev, s = align, lo - align, lo
    while s < best[0]:
        offsets = fits(s)
        if offsets is not None:
            best = (s, offsets)
            break
        prev, s = s, s + step
        step *= 2
    left, right = prev + align, best[0] - align
    while left <= right:
        mid = max(left, (left + right) // 2 // align * align)
        offsets = fits(mid)
        if offsets is not None:
            best, right = (mid, offsets), mid - align
        else:
            left = mid + align
    scan = max(1, min(_SCAN, _SCAN_WORK // max(len(order), 1)))
    for s in range(lo, min(best[0], lo + scan * align), align):
        offsets = fits(s)
        if offsets is not None:
            return s, offsets
    return best


def plan_layout(
    sizes: Sequence[int], units: Sequence[int], world_size: int, align: int = 1
) -> Layout:
    """Plan one bucket: a shard size `S` (multiple of `align`) and an aligned offset
    per tensor so that every rank boundary inside a tensor falls between its units.

    `sizes[i]` must be a multiple of `units[i]`.
    """
    sizes, units = tuple(int(s) for s in sizes), tuple(int(u) for u in units)
    if len(sizes) != len(units):
        raise ValueError(f"{len(sizes)} sizes but {len(units)} units")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    if align < 1:
        raise ValueError(f"align must be >= 1; got {align}")
    for i, (e, g) in enumerate(zip(sizes, units)):
        if e < 0 or g < 1:
            raise ValueError(f"tensor {i}: size must be >= 0 and unit >= 1; got size={e}, unit={g}")
        if e % g:
            raise ValueError(f"tensor {i}: size {e} is not a multiple of its unit {g}")
    total = sum(sizes)
    if total == 0:
        return Layout(world_size, 0, sizes, units, (0,) * len(sizes))
    round_up = lambda x: -(-x // align) * align  # noqa: E731
    lo = round_up(-(-total // world_size))
    hi = round_up(sum(round_up(e) for e in sizes))  # everything on rank 0 always fits
    n = len(sizes)
    orders = [list(range(n))]
    by_unit = sorted(range(n), key=lambda i: (-units[i], -sizes[i]))
    by_size = sorted(range(n), key=lambda i: (-sizes[i], -units[i]))
    for order in (by_unit, by_size):
        if order not in orders:
            orders.append(order)
    candidates = _candidates(sizes, units, align, lo)
    best = None
    for order in orders:
        shard, offsets = _search(order, sizes, units, world_size, align, lo, hi, candidates)
        if offsets is not None and (best is None or shard < best[0]):
            best = (shard, offsets)
            hi = shard
        if shard == lo:
            break
    return Layout(world_size, best[0], sizes, units, tuple(best[1]))


def bucket_indices(numels: Sequence[int], keys: Sequence[object], cap: int) -> list[list[int]]:
    """Group tensors into buckets to be planned separately.

    Tensors share a bucket only if their `keys` are equal (e.g. dtype and param
    group); a bucket is closed when adding the next tensor would pass `cap` elements
    (a tensor larger than `cap` gets a bucket of its own). Model order is kept inside
    each bucket, and buckets are ordered by their first tensor.
    """
    if len(numels) != len(keys):
        raise ValueError(f"{len(numels)} sizes but {len(keys)} keys")
    if cap < 1:
        raise ValueError(f"bucket cap must be >= 1 element; got {cap}")
    open_buckets: dict[object, list[int]] = {}
    filled: dict[object, int] = {}
    buckets: list[list[int]] = []
    for i, (n, key) in enumerate(zip(numels, keys)):
        bucket = open_buckets.get(key)
        if bucket is None or filled[key] + n > cap:
            bucket = open_buckets[key] = []
            filled[key] = 0
            buckets.append(bucket)
        bucket.append(i)
        filled[key] += n
    return buckets
