"""vescale_optim: structure-aware distributed optimizers over RaggedShard layouts."""

from .checkpoint import CheckpointError, CheckpointManager
from .distributed import init_distributed
from .optim import AdamW, Muon, Shampoo, ShardedOptimizer, muon_param_groups
from .optim._muon_plan import CostModel, MuonPlan, muon_plan
from .shard import (
    CollectiveError,
    DeviceMismatchError,
    Layout,
    RaggedShard,
    plan_layout,
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
    "AdamW",
    "CheckpointError",
    "CheckpointManager",
    "CollectiveError",
    "CostModel",
    "DeviceMismatchError",
    "Layout",
    "Muon",
    "MuonPlan",
    "NoSyncMismatchError",
    "RaggedShard",
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
    "plan_layout",
    "set_collective_timeout",
]

