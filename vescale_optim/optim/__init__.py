"""Sharded optimizers over flat, ragged-sharded buckets."""

from .adamw import AdamW, adamw_update_
from .base import ShardedOptimizer
from .muon import Muon
from .muon_groups import muon_param_groups
from .owners import assign_owners, ns_flops
from .shampoo import Shampoo

__all__ = [
    "AdamW",
    "Muon",
    "ShardedOptimizer",
    "Shampoo",
    "adamw_update_",
    "assign_owners",
    "muon_param_groups",
    "ns_flops",
]
