"""How this library's collectives are issued and waited for: `Op` (what a collective is,
for errors), `Handle` (waiting, bounded by `set_collective_timeout`), and `issue`; and the
one door every `torch.distributed` call of the library goes through.

The door, by kind of call (`tests/test_one_door.py` checks that no other module calls
torch.distributed):

- collectives on tensors: `issue(op, call)`, where `call` makes the asynchronous
  `torch.distributed` call (`shard.collectives` builds them; nothing else does);
- calls on Python objects: `all_gather_object` (synchronous);
- groups: `new_group` and `split_group` (called by `shard.groups`, which makes every group
  of part of a world), and the queries `initialized`, `group_rank`, `group_size`,
  `group_backend`, `global_rank`, `default_group` and `bound_device`.

What other modules may still name, and why it is not a call through a back door: the types
`ProcessGroup` and `DeviceMesh` (isinstance checks and annotations); DCP
(`torch.distributed.checkpoint`, the checkpoint format, its save and load coordinating the
group they are given by themselves) in `checkpoint/` and `shard/dcp.py`; and the setup of a
user's process group (`init_process_group`, `destroy_process_group`, the stores) in
`distributed.py`, `local_world.py` and `demo/launch.py`, which make the group this library
then uses.

Two debugging aids work at that door, for tests above all:

- `delayed()`: emulate an asynchronous device on gloo. Every collective issued inside is
  queued and only runs when it (or a later one) is waited for, in issue order on every
  rank. Until then its outputs hold their old values and its inputs are read only later,
  as a collective still in flight on a GPU: code that reads a result before waiting, or
  writes or frees an input before the collective is waited for, computes something else.
  It yields a `Delays`, whose `held_at_wait` counts the waits that found their collective
  still queued: evidence, for a test, that something was actually held back.
  A collective's stand-in (`stand_in`: the local copy a group of one makes instead) is
  held back the same way, its outputs garbled until it runs: a result read before its
  handle is waited for is wrong, as on a GPU where the stand-in ran on a side stream.
- `traced()`: the list of the collectives issued inside, in issue order (kind and
  purpose): the sequence every rank must issue the same.
- `before_issue(callback)`: `callback(kind)` runs on the host just before each collective
  or stand-in is issued, with the stream it is issued from current (the GPU check queues a
  device sleep there to delay every collective).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

_timeout: timedelta | None = None


class CollectiveError(RuntimeError):
    """A collective of this library failed or timed out on this rank: another rank died,
    or did not make the same call in time. The process group is unusable afterwards."""


def set_collective_timeout(timeout: float | timedelta | None) -> None:
    """Bound every wait of this library's collectives to `timeout` (seconds or a
    `timedelta`); None (the default) leaves it to the process group's own `timeout=`.

    A collective still waiting then raises `CollectiveError` naming it. On NCCL a bounded
    wait blocks the host until the collective finishes (the unbounded one only orders the
    streams), so prefer the process group's timeout there outside of debugging.
    """
    global _timeout
    if timeout is not None:
        timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
        if timeout.total_seconds() <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
    _timeout = timeout


def get_collective_timeout() -> timedelta | None:
    """The bound `set_collective_timeout` set, or None for the process groups' own timeouts."""
    return _timeout


class Group(Protocol):
    """What an `Op` reads of its group (a `shard.comm.Comm`): its size and this rank in it."""

    rank: int
    world_size: int


class Op:
    """What a collective is, for error messages: kind, purpose, tensor and group."""

    def __init__(self, kind: str, what: str | None, tensor: torch.Tensor | None, comm: Group):
        self.kind, self.what, self.comm = kind, what, comm
        self.numel = tensor.numel() if tensor is not None else None
        self.dtype = tensor.dtype if tensor is not None else None

    def __str__(self) -> str:
        size = f"group of {self.comm.world_size} ranks"
        if self.numel is not None:
            size = f"{self.numel:,} {str(self.dtype).removeprefix('torch.')} elements, {size}"
        return f"{self.kind} of {self.what or 'a tensor'} ({size})"

    def error(self, cause: BaseException, timed_out: bool) -> CollectiveError:
        """The error to raise on this rank when the collective failed with `cause`."""
        when = f" within {_timeout.total_seconds():g} s (set_collective_timeout)" if timed_out else ""
        return CollectiveError(
            f"{self} did not complete on rank {self.comm.rank}{when}: {str(cause).strip()}\n"
            "Another rank died, or did not make this call: every rank of the group must make the "
            "same collective calls in the same order."
        )


class Handle:
    """Completion of one or more asynchronous collectives; `wait()` is idempotent and
    raises `CollectiveError` naming `op` if a collective fails or outlasts the timeout.

    There is deliberately no way to ask whether a collective has finished: on a GPU the
    host runs ahead and the answer is almost always no, so a decision taken on it would
    differ from gloo's (and from run to run). Waiting is the only question, asked at a
    fixed point; on NCCL it orders the current stream after the collective."""

    def __init__(self, work=None, finish: Callable[[], None] | None = None, op: Op | None = None):
        self._works = work if isinstance(work, list) else [work] if work is not None else []
        self._finish, self._done, self._op = finish, False, op

    def wait(self) -> None:
        if self._done:
            return
        deadline = None if _timeout is None else time.monotonic() + _timeout.total_seconds()
        for work in self._works:
            if isinstance(work, Handle):
                work.wait()
            else:
                self._wait(work, deadline)
        if self._finish is not None:
            self._finish()
        self._done = True

    def _wait(self, work, deadline: float | None) -> None:
        try:
            if deadline is None:
                work.wait()
            else:  # at least 1 ms: a zero timeout means "forever" to torch
                work.wait(timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
        except RuntimeError as e:
            if self._op is None:
                raise
            timed_out = deadline is not None and time.monotonic() >= deadline - 0.1
            raise self._op.error(e, timed_out) from e

    def then(self, finish: Callable[[], None]) -> Handle:
        """A handle that waits for this one, then runs `finish`."""
        return Handle([self], finish)


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
_hooks: list[Callable[[str], None]] = []


class _StandIn:
    """The work of a collective's stand-in, already issued on the stream that was current:
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


def stand_in(run: Callable[[], None], device: torch.device, outputs: tuple[torch.Tensor, ...] = (),
             garble: bool = True) -> object:  # fmt: skip
    """Issue what stands in for a collective on a group of one (`run()`: a local copy into
    `outputs`) on the current stream, which may be a side stream, and return its work: like
    a collective's, its results may be read only once it is waited for (`Handle(work)`),
    which orders the waiting stream after it. Inside `delayed()` it is queued like a
    collective, `outputs` are garbled until it runs (with `garble`: not when `run` reads
    them too), and one freed before it ran is an error. Not traced: nothing is sent."""
    for hook in _hooks:
        hook("stand-in")

    def call() -> _StandIn:
        if any(_freed(out) for out in outputs):
            raise RuntimeError("the output of a collective's stand-in was freed before the stand-in was "
                               "waited for (it would write freed memory on a GPU)")  # fmt: skip
        run()
        return _StandIn(device)

    if not _delaying:
        run_delayed()
        return call()
    for out in outputs if garble else ():
        _garble(out)
    pending = _Delayed(call)
    _queue.append(pending)
    return pending


def issue(op: Op, call: Callable[[], object]) -> object:
    """Issue one collective: `call()` makes the `torch.distributed` call (async) and returns
    its work; inside `delayed()` it is queued instead. Every collective of the shard layer
    comes through here, so the order of issue is the order recorded by `traced()`."""
    for trace in _trace:
        trace.append(f"{op.kind}: {op.what or 'a tensor'}")
    for hook in _hooks:
        hook(op.kind)
    if not _delaying:
        run_delayed()
        return call()
    pending = _Delayed(call)
    _queue.append(pending)
    return pending


def before_synchronous(op: Op) -> None:
    """A synchronous collective `op` is about to run outside `issue` (`all_gather_object`):
    trace it, and run whatever is queued first, so that every rank keeps one order."""
    for trace in _trace:
        trace.append(f"{op.kind}: {op.what or 'a tensor'}")
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
def traced(into: list | None = None) -> Iterator[list]:
    """The collectives issued inside, in order, as `"kind: purpose"` strings, appended to
    `into` (a new list by default: pass one to interleave other events with them)."""
    trace = [] if into is None else into
    _trace.append(trace)
    try:
        yield trace
    finally:
        _trace.remove(trace)


@contextlib.contextmanager
def before_issue(callback: Callable[[str], None]) -> Iterator[None]:
    """Inside, `callback(kind)` runs just before each collective (its kind, e.g.
    `"all-gather"`) or stand-in (`"stand-in"`) is issued, on the host, with the stream it
    is issued from current: a debugging aid (the GPU check delays every collective by
    queueing a device sleep there)."""
    _hooks.append(callback)
    try:
        yield
    finally:
        _hooks.remove(callback)


# --- the rest of torch.distributed this library calls -------------------------------------


def initialized() -> bool:
    """Whether this process has joined a default process group (False where torch was built
    without torch.distributed)."""
    return dist.is_available() and dist.is_initialized()


def group_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in `group` (the default group when None)."""
    return dist.get_rank(group)


def group_size(group: ProcessGroup | None = None) -> int:
    """The number of ranks of `group` (the default group when None)."""
    return dist.get_world_size(group)


def group_backend(group: ProcessGroup | None = None) -> str:
    """`group`'s backend as torch names it (`"gloo"`, `"nccl"`, `"cpu:gloo,cuda:nccl"`)."""
    return str(dist.get_backend(group))


def global_rank(group: ProcessGroup, rank: int) -> int:
    """The default group's rank of `group`'s `rank`."""
    return dist.get_global_rank(group, rank)


def default_group() -> ProcessGroup:
    """The default process group (the world)."""
    return dist.group.WORLD


def bound_device() -> torch.device | None:
    """The device the default group is bound to (`init_process_group(device_id=...)`, as
    `vo.init_distributed` binds it), or None."""
    return getattr(default_group(), "bound_device_id", None)


def new_group(ranks: Sequence[int] | None = None, **options) -> ProcessGroup | None:
    """A new process group of `ranks` (every rank when None; None on a rank outside them);
    `options` as torch's `new_group` takes them (`backend`, `timeout`,
    `use_local_synchronization`). Every rank of the world makes the same calls in one order
    (`shard.groups` says how a group of part of a world is made). Not a collective on
    tensors: not traced."""
    group = dist.new_group(None if ranks is None else list(ranks), **options)
    return group if isinstance(group, ProcessGroup) else None


def split_group(parent: ProcessGroup, ranks: Sequence[Sequence[int]]) -> ProcessGroup | None:
    """torch's `split_group`: groups of `parent`'s ranks `ranks` (lists of group ranks,
    disjoint) split from its communicator, every rank of `parent` taking part; this rank's
    group, or None on a rank in none of them."""
    return dist.split_group(parent_pg=parent, split_ranks=[list(g) for g in ranks])


def all_gather_object(obj: object, group: ProcessGroup | None = None, op: Op | None = None) -> list:
    """Every rank of `group`'s picklable `obj`, in rank order (synchronous: a host sync).

    With `op` the call is a collective of the traced order: it is traced, whatever
    `delayed()` holds back runs first (every rank keeps one order) and a failure raises
    `op`'s `CollectiveError`. Without one it is a plain exchange outside that order (a
    checkpoint's outcomes, possibly from a background thread; the demo's figures)."""
    out: list = [None] * group_size(group)
    if op is None:
        dist.all_gather_object(out, obj, group=group)
        return out
    before_synchronous(op)
    try:
        dist.all_gather_object(out, obj, group=group)
    except RuntimeError as e:
        raise op.error(e, False) from e
    return out
