"""Start the demo's ranks: spawned gloo CPU ranks, torchrun ranks, or one plain process."""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .config import TrainConfig
from .train import train


def _threads_per_rank(world_size: int) -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus // world_size)


def _worker(rank: int, world_size: int, init_file: str, cfg: TrainConfig, launch_time: float) -> None:
    """One spawned CPU rank: join the gloo group through the shared file, train, leave."""
    torch.set_num_threads(_threads_per_rank(world_size))
    timeout = timedelta(seconds=cfg.timeout)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timeout
    )
    try:
        train(cfg, launch_time)
    finally:
        dist.destroy_process_group()


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
    """Train on `world_size` spawned gloo ranks, in this process for 1, or as a torchrun rank.

    Under torchrun (RANK and WORLD_SIZE set) `world_size` is ignored: this process is one
    rank of torchrun's group, on NCCL when CUDA is available.
    """
    launch_time = time.time() if launch_time is None else launch_time
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _torchrun(cfg, launch_time)
    elif world_size == 1:
        train(cfg, launch_time)
    else:
        # The fork server imports torch and the demo once; every rank forks from it.
        multiprocessing.get_context("forkserver").set_forkserver_preload([__name__])
        with tempfile.TemporaryDirectory(prefix="vo_demo_") as tmp:
            mp.start_processes(
                _worker,
                args=(world_size, os.path.join(tmp, "store"), cfg, launch_time),
                nprocs=world_size,
                join=True,
                start_method="forkserver",
            )
