"""Ragged sharding: placement spec, layout planner, flat buffers and collectives."""

from .planner import Layout, plan_layout
from .spec import RaggedShard, flat_range_boxes

__all__ = ["Layout", "RaggedShard", "flat_range_boxes", "plan_layout"]
