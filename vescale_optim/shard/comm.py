"""A process group as this library sees it: rank, size, backend and device (`Comm`)."""

from __future__ import annotations

import os

import torch
from torch.distributed import ProcessGroup

from . import handle


def forced() -> bool:
    """Whether `VESCALE_OPTIM_FORCE_COLLECTIVES=1` makes a group of one rank issue its
    collectives anyway (a test switch: one GPU then runs the NCCL paths, asynchronous
    handles and streams of a real world)."""
    return os.environ.get("VESCALE_OPTIM_FORCE_COLLECTIVES", "0") == "1"


class Comm:
    """Rank, size, group and device of a process group; one process when none is initialised.

    The group's device, by one rule: a group whose backend includes NCCL (`"nccl"`, or
    `"cpu:gloo,cuda:nccl"`) moves CUDA tensors, on the device it was bound to
    (`init_process_group(device_id=...)`) or else the current CUDA device; any other
    group moves CPU tensors. `gloo` says whether this library's tensors travel through
    gloo (whose quirks the calls below work around)."""

    def __init__(self, group: ProcessGroup | None = None):
        self.distributed = handle.initialized()
        if group is not None and not self.distributed:
            raise ValueError("a process_group was given but torch.distributed is not initialised")
        self.group = group
        self.rank = handle.group_rank(group) if self.distributed else 0
        self.world_size = handle.group_size(group) if self.distributed else 1
        self.backend = handle.group_backend(group) if self.distributed else "none"
        self.device = _group_device(group, self.backend) if self.distributed else torch.device("cpu")
        self.gloo = self.device.type == "cpu" and "gloo" in self.backend

    @classmethod
    def alone(cls) -> Comm:
        """A group of this process alone (nothing to talk to), even under torch.distributed."""
        comm = cls.__new__(cls)
        comm.distributed, comm.group, comm.rank, comm.world_size, comm.gloo = False, None, 0, 1, False
        comm.backend, comm.device = "none", torch.device("cpu")
        return comm

    def global_rank(self, rank: int) -> int:
        """The default group's rank of this group's `rank`."""
        return handle.global_rank(self.group, rank) if self.group is not None else rank

    @property
    def active(self) -> bool:
        """Whether calls need to talk to other processes (or are forced to: `forced()`)."""
        return self.distributed and (self.world_size > 1 or forced())


class DeviceMismatchError(RuntimeError):
    """The process group is bound to one CUDA device (`init_process_group(device_id=...)`)
    while another is current: torch.distributed stages Python objects (`all_gather_object`,
    used at construction, at the first step and in checkpoints) on the current device, so
    every rank's bytes would land on that one, not on the group's."""


def _group_device(group: ProcessGroup | None, backend: str) -> torch.device:
    """The device a group's tensors live on (see `Comm`); `DeviceMismatchError` when the
    group is bound to a CUDA device that is not the current one."""
    if "nccl" not in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    pg = group if group is not None else handle.default_group()
    bound = getattr(pg, "bound_device_id", None)
    current = torch.cuda.current_device()
    if bound is not None:
        bound = torch.device(bound)
        if bound.type == "cuda" and (bound.index if bound.index is not None else current) != current:
            raise DeviceMismatchError(
                f"the process group is bound to {bound} (init_process_group(device_id=...)) but the current "
                f"CUDA device is cuda:{current}: torch.distributed stages objects (all_gather_object) on the "
                f"current device, so every rank's would land on cuda:{current}; call "
                f"torch.cuda.set_device({bound.index}) before init_process_group"
            )
        return bound
    local = local_cuda_index()
    if local is not None and local != current:
        raise RuntimeError(
            f"this process is local rank {os.environ['LOCAL_RANK']} (cuda:{local} of the "
            f"{torch.cuda.device_count()} it sees) but its current CUDA device is cuda:{current}, so it "
            f"would share that GPU with another rank; call torch.cuda.set_device({local}) before "
            "init_process_group (or pass device_id= to it; vo.init_distributed does both)"
        )
    return torch.device("cuda", current)


def local_cuda_index() -> int | None:
    """The CUDA device (an ordinal among those this process sees) its launcher's `LOCAL_RANK`
    names: LOCAL_RANK modulo the visible devices, since a launcher that shows each process
    only its own GPUs (SLURM's `--gpus-per-task=1`, `CUDA_VISIBLE_DEVICES` per rank) still
    numbers the processes of a node 0, 1, ... past them. None without LOCAL_RANK or a
    visible CUDA device."""
    local, visible = os.environ.get("LOCAL_RANK"), torch.cuda.device_count()
    if local is None or visible == 0:
        return None
    return int(local) % visible


def host_to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of Python `values` on `device` without stalling it: on CUDA through pinned
    memory and a non-blocking copy (`torch.tensor(values, device="cuda")` copies from
    pageable memory and synchronises); elsewhere the tensor itself."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
