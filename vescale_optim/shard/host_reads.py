"""Reads of tensor values on the host, counted: a debugging aid for tests and the GPU check.

On a GPU, reading a device tensor's value on the host (`.item()`, `.tolist()`, `bool(t)`,
`int(t)`, `.nonzero()`, ...) waits for the device: a host sync, which the library allows only
where it documents one (ARCHITECTURE.md: one per backward on a group that talks, one per
step). `host_reads()` records every such read made inside it, on any device and in autograd's
hooks too, so a CPU run shows where a GPU run would synchronise (an upper bound: on a GPU,
reading a CPU tensor costs nothing), and tests can count them. CUDA's own count is
`torch.cuda.set_sync_debug_mode`.

The reads are seen by wrapping those methods on `torch.Tensor` for the time of the block (a
`TorchFunctionMode` would miss backward's hooks, which autograd runs without the Python
modes); a read that dispatches to a tensor subclass and back is counted once.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

# the tensor methods that hand a value to the host (or size a result by one: nonzero)
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "nonzero")
_PACKAGE = str(Path(__file__).resolve().parents[1])
_depth = threading.local()


def _where() -> str:
    """The innermost frame of this package that made the read (or the caller's, outside it)."""
    frames = [f for f in traceback.extract_stack()[:-2] if f.filename != __file__]
    outside_torch = [f for f in frames if "torch" not in Path(f.filename).parts]
    ours = [f for f in outside_torch if f.filename.startswith(_PACKAGE)]
    frame = (ours or outside_torch or [None])[-1]
    return f"{Path(frame.filename).name}:{frame.lineno}" if frame is not None else "?"


def _counted(name: str, method: Callable, found: list[str]) -> Callable:
    def read(self, *args, **kwargs):
        depth = getattr(_depth, "n", 0)
        if depth == 0:
            found.append(f"{name} at {_where()}")
        _depth.n = depth + 1
        try:
            return method(self, *args, **kwargs)
        finally:
            _depth.n = depth

    return read


@contextlib.contextmanager
def host_reads() -> Iterator[list[str]]:
    """The reads of tensor values made inside, in order, as `"item at module.py:line"`
    strings (the library's innermost frame that read, or the caller's)."""
    found: list[str] = []
    own = {name: torch.Tensor.__dict__.get(name) for name in READS}
    for name in READS:
        setattr(torch.Tensor, name, _counted(name, getattr(torch.Tensor, name), found))
    try:
        yield found
    finally:
        for name, method in own.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)
