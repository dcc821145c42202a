"""Which rank computes which work item: the one balancer of owner work.

Items (matrices, tiles) have a cost and possibly a home, the rank where their data already
lies; the balancer keeps an item at home while that rank's load stays within a slack of the
ideal mean and sends the rest to the least-loaded rank. Costs are whatever the optimizer
measures (Newton–Schulz FLOPs, eigendecomposition work); communication is not part of the
cost, it is avoided by preferring homes. Pure functions, deterministic, so every rank
computes the same answer.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def assign_owners(
    costs: Sequence[float],
    world_size: int,
    homes: Sequence[int | None] | None = None,
    slack: float = 0.05,
    tolerate: float | None = None,
    loads: Sequence[float] | None = None,
    allowed: Sequence[Sequence[int] | None] | None = None,
) -> list[int]:
    """Greedy longest-processing-time assignment with home affinity, O(n log W).

    Items are taken by decreasing cost. One with a home (`homes[i]`) stays there while that
    rank's load stays within `1 + slack` of the ideal mean; every other item goes to the
    least-loaded rank (ties: lowest rank). So the busiest rank ends within `1 + slack` of the
    mean, or at most the cost of an item that went to the least-loaded rank above the mean;
    and nothing leaves its home while every home's load is within `1 + slack` of the mean.
    With `tolerate`, the same assignment with `slack=tolerate` is taken when it keeps every
    item at its home (moving costs traffic every step: tolerate more imbalance before moving
    anything than after). `loads`: what each rank carries already (work placed before these
    items). `allowed[i]`: the ranks item i may go to (None: any; its home must be one of them),
    e.g. an expert matrix kept on the ranks of its expert-parallel rank. Call it once over every
    item of a step: LPT balances only what it sees largest first.
    """
    homes = list(homes) if homes is not None else [None] * len(costs)
    allowed = list(allowed) if allowed is not None else [None] * len(costs)
    if tolerate is not None:
        loose = assign_owners(costs, world_size, homes, tolerate, loads=loads, allowed=allowed)
        if all(h is None or o == h for o, h in zip(loose, homes)):
            return loose
    load = [float(x) for x in loads] if loads is not None else [0.0] * world_size
    target = (1 + slack) * (sum(costs) + sum(load)) / max(world_size, 1)
    # one heap of (load, rank) per set of allowed ranks, stale entries skipped
    pools = {None: list(range(world_size))} | {tuple(a): sorted(a) for a in allowed if a is not None}
    heaps = {key: [(load[r], r) for r in ranks] for key, ranks in pools.items()}
    member: dict[int, list[object]] = {}
    for key, ranks in pools.items():
        heapq.heapify(heaps[key])
        for r in ranks:
            member.setdefault(r, []).append(key)
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        home, key = homes[i], None if allowed[i] is None else tuple(allowed[i])
        if home is not None and load[home] + costs[i] <= target:
            rank = home
        else:
            heap = heaps[key]
            while heap[0][0] != load[heap[0][1]]:
                heapq.heappop(heap)
            rank = heap[0][1]
        owners[i] = rank
        load[rank] += costs[i]
        for k in member[rank]:
            heapq.heappush(heaps[k], (load[rank], rank))
    return owners


def spread_homes(
    costs: Sequence[float], homes: Sequence[int | None], ranks: Sequence[Sequence[int]]
) -> list[int | None]:
    """Homes (shard ranks) as world ranks of a `replicate x shard` mesh, `ranks[r][s]` being
    the world rank of shard rank `s` in replica `r`.

    Every replica holds an item's data at its home shard rank, so the items at each shard
    rank are dealt out over its replicas, largest first, each to the replica with the least
    cost so far (ties: lowest): the replicas split the work, and each item is computed once
    in the whole world. Items without a home keep None."""
    replicas = len(ranks)
    dealt: dict[int, list[float]] = {}
    out: list[int | None] = [None] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        shard = homes[i]
        if shard is None:
            continue
        load = dealt.setdefault(shard, [0.0] * replicas)
        r = min(range(replicas), key=lambda r: (load[r], r))
        load[r] += costs[i]
        out[i] = ranks[r][shard]
    return out


def keep_homes(
    owners: Sequence[int | None], keys: Sequence[object], homes: Sequence[Sequence[int] | None]
) -> list[int | None]:
    """`owners` traded between items of equal `keys` (equal cost) so that as many items as
    possible are owned by one of their `homes` (ranks holding them whole; None or empty: none):
    every rank keeps the same number of items of each key, so its load does not change. First
    every item whose home has a slot of its key takes it (in item order, homes in order), then
    the others take the slots left, lowest rank first. Items whose owner is None stay None."""
    slots: dict[object, dict[int, int]] = {}
    for o, k in zip(owners, keys):
        if o is not None:
            slots.setdefault(k, {}).setdefault(o, 0)
            slots[k][o] += 1
    out: list[int | None] = list(owners)
    waiting = []
    for i, (o, k) in enumerate(zip(owners, keys)):
        if o is None:
            continue
        free = slots[k]
        home = next((h for h in homes[i] or () if free.get(h, 0) > 0), None)
        if home is None:
            waiting.append(i)
            continue
        out[i] = home
        free[home] -= 1
    for i in waiting:
        free = slots[keys[i]]
        rank = min(r for r, n in free.items() if n > 0)
        out[i] = rank
        free[rank] -= 1
    return out


def rank_loads(costs: Sequence[float], owners: Sequence[int | None], world_size: int) -> list[float]:
    """Sum of `costs` per owner rank (items whose owner is None count nowhere)."""
    load = [0] * world_size
    for c, o in zip(costs, owners):
        if o is not None:
            load[o] += c
    return load


def imbalance(costs: Sequence[float], owners: Sequence[int], world_size: int) -> float:
    """max / mean of the per-rank cost."""
    load = rank_loads(costs, owners, world_size)
    mean = sum(load) / world_size
    return max(load) / mean if mean else 1.0
