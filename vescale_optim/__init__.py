"""vescale_optim: structure-aware distributed optimizers over RaggedShard layouts."""

from .optim import AdamW, Shampoo, ShardedOptimizer
from .shard import Layout, RaggedShard, plan_layout

__all__ = ["AdamW", "Layout", "RaggedShard", "ShardedOptimizer", "Shampoo", "plan_layout"]
__version__ = "0.1.0"
