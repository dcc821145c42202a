"""Layout planner: place tensors in a `W*S` flat buffer so that no rank boundary splits a granule.

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
    granules: tuple[int, ...]
    offsets: tuple[int, ...]
    segments: tuple[object, ...] | None = None  # per-tensor segment key (tensors of a key are adjacent)

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

    def segment_range(self, key: object, rank: int) -> tuple[int, int]:
        """Where segment `key` lies in `rank`'s slice, as local [start, stop) (empty when equal).

        A segment is every tensor planned with that key; they are adjacent in the buffer,
        so on each rank they form one range (padding between them included)."""
        members = [i for i, k in enumerate(self.segments or ()) if k == key and self.sizes[i]]
        if not members:
            return 0, 0
        lo = min(self.offsets[i] for i in members)
        hi = max(self.offsets[i] + self.sizes[i] for i in members)
        base = rank * self.shard_size
        start = min(max(lo, base), base + self.shard_size)
        return start - base, max(min(hi, base + self.shard_size), start) - base

    def local_granules(self, i: int) -> tuple[int, ...]:
        g = self.granules[i]
        return tuple(
            (stop - start) // g for start, stop in (self.rank_range(i, r) for r in range(self.world_size))
        )

    def placement(self, i: int, shape: Sequence[int] | None = None) -> RaggedShard:
        """RaggedShard of tensor `i`: over its flat view, or over `shape` when given.

        With a shape, `dims` is the shortest prefix whose rows divide the granule, so a
        granule of whole rows shows as row counts.
        """
        granules = self.local_granules(i)
        if shape is None:
            return RaggedShard((0,), granules)
        shape = tuple(shape)
        if math.prod(shape) != self.sizes[i]:
            raise ValueError(f"shape {shape} has {math.prod(shape)} elements, tensor {i} has {self.sizes[i]}")
        for k in range(len(shape) + 1):
            row = math.prod(shape[k:])
            if row and self.granules[i] % row == 0:
                return RaggedShard(tuple(range(k)), granules)
        return RaggedShard(tuple(range(len(shape))), granules)


def _earliest_start(cursor: int, size: int, granule: int, shard: int, align: int, limit: int):
    """Smallest aligned start >= cursor at which every rank boundary strictly inside the
    tensor falls between two of its granules, or None if the tensor cannot end by `limit`."""
    step = math.lcm(align, granule)
    start = -(-cursor // align) * align
    jumped = False
    while start + size <= limit:
        b = (start // shard + 1) * shard  # first boundary strictly after start
        if b >= start + size:
            return start
        if (b - start) % granule:
            start += (b - start) % step  # now b - start is a multiple of granule (or start == b)
            continue
        if b + shard < start + size and shard % granule:
            # A second boundary would split a granule; only a start at b can avoid it, and a
            # second jump to a boundary would repeat the same situation forever.
            if jumped:
                return None
            start, jumped = b, True
            continue
        return start
    return None


def _fits(order: Sequence[int], sizes, granules, world_size: int, shard: int, align):
    """Greedy earliest placement in `order`; `align` is one alignment or one per tensor."""
    aligns = [align] * len(sizes) if isinstance(align, int) else align
    cursor, total = 0, world_size * shard
    offsets = [0] * len(sizes)
    for i in order:
        if sizes[i] == 0:
            offsets[i] = -(-cursor // aligns[i]) * aligns[i]
            continue
        start = _earliest_start(cursor, sizes[i], granules[i], shard, aligns[i], total)
        if start is None:
            return None
        offsets[i] = start
        cursor = start + sizes[i]
    return offsets


_WALK_WORK = 60_000  # tensor placements spent walking candidate sizes one by one


def _next_candidate(sizes, granules, align: int, s: int) -> int:
    """Smallest S' >= s, a multiple of `align`, that is a multiple of the granule of every
    tensor longer than 2*S'.

    Such a tensor holds two rank boundaries wherever it sits, and both fall on its
    granule grid only if S' is a multiple of its granule; so no smaller S' can be feasible.
    """
    while True:
        spanning = [(e, g) for e, g in zip(sizes, granules) if e > 2 * s]
        step = math.lcm(align, *(g for _, g in spanning))
        cand = -(-s // step) * step
        if not spanning:
            return cand
        shrinks_at = min((e - 1) // 2 + 1 for e, _ in spanning)  # first S where the set shrinks
        if cand < shrinks_at:
            return cand
        s = shrinks_at


def _search(orders, sizes, granules, world_size: int, align: int, lo: int, hi: int, aligns):
    """Smallest feasible S (a multiple of `align`) found, with the offsets of the first
    order that fits it; tensor `i` starts at a multiple of `aligns[i]`.

    Feasibility is not monotone in S, so the search walks the candidate sizes upward
    from the lower bound one by one for a while, then gallops and bisects over them;
    `hi` (everything on rank 0) always fits.
    """

    def fits(s):
        for order in orders:
            offsets = _fits(order, sizes, granules, world_size, s, aligns)
            if offsets is not None:
                return offsets
        return None

    # Sizes that are multiples of a granule often fit where their neighbours do not: a
    # cheap first upper bound.
    for g in sorted({g for e, g in zip(sizes, granules) if e}):
        s = _next_candidate(sizes, granules, align, -(-lo // math.lcm(align, g)) * math.lcm(align, g))
        if s < hi:
            offsets = fits(s)
            if offsets is not None:
                hi = s
                break
    walk = max(4, min(32, _WALK_WORK // max(1, len(sizes) * len(orders))))
    s = _next_candidate(sizes, granules, align, lo)
    for _ in range(walk):
        if s >= hi:
            return hi, fits(hi)
        offsets = fits(s)
        if offsets is not None:
            return s, offsets
        s = _next_candidate(sizes, granules, align, s + align)
    prev, step = s, align
    best = (hi, fits(hi))
    while s < hi:
        offsets = fits(s)
        if offsets is not None:
            best = (s, offsets)
            break
        prev, s = s, _next_candidate(sizes, granules, align, s + step)
        step *= 2
    left, right = prev + align, best[0] - align
    while left <= right:
        mid = _next_candidate(sizes, granules, align, max(left, (left + right) // 2 // align * align))
        if mid >= best[0]:
            right = (left + right) // 2 // align * align - align
            continue
        offsets = fits(mid)
        if offsets is not None:
            best, right = (mid, offsets), mid - align
        else:
            left = mid + align
    return best


def whole_blocks(granule: int, block: int, numel: int) -> int:
    """A granule that also keeps quantization blocks whole: a multiple of both; a tensor
    it does not divide stays whole on one rank (its partial last block uncut too)."""
    both = math.lcm(granule, block)
    return both if numel % both == 0 else max(numel, 1)


def plan_layout(
    sizes: Sequence[int],
    granules: Sequence[int],
    world_size: int,
    align: int = 1,
    *,
    aligns: Sequence[int] | None = None,
    segments: Sequence[object] | None = None,
) -> Layout:
    """Plan one bucket: a shard size `S` and an offset per tensor so that every rank
    boundary inside a tensor falls between its granules.

    `sizes[i]` must be a multiple of `granules[i]`. Tensor `i` starts at a multiple of
    `aligns[i]` (default `align`); `S` is a multiple of `align` and of every `aligns[i]`,
    so offsets inside each rank's slice keep their alignment too. With `segments`
    (one hashable key per tensor), tensors of one key are placed next to each other,
    keys in order of first appearance, so each rank holds each segment as one range.
    """
    sizes, granules = tuple(int(s) for s in sizes), tuple(int(u) for u in granules)
    if len(sizes) != len(granules):
        raise ValueError(f"{len(sizes)} sizes but {len(granules)} granules")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    if align < 1:
        raise ValueError(f"align must be >= 1; got {align}")
    aligns = tuple(int(a) for a in aligns) if aligns is not None else (align,) * len(sizes)
    if len(aligns) != len(sizes) or any(a < 1 for a in aligns):
        raise ValueError(f"aligns must be {len(sizes)} integers >= 1; got {aligns}")
    if segments is not None and len(segments) != len(sizes):
        raise ValueError(f"{len(sizes)} sizes but {len(segments)} segment keys")
    for i, (e, g) in enumerate(zip(sizes, granules)):
        if e < 0 or g < 1:
            raise ValueError(f"tensor {i}: size must be >= 0 and granule >= 1; got size={e}, granule={g}")
        if e % g:
            raise ValueError(f"tensor {i}: size {e} is not a multiple of its granule {g}")
    align = math.lcm(align, *aligns)
    segs = tuple(segments) if segments is not None else None
    total = sum(sizes)
    if total == 0:
        return Layout(world_size, 0, sizes, granules, (0,) * len(sizes), segs)
    round_up = lambda x: -(-x // align) * align  # noqa: E731
    # No valid S is below the even share, nor (with two or more ranks) below the
    # largest granule: a granule longer than S always holds a rank boundary.
    largest_granule = max(g for e, g in zip(sizes, granules) if e) if world_size > 1 else 0
    lo = round_up(max(-(-total // world_size), largest_granule))
    hi = round_up(sum(round_up(e) for e in sizes))  # everything on rank 0 always fits
    n = len(sizes)
    rank_of = {}
    for key in segs or ():
        rank_of.setdefault(key, len(rank_of))
    segment = (lambda i: rank_of[segs[i]]) if segs is not None else (lambda i: 0)
    orders = [sorted(range(n), key=segment)]  # model order first: it keeps layers together
    by_granule = lambda i: (segment(i), -granules[i], -sizes[i])  # noqa: E731
    by_size = lambda i: (segment(i), -sizes[i], -granules[i])  # noqa: E731
    for key in (by_granule, by_size):
        order = sorted(range(n), key=key)
        if order not in orders:
            orders.append(order)
    shard, offsets = _search(orders, sizes, granules, world_size, align, lo, max(hi, lo), aligns)
    return Layout(world_size, shard, sizes, granules, tuple(offsets), segs)


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
