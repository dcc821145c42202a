"""The sharding runtime: communication units, their module hooks and life cycle, and the
runtime object an optimizer holds."""

from .config import ShardingConfig
from .reduced_grad import ReducedGrad, Sharded, ShardedGradError, Unreduced
from .reduction import NoSyncMismatchError
from .runtime import Declaration, Runtime
from .segment import Segment
from .stand_in import ReshardedParameterError
from .unit import State, Unit
from .wrappers import WrapperError

__all__ = [
    "Declaration",
    "NoSyncMismatchError",
    "Unreduced",
    "ReducedGrad",
    "ReshardedParameterError",
    "Runtime",
    "Segment",
    "Sharded",
    "ShardedGradError",
    "ShardingConfig",
    "State",
    "Unit",
    "WrapperError",
]
