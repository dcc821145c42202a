"""The demo's checkpoints (`--checkpoint-dir`, `--checkpoint-every`, `--resume`), its
collective timeout (`--timeout`) and the fingerprint of its final weights."""

from __future__ import annotations

import contextlib
import hashlib
import math
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
from torch import nn

import vescale_optim as vo
from vescale_optim.shard.collectives import get_collective_timeout

from .data import Batches

if TYPE_CHECKING:
    from .config import TrainConfig


def params_sha256(model: nn.Module) -> str:
    """SHA-256 of the fp32 bytes of `model.state_dict()`'s tensors in key order (collective
    with `shard_modules`): two runs with the same value have bit-identical weights."""
    h = hashlib.sha256()
    for value in model.state_dict().values():
        h.update(value.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


@contextlib.contextmanager
def collective_timeout(seconds: float, backend: str):
    """On gloo, bound every wait of the optimizers' collectives to `seconds` (a dead or
    stuck rank then fails the others with an error naming the collective). On NCCL the
    process group's own timeout, which the demo sets to the same value, does that."""
    before = get_collective_timeout()
    if backend == "gloo":
        vo.set_collective_timeout(timedelta(seconds=seconds))
    try:
        yield
    finally:
        vo.set_collective_timeout(before)


class Checkpoints:
    """The run's `CheckpointManager` over the model, optimizer, scheduler and data order,
    saving every `cfg.checkpoint_every` steps and at the last; inactive without a directory."""

    def __init__(self, cfg: TrainConfig, model: nn.Module, opt, sched, batches: Batches):
        self.cfg, self.manager = cfg, None
        if cfg.checkpoint_dir is not None:
            stateful = {"data": batches}
            self.manager = vo.CheckpointManager(cfg.checkpoint_dir, model, opt, sched, stateful=stateful)

    def resume(self) -> tuple[int, list[float], list[float]]:
        """With `--resume`, restore the newest complete checkpoint (if any); the step to start
        from, and the losses and training seconds (since the run began, NaN where a checkpoint
        did not record them) of the steps before it. Without it, a directory that already has
        checkpoints is refused, so that a fresh run never mixes with an old one."""
        if self.manager is None:
            return 0, [], []
        if not self.cfg.resume:
            latest = self.manager.latest()
            if latest is not None:
                raise ValueError(
                    f"{self.cfg.checkpoint_dir} already holds checkpoints (the newest of step {latest}): "
                    "pass --resume to continue from it, or choose another --checkpoint-dir"
                )
            return 0, [], []
        loaded = self.manager.load()
        if loaded is None:
            return 0, [], []
        losses = list(loaded.extra["loss"])
        seconds = list(loaded.extra.get("time_s", []))
        if len(seconds) != len(losses):
            seconds = [math.nan] * len(losses)
        return loaded.step, losses, seconds

    def after_step(self, step: int, losses: list[float], seconds: list[float]) -> str | None:
        """Save after `step` steps when one is due; the folder written, or None."""
        if self.manager is None or (step % self.cfg.checkpoint_every and step != self.cfg.steps):
            return None
        return str(self.manager.save(step, extra={"loss": losses, "time_s": seconds}))
