"""Which rank orthogonalizes which matrix: balance Newton–Schulz FLOPs, keep matrices home.

Cost model: one Newton–Schulz step on an `m x n` matrix, with `a = min(m, n)` and
`b = max(m, n)`, costs `X Xᵀ` (2a²b) + `A A` (2a³) + `B X` (2a²b) = 4a²b + 2a³ FLOPs;
communication is not part of the cost, it is avoided by preferring a matrix's home.
"""

from __future__ import annotations

from collections.abc import Sequence


def ns_flops(rows: int, cols: int, steps: int = 5) -> int:
    a, b = min(rows, cols), max(rows, cols)
    return steps * (4 * a * a * b + 2 * a * a * a)


def assign_owners(
    costs: Sequence[float],
    world_size: int,
    homes: Sequence[int | None] | None = None,
    slack: float = 0.05,
    load: list[float] | None = None,
) -> list[int]:
    """Greedy longest-processing-time assignment with home affinity.

    Matrices are taken by decreasing cost. One whose data already lies on a single rank
    (`homes[i]`) stays there while that rank's load stays within `1 + slack` of the
    ideal mean; every other matrix goes to the least-loaded rank (ties: lowest rank).
    `load` (per rank, updated in place) carries earlier buckets' work, so a step's
    total is balanced, not each bucket alone. Deterministic: every rank computes the
    same answer.
    """
    homes = list(homes) if homes is not None else [None] * len(costs)
    load = load if load is not None else [0.0] * world_size
    target = (1 + slack) * (sum(costs) + sum(load)) / max(world_size, 1)
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        home = homes[i]
        if home is not None and load[home] + costs[i] <= target:
            rank = home
        else:
            rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += costs[i]
    return owners


def imbalance(costs: Sequence[float], owners: Sequence[int], world_size: int) -> float:
    """max / mean of the per-rank cost."""
    load = [0.0] * world_size
    for c, o in zip(costs, owners):
        load[o] += c
    mean = sum(load) / world_size
    return max(load) / mean if mean else 1.0
