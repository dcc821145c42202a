"""vescale_optim: structure-aware distributed optimizers over RaggedShard layouts."""

from .optim import AdamW, Muon, Shampoo, ShardedOptimizer, muon_param_groups
from .shard import Layout, RaggedShard, plan_layout

__all__ = [
    "AdamW",
    "Layout",
    "Muon",
    "RaggedShard",
    "ShardedOptimizer",
    "Shampoo",
    "muon_param_groups",
    "plan_layout",
]
__version__ = "0.1.0"
