"""A benchmark's ranks under torchrun instead of a local gloo world: every torchrun process is one rank.

    world, run, where = ranks(args.torchrun, args.world_size, 4)   # torchrun's or a local world
    results = run(fn, world, arg1, arg2)        # fn(rank, world, arg1, arg2) here; every rank's result
    if quiet(args.torchrun): return {}          # the group left; only rank 0 goes on to report

`join` meets the other ranks through `vescale_optim.init_distributed` (NCCL on `cuda:LOCAL_RANK`
where CUDA is available, gloo otherwise; on the CPU each rank then gets its share of the machine's
CPUs, as in a local world). `launch` takes `benchmarks._gpt.launch`'s arguments, runs `fn` on this
rank and gathers every rank's result (`all_gather_object`) with `.threads`. A torchrun world cannot
be rebuilt per call, so every call shares the same processes (per-process peaks mix).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

import vescale_optim as vo
from benchmarks import _gpt
from benchmarks._gpt import Ranks, threads_per_rank
from benchmarks._train import device

TIMEOUT = 900.0  # seconds: the process group's, as the local world's collective timeout


def join(world_size: int | None = None) -> torch.device:
    """Join torchrun's process group (once per process) and return this rank's device; a
    `world_size` other than torchrun's is refused."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        start = "`torchrun --nproc-per-node N <script> --torchrun ...`"
        raise SystemExit(f"--torchrun: RANK and WORLD_SIZE are not set; start it as {start}")
    if world_size is not None and world_size != int(os.environ["WORLD_SIZE"]):
        raise SystemExit(f"--world-size {world_size}, but torchrun started {os.environ['WORLD_SIZE']} ranks")
    if not dist.is_initialized() and vo.init_distributed(timeout=TIMEOUT).type == "cpu":
        torch.set_num_threads(threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    return device()


def launch(
    fn: Callable[..., Any], world_size: int, *args: Any, preload: Sequence = (), timeout=None
) -> Ranks:
    """`fn(rank, world_size, *args)` on this rank; every rank's result, in rank order, on every
    rank. `preload` and `timeout` are the local launcher's and mean nothing here (the group's
    timeout bounds every collective)."""
    if world_size != dist.get_world_size():
        raise ValueError(f"a torchrun world has {dist.get_world_size()} ranks, not {world_size}")
    mine = (torch.get_num_threads(), fn(dist.get_rank(), world_size, *args))
    every: list = [None] * world_size
    dist.all_gather_object(every, mine)
    results = Ranks(r for _, r in every)
    results.threads = [t for t, _ in every]
    return results


def is_first() -> bool:
    """Whether this process reports: rank 0, or the only process."""
    return not dist.is_initialized() or dist.get_rank() == 0


def leave() -> None:
    """The group destroyed once every rank is here (a rank leaving while a peer still has
    collectives in flight over it aborts in gloo's teardown)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def ranks(torchrun: bool, world_size: int | None, default: int) -> tuple[int, Callable, dict]:
    """Where a benchmark's ranks run: with `torchrun`, in torchrun's group (joined; `world_size`,
    when given, must be its size), else in local gloo worlds of `world_size` (or `default`) ranks.
    Returns the world size, the launcher and what a result records of it (torchrun, device, backend)."""
    if not torchrun:
        return world_size or default, _gpt.launch, {}
    device = join(world_size)
    return (
        dist.get_world_size(),
        launch,
        {"torchrun": True, "device": device.type, "backend": dist.get_backend()},
    )


def quiet(torchrun: bool) -> bool:
    """After the ranks' work: under `torchrun` the group is left, and True on every process but
    rank 0's, which alone reports; False without torchrun."""
    if not torchrun:
        return False
    first = is_first()
    leave()
    return not first
