"""Communication seen from the training thread: time blocked in collectives, bytes moved.

    meter = CommMeter().install()     # once per process, before the timed work
    meter.replica_of = {0: 0, 1: 0, 2: 1, 3: 1}   # optional: world rank -> replica (HSDP)
    ...                               # any mix of torch.distributed, FSDP2, DTensor, vescale_optim
    meter.take()                      # {"exposed_s", "calls": {kind: n}, "sent": {kind: bytes},
                                      #  "sent_where": {where: bytes}, "sent_by": {"where kind": bytes}}

Exposed time is the wall time the calling thread spends inside a collective call (issuing an
asynchronous one, or all of a synchronous one) or waiting for one (`Work.wait()`, the functional
collectives' `wait_tensor`); a collective gloo runs on its threads while the caller computes costs
nothing here. Calls nested in a measured call count once, as the outer one.

`sent` is what this rank sends, averaged over the ranks of the call's group (of n), under a
bandwidth-optimal algorithm: all-gather and reduce-scatter (n-1)/n of the full buffer, all-reduce
2(n-1)/n, broadcast (n-1)/n, all-to-all what leaves the rank; kinds are what the caller asked for
(gloo runs some as others). `where` places the bytes on a replicate x shard layout (`replica_of`):
`inside` the rank's replica, `across` replicas, `mixed` (a group spanning both: not guessed),
`unknown` (a group given by name); an all-to-all is split peer by peer.

Wrapped: the public collectives of `torch.distributed` (module attributes, looked up at call time
by FSDP2 and `vescale_optim`), `Work.wait`, and the functional collectives' issue and wait
functions (`torch.distributed._functional_collectives`, which DTensor calls: torch-private, the one
private surface a benchmark touches, since nothing public sees DTensor's collectives without
slowing every op; a name that moved fails `install()`). A collective issued below these is not seen.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, list | tuple):
        return sum(_nbytes(x) for x in t)
    return 0


def _arg(args, kwargs, i: int, *names: str):
    for n in names:
        if n in kwargs:
            return kwargs[n]
    return args[i] if len(args) > i else None


def group_ranks(group) -> list[int] | None:
    """World ranks of a collective's `group` argument: a process group, `None` (the
    default group), a `(DeviceMesh, dim)` pair, a 1-D `DeviceMesh` or a list of ranks;
    `None` for a group given by name."""
    from torch.distributed.device_mesh import DeviceMesh

    if group is None:
        return list(range(dist.get_world_size()))
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        group = group[0].get_group(group[1])
    elif isinstance(group, DeviceMesh):
        group = group.get_group()
    if isinstance(group, dist.ProcessGroup):
        return dist.get_process_group_ranks(group)
    if isinstance(group, list | tuple) and all(isinstance(r, int) for r in group):
        return list(group)
    return None


def _all_to_all(in_i: int, splits_i: int) -> Callable:
    """Bytes leaving this rank, by the group rank they go to."""

    def size(args, kwargs, n: int, me: int) -> dict[int, int]:
        total = _nbytes(_arg(args, kwargs, in_i, "input", "self"))
        splits = _arg(args, kwargs, splits_i, "input_split_sizes")
        if not splits or len(splits) != n:
            splits = [1] * n
        whole = max(1, sum(splits))
        return {i: total * s // whole for i, s in enumerate(splits) if i != me and s}

    return size


def _ring(i: int, *names: str, factor: float = 1.0, per_rank: bool = False) -> Callable:
    """Bytes sent for a tensor argument: `factor * (n-1)/n` of it, or `(n-1)` times it
    when it is one rank's piece (`per_rank`); to the group as a whole (`None`)."""

    def size(args, kwargs, n: int, me: int) -> dict[int | None, int]:
        b = _nbytes(_arg(args, kwargs, i, *names))
        return {None: int(b * (n - 1) if per_rank else factor * b * (n - 1) / n)}

    return size


def _nothing(args, kwargs, n: int, me: int) -> dict:
    return {}


# name -> (kind, bytes sent, position of the group argument); dist.* first, then the
# functional collectives.
_DIST: dict[str, tuple[str, Callable, int]] = {
    "broadcast": ("broadcast", _ring(0, "tensor"), 2),
    "all_reduce": ("all-reduce", _ring(0, "tensor", factor=2), 2),
    "all_gather": ("all-gather", _ring(1, "tensor", per_rank=True), 2),
    "all_gather_into_tensor": ("all-gather", _ring(1, "input_tensor", per_rank=True), 2),
    "all_gather_single": ("all-gather", _ring(1, "input_tensor", "input", per_rank=True), 2),
    "reduce_scatter": ("reduce-scatter", _ring(0, "output", per_rank=True), 3),
    "reduce_scatter_tensor": ("reduce-scatter", _ring(0, "output", per_rank=True), 3),
    "reduce_scatter_single": ("reduce-scatter", _ring(0, "output_tensor", "output", per_rank=True), 3),
    "all_to_all_single": ("all-to-all", _all_to_all(1, 3), 4),
    "all_gather_object": ("object", _nothing, 2),
    "broadcast_object_list": ("object", _nothing, 2),
    "barrier": ("barrier", _nothing, 0),
}
_FUNCOL: dict[str, tuple[str, Callable | None, int]] = {
    "broadcast": ("broadcast", _ring(0, "self"), 2),
    "all_reduce": ("all-reduce", _ring(0, "self", factor=2), 2),
    "all_gather_single": ("all-gather", _ring(0, "self", per_rank=True), 2),
    "all_gather_tensor": ("all-gather", _ring(0, "self", per_rank=True), 2),
    "reduce_scatter_single": ("reduce-scatter", _ring(0, "self"), 3),
    "reduce_scatter_tensor": ("reduce-scatter", _ring(0, "self"), 3),
    "all_to_all_single": ("all-to-all", _all_to_all(0, 2), 3),
    "wait_tensor": ("wait", None, -1),
}


class CommMeter:
    """Times and sizes the collectives called on this process (see the module's docstring)."""

    def __init__(self):
        self._local = threading.local()
        self.exposed_s = 0.0
        self.calls: Counter = Counter()
        self.sent: Counter = Counter()
        self.sent_where: Counter = Counter()
        self.sent_by: Counter = Counter()
        self.replica_of: dict[int, int] | None = None
        self.barrier = dist.barrier  # the benchmark's own barrier, not measured

    def _where(self, ranks: list[int] | None, peer: int | None) -> str:
        """`inside`, `across`, `mixed` or `unknown` (see the module's docstring)."""
        if ranks is None:
            return "unknown"
        if self.replica_of is None:
            return "inside"
        me = self.replica_of[dist.get_rank()]
        among = [ranks[peer]] if peer is not None else ranks
        others = [self.replica_of[r] for r in among if r != dist.get_rank()]
        if all(r == me for r in others):
            return "inside"
        return "across" if all(r != me for r in others) else "mixed"

    def _count(self, kind: str, size: Callable, group_i: int, args, kwargs) -> None:
        self.calls[kind] += 1
        if not dist.is_initialized():
            return
        group = kwargs["group"] if "group" in kwargs else (args[group_i] if len(args) > group_i else None)
        ranks = group_ranks(group)
        n = len(ranks) if ranks is not None else dist.get_world_size()
        me = ranks.index(dist.get_rank()) if ranks is not None and dist.get_rank() in ranks else -1
        for peer, b in size(args, kwargs, n, me).items():
            where = self._where(ranks, peer)
            self.sent[kind] += b
            self.sent_where[where] += b
            self.sent_by[f"{where} {kind}"] += b

    def _wrap(self, kind: str, size: Callable | None, group_i: int, fn: Callable) -> Callable:
        local = self._local

        def measured(*args, **kwargs):
            depth = getattr(local, "depth", 0)
            if depth:
                return fn(*args, **kwargs)
            local.depth = 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.exposed_s += time.perf_counter() - t0
                local.depth = 0
                if size is not None:
                    self._count(kind, size, group_i, args, kwargs)

        measured.__wrapped__ = fn
        return measured

    def install(self) -> CommMeter:
        for name, (kind, size, group_i) in _DIST.items():
            setattr(dist, name, self._wrap(kind, size, group_i, getattr(dist, name)))
        dist.Work.wait = self._wrap("wait", None, -1, dist.Work.wait)
        # torch's functional collectives, what DTensor calls: no public hook sees them at this cost (the
        # profiler and dispatch modes slow every op), so their module attributes are wrapped; a name
        # that moved fails here rather than leaving DTensor's traffic uncounted.
        import torch.distributed._functional_collectives as funcol

        missing = [name for name in _FUNCOL if not hasattr(funcol, name)]
        if missing:
            raise RuntimeError(f"torch's functional collectives lack {missing}: CommMeter must follow them")
        for name, (kind, size, group_i) in _FUNCOL.items():
            setattr(funcol, name, self._wrap(kind, size, group_i, getattr(funcol, name)))
        return self

    def take(self) -> dict:
        """What was measured since the last `take()`, and start again."""
        out = {"exposed_s": self.exposed_s, "calls": dict(self.calls), "sent": dict(self.sent)}
        out.update(sent_where=dict(self.sent_where), sent_by=dict(self.sent_by))
        self.exposed_s = 0.0
        for c in (self.calls, self.sent, self.sent_where, self.sent_by):
            c.clear()
        return out
