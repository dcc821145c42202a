"""Sharded optimizers over flat, ragged-sharded buckets."""

from .adamw import AdamW, adamw_update_
from .base import ShardedOptimizer

__all__ = ["AdamW", "ShardedOptimizer", "adamw_update_"]
