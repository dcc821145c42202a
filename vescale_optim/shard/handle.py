"""How this library's collectives are issued and waited for: `Op` (what a collective is,
for errors), `Handle` (waiting, bounded by `set_collective_timeout`), and `issue`; and the
one door every `torch.distributed` call of the library goes through.

The door, by kind of call (`tests/test_one_door.py` checks that no other module calls
torch.distributed):

- collectives on tensors: `issue(op, call)`, where `call` makes the asynchronous
  `torch.distributed` call (`shard.collectives` builds them; nothing else does);
- calls on Python objects: `all_gather_object` (synchronous);
- groups: `new_group` and `split_group` (called by `shard.groups`, which makes every group
  of part of a world), `duplicate_group` (a second communicator over a group's ranks), and the
  queries `initialized`, `group_rank`, `group_size`, `group_backend`, `global_rank`,
  `default_group` and `bound_device`.

What other modules may still name, and why it is not a call through a back door: the types
`ProcessGroup` and `DeviceMesh` (isinstance checks and annotations); DCP
(`torch.distributed.checkpoint`, the checkpoint format, its save and load coordinating the
group they are given by themselves) in `checkpoint/` and `shard/dcp.py`; and the setup of a
user's process group (`init_process_group`, `destroy_process_group`, the stores) in
`distributed.py`, `local_world.py` and `demo/launch.py`, which make the group this library
then uses.

Debugging aids work at that door, for tests above all (`shard.emulation`, exported here):
`delayed()` emulates an asynchronous device on gloo (a collective, or its `local_copy` in a group
of one, runs only when waited for), `traced()` lists the collectives issued (and with
`waits=True` the handles waited for) in order, and `before_issue(callback)` runs a callback
before each issue.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .emulation import (
    Delays,
    announce,
    before_issue,
    delayed,
    local_copy,
    note_wait,
    run_delayed,
    submit,
    traced,
)
from .emulation import before_synchronous as _before_synchronous

__all__ = [
    "CollectiveError",
    "Delays",
    "Group",
    "Handle",
    "Op",
    "all_gather_object",
    "before_issue",
    "before_synchronous",
    "default_group",
    "delayed",
    "duplicate_group",
    "get_collective_timeout",
    "global_rank",
    "group_backend",
    "group_rank",
    "group_size",
    "initialized",
    "issue",
    "new_group",
    "run_delayed",
    "set_collective_timeout",
    "local_copy",
    "traced",
]

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
        if self._op is not None:
            note_wait(self._op.kind, self._op.what or "a tensor")
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


def issue(op: Op, call: Callable[[], object]) -> object:
    """Issue one collective: `call()` makes the `torch.distributed` call (async) and returns
    its work; inside `delayed()` it is queued instead. Every collective of the shard layer
    comes through here, so the order of issue is the order recorded by `traced()`."""
    announce(op.kind, op.what or "a tensor")
    return submit(call)


def before_synchronous(op: Op) -> None:
    """A synchronous collective `op` is about to run outside `issue` (`all_gather_object`):
    trace it, and run whatever is queued first, so that every rank keeps one order."""
    _before_synchronous(op.kind, op.what or "a tensor")


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


def duplicate_group(group: ProcessGroup | None = None) -> ProcessGroup | None:
    """A second process group over `group`'s ranks (the default group when None), made by
    every rank of `group` at the same call and by no other: on NCCL a communicator of its
    own, whose collectives run beside `group`'s instead of queueing behind them.

    With the default group bound to a device (`init_process_group(device_id=...)`, as
    `vo.init_distributed` binds it) torch builds a new NCCL group by splitting a parent's
    communicator, which every rank of that parent must join: the copy is split from `group`
    itself (`split_group`, one split of all of its ranks). Unbound, a copy of the whole world
    is a `new_group` every rank makes; a copy of a smaller group is None (no rule makes one
    safely: `new_group` wants every rank of the world, and made by the members alone its
    name counts groups each member made, which may differ, and it hangs)."""
    parent = group if group is not None else dist.group.WORLD
    backend = str(dist.get_backend(parent))
    if bound_device() is not None and "nccl" in backend:
        return split_group(parent, [range(dist.get_world_size(parent))])
    if dist.get_world_size(parent) == dist.get_world_size():
        return dist.new_group(None, backend=backend)
    return None


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
