"""The optimizers: each a small class over its update math, holding a sharding runtime."""

from .adamw import AdamW
from .base import ShardedOptimizer
from .muon import Muon
from .muon_groups import muon_param_groups
from .shampoo import Shampoo
from .soap import SOAP

__all__ = ["SOAP", "AdamW", "Muon", "ShardedOptimizer", "Shampoo", "muon_param_groups"]
