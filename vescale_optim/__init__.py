"""vescale_optim: structure-aware distributed optimizers over RaggedShard layouts."""

from .shard import Layout, RaggedShard, plan_layout

__all__ = ["Layout", "RaggedShard", "plan_layout"]
__version__ = "0.1.0"
