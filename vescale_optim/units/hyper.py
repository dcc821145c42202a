"""That every rank steps with the same hyperparameters, checked at each step for free.

A param group's hyperparameters (every key but `params`) are hashed on the host into a
32-bit digest that rides in the step's existing agreement all-reduce (`GradTracker.agree`).
Only when the digests differ do the ranks gather their groups (a collective on that error
path alone) to name the rank, the group and the key. An `lr` changed on one rank only, or a
scheduler stepped on some ranks, would otherwise shard each rank's piece with its own value.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from ..shard.collectives import Comm, all_gather_object


def _value(v: object) -> str:
    """A hyperparameter as the ranks compare it. A CPU tensor by its values and dtype; a
    tensor on an accelerator by dtype and shape only (reading it would stall the device);
    an object whose repr holds its address by its type."""
    if isinstance(v, torch.Tensor):
        if v.device.type == "cpu":
            return f"tensor({v.detach().tolist()!r}, {v.dtype})"
        return f"tensor(shape={tuple(v.shape)}, {v.dtype})"
    text = repr(v)
    return type(v).__qualname__ if " at 0x" in text else text


def _groups(param_groups: Sequence[dict]) -> list[dict[str, str]]:
    return [{k: _value(v) for k, v in sorted(g.items()) if k != "params"} for g in param_groups]


def hyper_digest(param_groups: Sequence[dict]) -> int:
    """A 32-bit hash of every group's hyperparameters (the same on every rank iff they agree)."""
    return zlib.crc32(repr(_groups(param_groups)).encode())


def hyper_mismatch(param_groups: Sequence[dict], comm: Comm) -> str:
    """Which rank differs from rank 0 in which group and key, in words (collective)."""
    mine = _groups(param_groups)
    everyone = all_gather_object(mine, comm)
    for rank, theirs in enumerate(everyone):
        for gi, (a, b) in enumerate(zip(everyone[0], theirs)):
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    return (
                        f"step refused on every rank: param group {gi}: {key!r} is {b.get(key, '(absent)')} "
                        f"on rank {rank} but {a.get(key, '(absent)')} on rank 0; hyperparameters must be "
                        "the same on every rank (change them on all ranks, e.g. through one scheduler each)"
                    )
    return "step refused on every rank: the ranks' hyperparameters differ (their hashes do)"
