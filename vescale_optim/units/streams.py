"""Where a unit's collectives are issued: on CUDA, on streams of their own; elsewhere, here.
And the communicator gradient reductions run on.

On a GPU a collective issued from the compute stream waits for all compute queued before
it. Following FSDP2, all-gathers, reduce-scatters and the all-reduces across replicas
(HSDP) are issued from three side streams (one set per device, shared by every unit), each
made to wait for the compute stream at the moment of issue — so a collective waits for
exactly what was queued before its fixed point in the hook order, a prefetch issued before
the compute it must overlap is queued overlaps it, and a slow all-reduce across nodes
holds up neither the next reduce-scatter nor the next gather. The compute stream waits
for a collective when the collective's handle is waited for (NCCL's `work.wait()` orders
the current stream, without blocking the host).

Streams alone do not make collectives overlap: NCCL runs the collectives of one
communicator one after another, on that communicator's own stream, whichever stream
issued them. So on NCCL the reductions run on a communicator of their own
(`reduction_comm`: a second group over the shard group's ranks), and backward's prefetch
all-gather no longer queues behind the reduce-scatter before it. gloo runs each
collective synchronously on the host: one group serves both there.

Memory stays in stream order without `record_stream`: every buffer a collective reads or
writes is allocated on the compute stream (outside these contexts) and freed only after
the compute stream has waited for that collective, so the caching allocator can hand its
block to later compute-stream work only. Staging a collective allocates inside its
context (a side stream's block) is freed after the compute stream waited, and each side
stream waits for the compute stream before its next collective, so such a block is
reused only after its collective finished. A wait from another stream (a user's stream
reading `.grad`) goes through `waited_from`, which keeps that rule.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

from ..shard import handle
from ..shard.comm import Comm


class Streams:
    """The side streams of one device (none off CUDA: every context does nothing)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.gather = torch.cuda.Stream(device, priority=-1)
            self.reduce = torch.cuda.Stream(device, priority=-1)
            self.replicas = torch.cuda.Stream(device, priority=-1)

    def current(self):
        """The stream now current on the device (None off CUDA)."""
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def use(self, stream) -> contextlib.AbstractContextManager[None]:
        """Make `stream` current inside."""
        return torch.cuda.stream(stream)

    @contextlib.contextmanager
    def _on(self, stream) -> Iterator[None]:
        if not self.cuda:
            yield
            return
        stream.wait_stream(self.current())
        with self.use(stream):
            yield

    def gathering(self) -> contextlib.AbstractContextManager[None]:
        """Issue an all-gather: after the compute queued so far, beside what comes next."""
        return self._on(self.gather) if self.cuda else contextlib.nullcontext()

    def reducing(self) -> contextlib.AbstractContextManager[None]:
        """Issue a gradient reduce-scatter: after the gradients queued so far."""
        return self._on(self.reduce) if self.cuda else contextlib.nullcontext()

    def across_replicas(self) -> contextlib.AbstractContextManager[None]:
        """Issue a reduction's all-reduce across replicas (its reduce-scatter was waited for)."""
        return self._on(self.replicas) if self.cuda else contextlib.nullcontext()

    @contextlib.contextmanager
    def waited_from(self, home) -> Iterator[None]:
        """Wait inside for collectives whose buffers were allocated on the stream `home` (the
        compute stream; None: nothing to keep in order), from whichever stream is current.

        Waiting orders the current stream after the collective, and what the wait then
        frees goes back to the allocator as `home`'s block, for `home`'s next work. From a
        stream other than `home` (a `.grad` read under the user's own stream) that would
        hand `home` memory a collective may still read or write: so the waits run with
        `home` current (it waits for the collectives, and the frees follow in its order),
        and the reading stream then waits for `home` before it reads what they wrote."""
        reading = self.current() if self.cuda and home is not None else None
        if reading is None or reading == home:
            yield
            return
        with self.use(home):
            yield
        reading.wait_stream(home)


_STREAMS: dict[torch.device, Streams] = {}


def streams_for(device: torch.device) -> Streams:
    """The side streams of `device`, shared by every unit on it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _STREAMS:
        _STREAMS[device] = Streams(device)
    return _STREAMS[device]


def separate_reductions(comm: Comm) -> bool:
    """Whether gradient reductions over `comm` need a communicator of their own to run beside
    its all-gathers: on NCCL (CUDA tensors) only; gloo runs one collective at a time anyway."""
    return comm.active and comm.device.type == "cuda"


_REDUCTION_COMMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reduction_comm(comm: Comm) -> Comm:
    """The group gradient reductions over `comm` run on: a second group over the same ranks
    where `separate_reductions` says so (made once per process group, by all of its ranks at
    the same call: `handle.duplicate_group`), else `comm` itself (as for a smaller group than
    the world whose device is not bound: no copy of it is made safely)."""
    if not separate_reductions(comm):
        return comm
    parent = comm.group if comm.group is not None else handle.default_group()
    if parent not in _REDUCTION_COMMS:
        copy = handle.duplicate_group(parent)
        _REDUCTION_COMMS[parent] = comm if copy is None else Comm(copy)
    return _REDUCTION_COMMS[parent]
