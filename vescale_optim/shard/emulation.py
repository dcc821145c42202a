"""Debugging aids at the door of `torch.distributed` (`shard.handle`), for tests above all.
Nothing here calls torch.distributed: the door hands its calls and waits over (`announce`,
`submit`, `note_wait`), and `shard.handle` exports every aid under its own name.

- `delayed()`: emulate an asynchronous device on gloo. Every collective issued inside is
  queued and only runs when it (or a later one) is waited for, in issue order on every
  rank. Until then its outputs hold their old values and its inputs are read only later,
  as a collective still in flight on a GPU: code that reads a result before waiting, or
  writes or frees an input before the collective is waited for, computes something else.
  It yields a `Delays`, whose `held_at_wait` counts the waits that found their collective
  still queued: evidence, for a test, that something was actually held back.
  A collective's local copy (`local_copy`: what a group of one does instead) is
  held back the same way, its outputs garbled until it runs: a result read before its
  handle is waited for is wrong, as on a GPU where the copy ran on a side stream.
- `traced()`: the list of the collectives issued inside, in issue order (kind and
  purpose): the sequence every rank must issue the same; with `waits=True` each first
  wait for a collective's handle too (`"waited: kind: purpose"`), in the host's order —
  on a GPU the order in which the compute stream is told to wait.
- `before_issue(callback)`: `callback(kind)` runs on the host just before each collective
  or local copy is issued, with the stream it is issued from current (the GPU check queues a
  device sleep there to delay every collective).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch


class _Delayed:
    """A collective that runs when waited for (see `delayed`)."""

    def __init__(self, call: Callable[[], object]):
        self.call, self.work = call, None

    def start(self) -> object:
        if self.work is None:
            self.work = self.call()
        return self.work

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self.work is None:
            for delays in _delays:
                delays.held_at_wait += 1
        run_delayed(until=self)
        work = self.work
        return work.wait() if timeout is None else work.wait(timeout)


class Delays:
    """What a `delayed()` block held back: `held_at_wait`, the collectives that had not run
    yet when they were waited for (a wait had to release them)."""

    def __init__(self) -> None:
        self.held_at_wait = 0


_queue: list[_Delayed] = []
_delaying = 0
_delays: list[Delays] = []
_trace: list[list[str]] = []
_wait_trace: list[list[str]] = []
_hooks: list[Callable[[str], None]] = []


class _LocalCopy:
    """The work of a collective's local copy, already issued on the stream that was current:
    waiting orders the waiting stream after it (a CUDA event; nothing to order elsewhere)."""

    def __init__(self, device: torch.device):
        self.event = None
        if device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(device))
        self.device = device

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self.event is not None:
            self.event.wait(torch.cuda.current_stream(self.device))
        return True


def _garble(t: torch.Tensor) -> None:
    """Make `t` hold what unwritten memory might: NaN, or its bits flipped."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.logical_not_()
    else:
        t.bitwise_not_()


def _freed(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() < (t.storage_offset() + t.numel()) * t.element_size()


def local_copy(
    run: Callable[[], None], device: torch.device, outputs: tuple[torch.Tensor, ...] = (), garble: bool = True
) -> object:
    """Issue the local copy that replaces a collective on a group of one (`run()` writes
    `outputs`) on the current stream, which may be a side stream, and return its work: like
    a collective's, its results may be read only once it is waited for (`Handle(work)`),
    which orders the waiting stream after it. Inside `delayed()` it is queued like a
    collective, `outputs` are garbled until it runs (with `garble`: not when `run` reads
    them too), and one freed before it ran is an error. Not traced: nothing is sent."""
    for hook in _hooks:
        hook("local copy")

    def call() -> _LocalCopy:
        if any(_freed(out) for out in outputs):
            raise RuntimeError(
                "the output of a collective's local copy was freed before the copy was "
                "waited for (it would write freed memory on a GPU)"
            )
        run()
        return _LocalCopy(device)

    if _delaying and garble:  # queued: its outputs read as garbage until it runs
        for out in outputs:
            _garble(out)
    return submit(call)


def announce(kind: str, what: str) -> None:
    """A collective `kind` of `what` is about to be issued: trace it, run the callbacks."""
    for trace in _trace:
        trace.append(f"{kind}: {what}")
    for hook in _hooks:
        hook(kind)


def submit(call: Callable[[], object]) -> object:
    """`call()`'s work now, or inside `delayed()` queued until waited for."""
    if not _delaying:
        run_delayed()
        return call()
    pending = _Delayed(call)
    _queue.append(pending)
    return pending


def note_wait(kind: str, what: str) -> None:
    """A collective's handle is waited for (the first time): traced with `waits=True`."""
    for trace in _wait_trace:
        trace.append(f"waited: {kind}: {what}")


def before_synchronous(kind: str, what: str) -> None:
    """A synchronous collective is about to run outside `issue` (`all_gather_object`):
    trace it, and run whatever is queued first, so that every rank keeps one order."""
    for trace in _trace:
        trace.append(f"{kind}: {what}")
    run_delayed()


def run_delayed(until: _Delayed | None = None) -> None:
    """Run the queued collectives in issue order (up to `until` included). A synchronous
    call outside this module (`all_gather_object`) runs what is queued first."""
    while _queue:
        pending = _queue.pop(0)
        pending.start()
        if pending is until:
            return


@contextlib.contextmanager
def delayed() -> Iterator[Delays]:
    """Collectives issued inside run only when waited for: an asynchronous device,
    emulated (every rank must use it for the same calls). Whatever is still queued
    runs on the way out. Yields a `Delays` counting what was held back."""
    global _delaying
    delays = Delays()
    _delaying += 1
    _delays.append(delays)
    try:
        yield delays
    finally:
        _delays.remove(delays)
        _delaying -= 1
        if not _delaying:
            run_delayed()


@contextlib.contextmanager
def traced(into: list | None = None, waits: bool = False) -> Iterator[list]:
    """The collectives issued inside, in order, as `"kind: purpose"` strings, appended to
    `into` (a new list by default: pass one to interleave other events with them); with
    `waits`, each collective's first wait as well, as `"waited: kind: purpose"`."""
    trace = [] if into is None else into
    _trace.append(trace)
    if waits:
        _wait_trace.append(trace)
    try:
        yield trace
    finally:
        _trace.remove(trace)
        if waits:
            _wait_trace.remove(trace)


@contextlib.contextmanager
def before_issue(callback: Callable[[str], None]) -> Iterator[None]:
    """Inside, `callback(kind)` runs just before each collective (its kind, e.g.
    `"all-gather"`) or local copy (`"local copy"`) is issued, on the host, with the stream it
    is issued from current: a debugging aid (the GPU check delays every collective by
    queueing a device sleep there)."""
    _hooks.append(callback)
    try:
        yield
    finally:
        _hooks.remove(callback)
