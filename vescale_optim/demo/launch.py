"""Start the demo's ranks: local gloo CPU ranks (`vescale_optim.local_world`), torchrun ranks, or one
plain process."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch.distributed as dist

from ..distributed import init_distributed
from ..local_world import run_local
from .config import TrainConfig
from .train import train


def _torchrun(cfg: TrainConfig, launch_time: float) -> None:
    """One torchrun rank: NCCL on the local GPU when there is one, else gloo, joined under keys of
    this restart attempt only (`vescale_optim.init_distributed`), so a restarted run meets again."""
    init_distributed(timeout=timedelta(seconds=cfg.timeout))
    try:
        train(cfg, launch_time)
    finally:
        dist.destroy_process_group()


def launch(cfg: TrainConfig, world_size: int, launch_time: float | None = None) -> None:
    """Train on `world_size` local gloo ranks, in this process for 1, or as a torchrun rank.

    Under torchrun (RANK and WORLD_SIZE set) `world_size` is ignored: this process is one
    rank of torchrun's group, on NCCL when CUDA is available.
    """
    launch_time = time.time() if launch_time is None else launch_time
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _torchrun(cfg, launch_time)
    elif world_size == 1:
        train(cfg, launch_time)
    else:
        # A local gloo world whose fork server imports torch and the demo once; a rank that fails
        # fails the launch with its traceback.
        run_local(train, world_size, cfg, launch_time, preload=[__name__], collective_timeout=cfg.timeout)
