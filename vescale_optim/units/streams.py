"""Where a unit's collectives are issued: on CUDA, on streams of their own; elsewhere, here.

On a GPU a collective issued from the compute stream waits for all compute queued before
it. Following FSDP2, all-gathers and reductions are issued from two side streams (one
pair per device, shared by every unit), each made to wait for the compute stream at the
moment of issue — so a collective waits for exactly what was queued before its fixed
point in the hook order, and a prefetch issued before the compute it must overlap is
queued overlaps it. The compute stream waits for a collective when the collective's
handle is waited for (NCCL's `work.wait()` orders the current stream, without blocking
the host).

Memory stays in stream order without `record_stream`: every buffer a collective reads or
writes is allocated on the compute stream (outside these contexts) and freed only after
the compute stream has waited for that collective, so the caching allocator can hand its
block to later compute-stream work only. Staging a collective allocates inside its
context (a side stream's block) is freed after the compute stream waited, and each side
stream waits for the compute stream before its next collective, so such a block is
reused only after its collective finished.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class Streams:
    """The side streams of one device (none off CUDA: both contexts do nothing)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.gather = torch.cuda.Stream(device, priority=-1)
            self.reduce = torch.cuda.Stream(device, priority=-1)

    @contextlib.contextmanager
    def _on(self, stream) -> Iterator[None]:
        if not self.cuda:
            yield
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield

    def gathering(self) -> contextlib.AbstractContextManager[None]:
        """Issue an all-gather: after the compute queued so far, beside what comes next."""
        return self._on(self.gather) if self.cuda else contextlib.nullcontext()

    def reducing(self) -> contextlib.AbstractContextManager[None]:
        """Issue a gradient reduction: after the gradients queued so far."""
        return self._on(self.reduce) if self.cuda else contextlib.nullcontext()


_STREAMS: dict[torch.device, Streams] = {}


def streams_for(device: torch.device) -> Streams:
    """The side streams of `device`, shared by every unit on it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _STREAMS:
        _STREAMS[device] = Streams(device)
    return _STREAMS[device]
