"""Sharded optimizers over flat, ragged-sharded buckets."""

from .adamw import AdamW, adamw_update_
from .base import ShardedOptimizer
from .shampoo import Shampoo

__all__ = ["AdamW", "ShardedOptimizer", "Shampoo", "adamw_update_"]
