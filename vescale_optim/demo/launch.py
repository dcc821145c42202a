"""Start the demo's ranks: local gloo CPU ranks (`vescale_optim.local_world`), torchrun ranks, or one
plain process."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..local_world import run_local
from .config import TrainConfig
from .train import train


def _attempt_store(timeout: timedelta) -> dict:
    """After an elastic restart, gloo's addresses under keys of this attempt only: a restarted
    rank could otherwise read a dead worker's address and fail to connect."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)  # fmt: skip
    store = dist.PrefixStore(f"vescale_demo/attempt_{attempt}", agent)
    return dict(store=store, rank=rank, world_size=world_size)


def _torchrun(cfg: TrainConfig, launch_time: float) -> None:
    """One torchrun rank: env:// init, NCCL on the local GPU when there is one."""
    timeout = timedelta(seconds=cfg.timeout)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout, **_attempt_store(timeout))
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
