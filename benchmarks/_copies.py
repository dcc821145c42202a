"""Copies counted by the torch profiler, for the benchmarks that claim to make none.

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as prof:
        with record_function("bench::all_gather"):
            ...
    count_copies(prof, ["bench::all_gather"])        # per region: ours vs torch.distributed's
    copies_by_path(prof, "bench::step", classify)    # every copy of a window, by where it ran

A copy is an *outermost* copy op (`COPY_OPS`: an `aten::copy_` inside `aten::clone` counts
once, as `aten::clone`) that writes more than one element. Its size is what it writes
(`written`). It ran *in c10d* when it sits under a `c10d::` op or a functional collective,
in a `distributed_c10d.py` frame (e.g. `work.wait()`), or on another thread than the
window's (gloo's workers): gloo builds some collectives from ATen ops, NCCL does not.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

_ATEN = ("copy_", "_foreach_copy_", "clone", "_to_copy", "contiguous", "cat", "stack", "_chunk_cat")
_ATEN += ("chunk_cat", "split_with_sizes_copy", "narrow_copy", "index_select")
_FSDP = ("all_gather_copy_in", "split_with_sizes_copy", "chunk_cat")  # FSDP2's own copy ops
COPY_OPS = frozenset([*(f"aten::{op}" for op in _ATEN), *(f"fsdp::{op}" for op in _FSDP)])
_C10D_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::")


def _numel(shape) -> int:
    """Elements of a recorded input: a shape, or a list of shapes for a tensor list."""
    if not shape:
        return 1 if shape == [] else 0
    if isinstance(shape[0], list | tuple):
        return sum(_numel(s) for s in shape)
    n = 1
    for d in shape:
        n *= int(d)
    return n


_LIST_OPS = {f"aten::{op}" for op in ("_foreach_copy_", "cat", "stack", "_chunk_cat", "chunk_cat")}
_LIST_OPS = frozenset({*_LIST_OPS, "fsdp::all_gather_copy_in", "fsdp::chunk_cat"})


def written(e) -> int:
    """Elements a copy op writes. Its first input is the destination (`copy_`) or a source
    of the same size (`clone`, `split_with_sizes_copy`, FSDP2's copy-out); the profiler
    records no shapes for tensor lists, so ops taking one are sized by the copies nested in
    them (`_foreach_copy_`, FSDP2's copy-in) or by their largest tensor argument, the `out=`
    buffer (FSDP2's `chunk_cat`)."""
    shapes = list(getattr(e, "input_shapes", None) or [])
    if e.name not in _LIST_OPS:
        return _numel(shapes[0]) if shapes else 0
    nested, stack = 0, list(e.cpu_children)
    while stack:
        child = stack.pop()
        if child.name == "aten::copy_":
            nested += _numel((child.input_shapes or [[]])[0])
        else:
            stack.extend(child.cpu_children)
    if nested:
        return nested
    return max((_numel(s) for s in shapes[1:] if s and not isinstance(s[0], list | tuple)), default=0)


def ancestors(e):
    """The events enclosing `e`, innermost first (with `with_stack`, Python frames too)."""
    parent = e.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def in_c10d(e, main_thread: int) -> bool:
    if e.thread != main_thread:
        return True
    frame = "torch/distributed/distributed_c10d.py"
    return any(a.name.startswith(_C10D_PREFIXES) or frame in a.name for a in ancestors(e))


def outermost_copies(events) -> list:
    """The copy events not nested in another copy, that write more than one element."""
    return [
        e
        for e in events
        if e.name in COPY_OPS and not any(a.name in COPY_OPS for a in ancestors(e)) and written(e) > 1
    ]


def count_copies(prof, regions: list[str]) -> dict[str, dict]:
    """Outermost copy ops inside each `record_function(region)` window, split into the
    framework's and those made inside torch.distributed."""
    events = list(prof.events())
    windows = {}
    for e in events:
        if e.name in regions:
            windows[e.name] = (e.time_range.start, e.time_range.end, e.thread)
    counts = ("copies", "elements", "c10d_copies", "c10d_elements")
    out = {r: {**dict.fromkeys(counts, 0), "events": Counter()} for r in regions}
    for e in outermost_copies(events):
        n = written(e)
        for region, (start, end, thread) in windows.items():
            if not start <= e.time_range.start < end:
                continue
            where = "c10d" if in_c10d(e, thread) else "framework"
            bucket = out[region]
            bucket["c10d_copies" if where == "c10d" else "copies"] += 1
            bucket["c10d_elements" if where == "c10d" else "elements"] += n
            bucket["events"][f"{where}: {e.name} x {n}"] += 1
    for region in out.values():
        region["events"] = dict(sorted(region["events"].items()))
    return out


def copies_by_path(prof, window: str, classify: Callable[[object, list[str]], str]) -> dict[str, dict]:
    """Every outermost copy inside the `record_function(window)` windows, grouped by
    `classify(event, context)`, where `context` names what encloses the copy: its
    ancestors' names (regions, ops, Python frames) and its recorded Python stack. Copies
    in c10d (see the module's docstring) are grouped as "c10d" before `classify` is asked."""
    events = list(prof.events())
    windows = [(e.time_range.start, e.time_range.end, e.thread) for e in events if e.name == window]
    out: dict[str, dict] = {}
    for e in outermost_copies(events):
        hit = next((w for w in windows if w[0] <= e.time_range.start < w[1]), None)
        if hit is None:
            continue
        context = [a.name for a in ancestors(e)] + list(getattr(e, "stack", None) or [])
        path = "c10d" if in_c10d(e, hit[2]) else classify(e, context)
        n = written(e)
        group = out.setdefault(path, {"copies": 0, "elements": 0, "events": Counter()})
        group["copies"] += 1
        group["elements"] += n
        group["events"][f"{e.name} x {n}"] += 1
    for group in out.values():
        group["events"] = dict(sorted(group["events"].items()))
    return out
