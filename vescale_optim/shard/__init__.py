"""Ragged sharding: placement spec, layout planner, flat buffers, redistribution plans and
the collectives that execute them (each redistribution is a pure plan, then one collective)."""

from .buffer import FlatBuffer
from .collectives import (
    CollectiveError,
    full_tensor,
    local_slice,
    redistribute,
    run_plan,
    set_collective_timeout,
)
from .comm import DeviceMismatchError
from .layout import Layout, plan_layout
from .redistribution import (
    Piece,
    Plan,
    Transfer,
    plan_gather_to_owner,
    plan_move,
    plan_redistribute,
    plan_scatter_from_owner,
    ragged_pieces,
)
from .spec import RaggedShard, flat_range_boxes

__all__ = [
    "CollectiveError",
    "DeviceMismatchError",
    "FlatBuffer",
    "Layout",
    "Piece",
    "Plan",
    "RaggedShard",
    "Transfer",
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
    "run_plan",
    "set_collective_timeout",
]
