"""vescale_optim: structure-aware distributed optimizers over RaggedShard layouts.

The public API: the optimizers, `ShardingConfig`, the checkpoint API and the errors. The layout
building blocks (`RaggedShard`, `plan_layout`, `Layout`) are public in `vescale_optim.shard`.
"""

from .checkpoint import CheckpointError, CheckpointManager
from .distributed import init_distributed
from .optim import SOAP, AdamW, Muon, Shampoo, ShardedOptimizer, muon_param_groups
from .optim._muon_plan import CostModel, MuonPlan, muon_plan
from .shard import (
    CollectiveError,
    DeviceMismatchError,
    set_collective_timeout,
)
from .units import (
    NoSyncMismatchError,
    ReshardedParameterError,
    ShardedGradError,
    ShardingConfig,
    WrapperError,
)
from .version import __version__

__all__ = [
    "SOAP",
    "AdamW",
    "CheckpointError",
    "CheckpointManager",
    "CollectiveError",
    "CostModel",
    "DeviceMismatchError",
    "Muon",
    "MuonPlan",
    "NoSyncMismatchError",
    "ReshardedParameterError",
    "ShardedGradError",
    "ShardedOptimizer",
    "Shampoo",
    "ShardingConfig",
    "WrapperError",
    "__version__",
    "init_distributed",
    "muon_param_groups",
    "muon_plan",
    "set_collective_timeout",
]
