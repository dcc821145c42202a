"""The owner-compute layer: math that needs an item whole on one rank (Muon's matrices,
Shampoo's tiles), computed once in the world by the rank the one balancer chose.

- `balance`: which rank computes which item (costs, homes, the balancer);
- `plan`: the work items an optimizer declares per segment and the gather and scatter
  plans that bring them to their owners and the results back (`plan_owners`);
- `moves`: a step's moves of every segment, run overlapped (`run_moves`).

It sits beside the runtime (`units`) and below the optimizers, above the shard layer whose
redistribution plans and collectives it uses; it knows nothing of what an owner computes.
"""

from .balance import assign_owners, keep_homes, rank_loads, spread_homes
from .moves import Move, run_moves
from .plan import SegmentMoves, WorkItem, plan_owners

__all__ = [
    "Move",
    "SegmentMoves",
    "WorkItem",
    "assign_owners",
    "keep_homes",
    "plan_owners",
    "rank_loads",
    "run_moves",
    "spread_homes",
]
