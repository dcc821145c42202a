"""Which rank orthogonalizes which matrix: balance Newton–Schulz FLOPs, keep matrices home.

Cost model: one Newton–Schulz step on an `m x n` matrix, with `a = min(m, n)` and
`b = max(m, n)`, costs `X Xᵀ` (2a²b) + `A A` (2a³) + `B X` (2a²b) = 4a²b + 2a³ FLOPs;
communication is not part of the cost, it is avoided by preferring a matrix's home.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def ns_flops(rows: int, cols: int, steps: int = 5) -> int:
    a, b = min(rows, cols), max(rows, cols)
    return steps * (4 * a * a * b + 2 * a * a * a)


def assign_owners(
    costs: Sequence[float],
    world_size: int,
    homes: Sequence[int | None] | None = None,
    slack: float = 0.05,
) -> list[int]:
    """Greedy longest-processing-time assignment with home affinity, O(n log W).

    Matrices are taken by decreasing cost. One whose data already lies on a single rank
    (`homes[i]`) stays there while that rank's load stays within `1 + slack` of the
    ideal mean; every other matrix goes to the least-loaded rank (ties: lowest rank).
    Call it once over every matrix of a step: LPT balances only what it sees largest
    first. Deterministic, so every rank computes the same answer.
    """
    homes = list(homes) if homes is not None else [None] * len(costs)
    target = (1 + slack) * sum(costs) / max(world_size, 1)
    load = [0.0] * world_size
    heap = [(0.0, r) for r in range(world_size)]  # (load, rank), with stale entries skipped
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        home = homes[i]
        if home is not None and load[home] + costs[i] <= target:
            rank = home
        else:
            while heap[0][0] != load[heap[0][1]]:
                heapq.heappop(heap)
            rank = heap[0][1]
        owners[i] = rank
        load[rank] += costs[i]
        heapq.heappush(heap, (load[rank], rank))
    return owners


def imbalance(costs: Sequence[float], owners: Sequence[int], world_size: int) -> float:
    """max / mean of the per-rank cost."""
    load = [0.0] * world_size
    for c, o in zip(costs, owners):
        load[o] += c
    mean = sum(load) / world_size
    return max(load) / mean if mean else 1.0
