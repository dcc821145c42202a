"""Communication seen from the training thread: time blocked in collectives, bytes moved.

    meter = CommMeter().install()     # once per process, before the timed work
    ...                               # any mix of torch.distributed, FSDP2, DTensor, vescale_optim
    meter.take()                      # {"exposed_s": ..., "calls": {kind: n}, "sent": {kind: bytes}}

Exposed time is the wall time the calling thread spends inside a collective call (issuing
an asynchronous one, or all of a synchronous one) or waiting for one (`Work.wait()`, the
functional collectives' `wait_tensor`, which DTensor uses). A collective that runs on
gloo's threads while the caller computes costs nothing here: that part is overlapped.
Calls nested in a measured call count once, as the outer one.

`sent` is what this rank sends, averaged over ranks, under a bandwidth-optimal algorithm
on a world of W: all-gather and reduce-scatter (W-1)/W of the full buffer, all-reduce
2(W-1)/W, broadcast (W-1)/W (pipelined), all-to-all what leaves the rank. Kinds are what
the caller asked for; gloo runs some of them as others (its reduce-scatter is an
all-reduce), which only the caller's choice of kind shows.

The wrapped entry points: the public collectives of `torch.distributed` (module attributes,
looked up at call time by FSDP2 and `vescale_optim`), `torch.distributed.Work.wait`, and
the functional collectives' issue and wait functions (module attributes of
`torch.distributed._functional_collectives`, which DTensor calls; a name that moved is
skipped). All collectives are assumed to run on the default group.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["CommMeter"]


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


def _all_to_all(args, kwargs, w: int, in_i: int, splits_i: int) -> int:
    """Bytes leaving this rank: its input minus the part it keeps."""
    inp = _arg(args, kwargs, in_i, "input", "self")
    splits = _arg(args, kwargs, splits_i, "input_split_sizes")
    total = _nbytes(inp)
    if not splits:
        return total * (w - 1) // w
    own = splits[dist.get_rank()] if len(splits) == w else 0
    return total - total * own // max(1, sum(splits))


def _ring(i: int, *names: str, factor: float = 1.0, per_rank: bool = False) -> Callable:
    """Bytes sent for a tensor argument: `factor * (W-1)/W` of it, or `(W-1)` times it
    when it is one rank's piece (`per_rank`)."""

    def size(args, kwargs, w: int) -> int:
        n = _nbytes(_arg(args, kwargs, i, *names))
        return int(n * (w - 1) if per_rank else factor * n * (w - 1) / w)

    return size


def _nothing(args, kwargs, w: int) -> int:
    return 0


# name -> (kind, bytes sent); dist.* first, then the functional collectives.
_DIST: dict[str, tuple[str, Callable]] = {
    "broadcast": ("broadcast", _ring(0, "tensor")),
    "all_reduce": ("all-reduce", _ring(0, "tensor", factor=2)),
    "all_gather": ("all-gather", _ring(1, "tensor", per_rank=True)),
    "all_gather_into_tensor": ("all-gather", _ring(1, "input_tensor", per_rank=True)),
    "all_gather_single": ("all-gather", _ring(1, "input_tensor", "input", per_rank=True)),
    "reduce_scatter": ("reduce-scatter", _ring(0, "output", per_rank=True)),
    "reduce_scatter_tensor": ("reduce-scatter", _ring(0, "output", per_rank=True)),
    "reduce_scatter_single": ("reduce-scatter", _ring(0, "output_tensor", "output", per_rank=True)),
    "all_to_all_single": ("all-to-all", lambda a, k, w: _all_to_all(a, k, w, 1, 3)),
    "all_gather_object": ("object", _nothing),
    "broadcast_object_list": ("object", _nothing),
    "barrier": ("barrier", _nothing),
}
_FUNCOL: dict[str, tuple[str, Callable | None]] = {
    "broadcast": ("broadcast", _ring(0, "self")),
    "all_reduce": ("all-reduce", _ring(0, "self", factor=2)),
    "all_gather_single": ("all-gather", _ring(0, "self", per_rank=True)),
    "all_gather_tensor": ("all-gather", _ring(0, "self", per_rank=True)),
    "reduce_scatter_single": ("reduce-scatter", _ring(0, "self")),
    "reduce_scatter_tensor": ("reduce-scatter", _ring(0, "self")),
    "all_to_all_single": ("all-to-all", lambda a, k, w: _all_to_all(a, k, w, 0, 2)),
    "wait_tensor": ("wait", None),
}


class CommMeter:
    """Times and sizes the collectives called on this process (see the module's docstring)."""

    def __init__(self):
        self._local = threading.local()
        self.exposed_s = 0.0
        self.calls: Counter = Counter()
        self.sent: Counter = Counter()
        self.barrier = dist.barrier  # the benchmark's own barrier, not measured

    def _wrap(self, kind: str, size: Callable | None, fn: Callable) -> Callable:
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
                    self.calls[kind] += 1
                    if dist.is_initialized():
                        self.sent[kind] += size(args, kwargs, dist.get_world_size())

        measured.__wrapped__ = fn
        return measured

    def install(self) -> CommMeter:
        for name, (kind, size) in _DIST.items():
            setattr(dist, name, self._wrap(kind, size, getattr(dist, name)))
        dist.Work.wait = self._wrap("wait", None, dist.Work.wait)
        try:
            import torch.distributed._functional_collectives as funcol
        except ImportError:
            return self
        for name, (kind, size) in _FUNCOL.items():
            if hasattr(funcol, name):
                setattr(funcol, name, self._wrap(kind, size, getattr(funcol, name)))
        return self

    def take(self) -> dict:
        """What was measured since the last `take()`, and start again."""
        out = {"exposed_s": self.exposed_s, "calls": dict(self.calls), "sent": dict(self.sent)}
        self.exposed_s = 0.0
        self.calls.clear()
        self.sent.clear()
        return out
