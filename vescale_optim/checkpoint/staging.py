"""Staging a checkpoint in host memory before DCP writes it: one device synchronisation a save.

DCP's file writer moves every tensor it writes to the CPU itself: on CUDA, `.to("cpu")` per
tensor into pageable memory, a synchronisation each (every 10 MB in flight). Instead a
save copies its state here first, the way FSDP2 + DCP users expect of a staged checkpoint
(`torch.distributed.checkpoint`'s `DefaultStager` with pinned, cached buffers):

* a CUDA tensor or piece is copied, `non_blocking=True`, into a pinned CPU buffer that
  is allocated on the first save and reused by every later save of the same key, shape
  and dtype; after the last copy one CUDA event per device (one in a run of one device
  per rank) is recorded on that device's current stream and waited for. The copies are
  queued behind everything training queued there, so they see the state of the step.
* a CPU tensor is not pinned. A synchronous save writes it from its own memory (no copy);
  an asynchronous one, whose writer runs while training changes it, copies it, once.
* any other value is kept (synchronous) or deep-copied (asynchronous).

`staging(device, asynchronous)` is that decision, a pure function of where a tensor lives.
Once `stage` returns, the result is plain CPU memory: a writer thread never touches CUDA.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ..shard.dcp import DcpPiece


class Staging(enum.Enum):
    """How a save stages a tensor before DCP writes it."""

    LIVE = "live"  # written from its own memory (CPU tensors of a synchronous save)
    COPY = "copy"  # a plain CPU copy (CPU tensors of an asynchronous save; other devices)
    PINNED = "pinned"  # a non-blocking copy into a reused pinned buffer (CUDA tensors)


def staging(device: torch.device | str, asynchronous: bool) -> Staging:
    """How a tensor on `device` is staged by a save (`asynchronous` or not): CUDA tensors
    into pinned buffers, CPU tensors left in place by a synchronous save and copied by an
    asynchronous one, tensors on any other device copied to the CPU."""
    kind = torch.device(device).type
    if kind == "cuda":
        return Staging.PINNED
    if kind == "cpu" and not asynchronous:
        return Staging.LIVE
    return Staging.COPY


@dataclass(frozen=True)
class StagingStats:
    """What staging one save did on this rank.

    - `seconds`: wall time of the staging, the wait for the device included: how long the
      save held training up to copy its state (an asynchronous save returns right after).
    - `device_bytes`: bytes copied from devices into pinned buffers; `copied_bytes`: bytes
      of plain CPU copies.
    - `pinned_bytes`: pinned buffers held for the next save (requested bytes; torch's
      host allocator may round each up); `new_pinned_bytes`: those allocated by this save
      (0 when every buffer was reused).
    - `buffers` / `reused`: pinned buffers this save used, and how many of them an earlier
      save had allocated.
    - `syncs`: device events waited for (0 on CPU, one per CUDA device used).
    - `device`: the CUDA device index the pinned copies came from (None: none).
    """

    seconds: float = 0.0
    device_bytes: int = 0
    copied_bytes: int = 0
    pinned_bytes: int = 0
    new_pinned_bytes: int = 0
    buffers: int = 0
    reused: int = 0
    syncs: int = 0
    device: int | None = None


def _host_buffer(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


class HostStager:
    """Stages a checkpoint's state dict in host memory (see the module's docstring) and
    keeps the pinned buffers for the next save.

    `policy` decides per tensor (`staging`, unless a test sends CPU tensors down the
    buffer path as stand-ins for a device's: their buffers are plain, only CUDA tensors'
    are pinned). Buffers are kept by the tensor's key in the state dict; those of keys,
    shapes or dtypes a save no longer has are dropped by that save;
    `release()` drops them all. A save overwrites the buffers the previous one returned:
    its caller finishes writing that one first (`CheckpointManager.save` waits for it).
    """

    def __init__(self, policy: Callable[[torch.device, bool], Staging] = staging) -> None:
        self.policy = policy
        self._buffers: dict[str, tuple[torch.Tensor, bool]] = {}  # key -> (buffer, pinned)
        self.last: StagingStats | None = None

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the staging buffers held now."""
        return sum(b.numel() * b.element_size() for b, _ in self._buffers.values())

    def release(self) -> None:
        """Drop every staging buffer (the next save allocates them again)."""
        self._buffers.clear()

    def stage(self, state_dict: dict, *, asynchronous: bool) -> dict:
        """A copy of `state_dict` for DCP to write (its dicts and lists rebuilt, its leaves
        staged), complete when this returns: training may change the live state at once
        after an asynchronous save, and after a synchronous one DCP copies nothing from a
        device. Records what it did in `last`."""
        start = time.perf_counter()
        run = _Run(self, asynchronous)
        staged = run.walk(state_dict, "")
        syncs = _fence(run.devices)
        self._buffers = run.used  # buffers this save did not use are let go
        device = min((d.index for d in run.devices), default=None)
        self.last = StagingStats(
            seconds=time.perf_counter() - start,
            device_bytes=run.device_bytes,
            copied_bytes=run.copied_bytes,
            pinned_bytes=self.pinned_bytes,
            new_pinned_bytes=run.new_bytes,
            buffers=len(run.used),
            reused=run.reused,
            syncs=syncs,
            device=device,
        )
        return staged


class _Run:
    """One save's staging: the buffers it used, the devices it queued copies on, its counts."""

    def __init__(self, stager: HostStager, asynchronous: bool) -> None:
        self.stager, self.asynchronous = stager, asynchronous
        self.used: dict[str, tuple[torch.Tensor, bool]] = {}
        self.devices: set[torch.device] = set()
        self.device_bytes = self.copied_bytes = self.new_bytes = self.reused = 0

    def walk(self, x, key: str):
        if isinstance(x, Mapping):
            return {k: self.walk(v, f"{key}{k}.") for k, v in x.items()}
        if isinstance(x, list):
            return [self.walk(v, f"{key}{i}.") for i, v in enumerate(x)]
        if isinstance(x, torch.Tensor):
            return self.tensor(x, key[:-1])
        return copy.deepcopy(x) if self.asynchronous else x

    def buffer(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """The staging buffer of `key`: the one an earlier save left if it fits, else new."""
        old, pinned = self.stager._buffers.get(key, (None, pin))
        if old is not None and tuple(old.shape) == shape and old.dtype == dtype and pinned == pin:
            self.reused += 1
            buf = old
        else:
            buf = _host_buffer(shape, dtype, pin)
            self.new_bytes += buf.numel() * buf.element_size()
        self.used[key] = (buf, pin)
        return buf

    def tensor(self, x: torch.Tensor, key: str) -> torch.Tensor:
        kind = self.stager.policy(x.device, self.asynchronous)
        piece = isinstance(x, DcpPiece)
        nbytes = (x._numel if piece else x.numel()) * x.dtype.itemsize  # a piece has no element_size()
        if kind is Staging.LIVE:
            return x
        if kind is Staging.COPY:
            self.copied_bytes += nbytes
            return x.copy("cpu") if piece else x.detach().to("cpu", copy=True)
        pin = x.device.type == "cuda"
        if pin:
            self.devices.add(x.device)
        self.device_bytes += nbytes
        if piece:
            return x.copy_into(self.buffer(key, (x._numel,), x.dtype, pin), non_blocking=pin)
        buf = self.buffer(key, tuple(x.shape), x.dtype, pin)
        buf.copy_(x.detach(), non_blocking=pin)
        return buf


def _fence(devices: set[torch.device]) -> int:
    """Wait for the copies queued on each device: one event, recorded on the device's
    current stream after its last copy (where `copy_` queued them), each. How many."""
    events = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    for event in events:
        event.synchronize()
    return len(events)


@contextlib.contextmanager
def on_device(index: int | None):
    """CUDA work of the writer thread, if any (a CUDA tensor in `extra`), on this rank's
    device, not on device 0 where a new thread starts."""
    if index is None:
        yield
    else:
        with torch.cuda.device(index):
            yield


__all__ = ["HostStager", "Staging", "StagingStats", "on_device", "staging"]
