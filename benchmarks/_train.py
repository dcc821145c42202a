"""What the FSDP and HSDP benchmarks share to train their configurations side by side: the same
per-rank batches, one step timed phase by phase, and every configuration of a world stepped in turn.

    loss, seconds, comm = train_step(model, opt, x, y, meter)   # per phase: seconds, meter.take()
    interleave(trainers, batches(shape, rank, world), warmup, steps)
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch.profiler import record_function

from benchmarks._comm import CommMeter
from benchmarks._gpt import random_batch

__all__ = ["PHASES", "batches", "interleave", "train_step"]

PHASES = ["fwd", "bwd", "step", "zero_grad"]


def batches(shape: dict, rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A pool of two batches for this rank, cycled, so a working optimizer lowers the loss."""
    return [random_batch(shape["batch"], shape["seq"], shape["vocab"], seed=1000 + i * world + rank)
            for i in range(2)]  # fmt: skip


def train_step(
    model: torch.nn.Module,
    opt,
    x: torch.Tensor,
    y: torch.Tensor,
    meter: CommMeter | None = None,
    around: Mapping[str, AbstractContextManager] | None = None,
) -> tuple[float, dict[str, float], dict[str, dict]]:
    """One train step after a barrier, each phase of `PHASES` under `bench::PHASE` (and its context
    in `around`, entered outside that): the loss, the seconds of each phase and, with a `meter`,
    what it measured in each phase."""
    around = around or {}
    if meter is not None:
        meter.take()
    (meter.barrier if meter is not None else dist.barrier)()
    times, comm, loss = {}, {}, None
    for name in PHASES:
        with around.get(name, nullcontext()), record_function(f"bench::{name}"):
            t0 = time.perf_counter()
            if name == "fwd":
                loss = model.loss(x, y)
            elif name == "bwd":
                loss.backward()
            else:
                getattr(opt, name)()
            times[name] = time.perf_counter() - t0
        if meter is not None:
            comm[name] = meter.take()
    return loss.item(), times, comm


def interleave(trainers: list, pool: list, warmup: int, steps: int) -> None:
    """`warmup + steps` rounds, each calling every trainer's `step` once on the round's batch of `pool`, the
    order rotating so that load on the machine hits them alike; warm-up rounds are not recorded."""
    for s in range(warmup + steps):
        k = s % len(trainers)
        for tr in trainers[k:] + trainers[:k]:
            tr.step(*pool[s % len(pool)], record=s >= warmup)
