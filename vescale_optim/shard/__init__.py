"""Ragged sharding: placement spec, layout planner, flat buffers and collectives."""

from .buffer import FlatBuffer, bind_parameters
from .collectives import (
    CollectiveError,
    Comm,
    Handle,
    all_gather_,
    all_reduce_,
    broadcast_,
    full_tensor,
    local_slice,
    redistribute,
    reduce_scatter_,
    run_plan,
    set_collective_timeout,
)
from .plan import (
    Piece,
    Plan,
    Transfer,
    plan_gather_to_owner,
    plan_move,
    plan_redistribute,
    plan_scatter_from_owner,
    ragged_pieces,
)
from .planner import Layout, bucket_indices, plan_layout
from .spec import RaggedShard, flat_range_boxes

__all__ = [
    "CollectiveError",
    "Comm",
    "FlatBuffer",
    "Handle",
    "Layout",
    "Piece",
    "Plan",
    "RaggedShard",
    "Transfer",
    "all_gather_",
    "all_reduce_",
    "bind_parameters",
    "broadcast_",
    "bucket_indices",
    "flat_range_boxes",
    "full_tensor",
    "local_slice",
    "plan_gather_to_owner",
    "plan_layout",
    "plan_move",
    "plan_redistribute",
    "plan_scatter_from_owner",
    "ragged_pieces",
    "redistribute",
    "reduce_scatter_",
    "run_plan",
    "set_collective_timeout",
]
