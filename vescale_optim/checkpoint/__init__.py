"""Checkpoints of whole training runs: atomic `step-N/` folders through torch.distributed.checkpoint."""

from .manager import CheckpointError, CheckpointManager, Loaded
from .manifest import MANIFEST

__all__ = ["MANIFEST", "CheckpointError", "CheckpointManager", "Loaded"]
