"""Live tensor bytes over time, from the torch profiler's record of ATen's CPU allocator.

    tr, trace = live_steps(lambda: Trainer(...), pool, steps)   # built and trained under the recorder
    trace.summary()                   # live_peak, live_where, live_by, live_first, live_start, ...
    recorder = LiveBytes().start(); ...; trace = recorder.stop()   # by hand, windows of your own
    trace.peak("bench::steady")       # max bytes alive inside those windows, where, and by whom
    trace.at_start("bench::steady")   # bytes alive when the first such window opened

With `profile_memory=True` the profiler records every allocation and free of ATen's CPU allocator
on the threads it covers (the caller's, intra-op workers, gloo's workers while they run a
collective). Started before the model is built, the blocks not yet freed are every tensor the
process holds (parameters, gradients, state, activations, communication buffers, gloo's staging),
so the most bytes alive at once is the peak; a storage resized to 0 counts as freed.

The live bytes are summed from the blocks, not read from the profiler's running total: a block
freed on a thread the profiler does not cover (a gloo worker dropping a finished collective's
tensors, as with FSDP2's all-gather outputs and reduce-scatter inputs) would leave that total too
high for the rest of the run. Such a block shows itself when its address is allocated again, or
when the same library region of the same unit allocates a block of its size in a later step; it is
then taken as freed when the first gloo collective started after its allocation ended (early: in
the peer's favour). `Trace.unseen_frees` counts them. Memory outside ATen's allocator (Python
objects, gloo's own buffers) is not counted.

At the peak the bytes alive are attributed to where each block was allocated: the `bench::` phase
open then (before the first: `setup`) and the innermost library region (`FSDP::`, `vescale::`,
unit names dropped), else `AccumulateGrad` or `compute`; blocks allocated on another thread than
the phase's (gloo's workers) are `c10d thread`. The timeline is read from the profiler's Chrome
trace (`export_chrome_trace`, public).
"""

from __future__ import annotations

import bisect
import json
import os
import re
import tempfile
from collections import Counter
from dataclasses import dataclass, field

from torch.profiler import ProfilerActivity, profile, record_function

LIBRARY = ("FSDP::", "vescale::", "vescale_optim.")


def _span(e: dict) -> tuple[str, float, float]:
    """A trace event's name, start and end (µs)."""
    return e["name"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))


def _region(name: str) -> str:
    """A library region without its unit's name: `FSDP::all_gather (blocks.1)` -> `FSDP::all_gather`."""
    return re.sub(r"\s*(\(.*\)|\[.*\])$", "", name)


@dataclass
class Trace:
    times: list[float]  # µs, ascending: one entry per allocator event
    totals: list[int]  # bytes alive after that event
    windows: list[tuple[str, float, float]] = field(default_factory=list)  # bench::/library regions, by start
    allocs: list[tuple[float, float, int, str]] = field(default_factory=list)  # (from, to, bytes, who)
    unseen_frees: int = 0  # blocks freed where the profiler did not see it (see the docstring)

    def _spans(self, name: str) -> list[tuple[float, float]]:
        return [(s, e) for n, s, e in self.windows if n == name]

    def at_start(self, name: str) -> int:
        """Bytes alive when the first `name` window opened."""
        spans = self._spans(name)
        if not spans:
            raise KeyError(name)
        i = bisect.bisect_right(self.times, spans[0][0]) - 1
        return self.totals[i] if i >= 0 else 0

    def peak(self, name: str, prefixes: tuple[str, ...] = ("bench::", *LIBRARY)) -> dict:
        """The most bytes alive inside any `name` window; the windows (named with one of
        `prefixes`) open at that moment, outermost first; the bytes alive then by who
        allocated them (see the module's docstring)."""
        best, when = -1, None
        for start, end in self._spans(name):
            lo, hi = bisect.bisect_left(self.times, start), bisect.bisect_right(self.times, end)
            before = self.totals[lo - 1] if lo > 0 else 0
            if before > best:
                best, when = before, start
            for i in range(lo, hi):
                if self.totals[i] > best:
                    best, when = self.totals[i], self.times[i]
        if when is None:
            raise KeyError(name)
        where = [n for n, s, e in self.windows if s <= when <= e and n.startswith(prefixes)]
        alive = Counter()
        for t0, t1, nbytes, who in self.allocs:
            if t0 <= when < t1:
                alive[who] += nbytes
        return {"bytes": best, "where": where, "by": dict(alive.most_common())}

    def summary(self) -> dict:
        """What `live_steps` measured, as a result's `live_*` keys: the peak of the steady steps
        (bytes, the windows open then, by whom), the first step's, the bytes alive as the steady
        steps began, and the blocks freed unseen."""
        peak = self.peak("bench::steady")
        out = {"live_peak": peak["bytes"], "live_where": peak["where"], "live_by": peak["by"]}
        out.update(live_first=self.peak("bench::first")["bytes"], live_start=self.at_start("bench::steady"))
        return {**out, "live_unseen_frees": self.unseen_frees}


def _attribute(events: list[dict]) -> tuple[list[tuple[float, float, int, str]], int]:
    """(alloc time, free time, bytes, who allocated) for every block allocated in the trace,
    and how many blocks were freed unseen (see the module's docstring)."""
    main = next((e["tid"] for e in events if e.get("name", "").startswith("bench::")), None)
    marks = []  # (time, order, kind, payload): window ends before starts before allocations at a tie
    for i, e in enumerate(events):
        if e.get("ph") == "X" and e.get("tid") == main:
            name, t0, t1 = e["name"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
            if name.startswith(("bench::", *LIBRARY)) or "AccumulateGrad" in name:
                marks += [(t0, 1, "open", (t1, i, name, t0)), (t1, 0, "close", (t1, i, name, t0))]
        elif e.get("name") == "[memory]" and e.get("args", {}).get("Device Type", 0) == 0:
            marks.append((float(e["ts"]), 2, "mem", e))
    marks.sort(key=lambda m: (m[0], m[1]))
    gloo = [e for e in events if e.get("ph") == "X" and e.get("tid") != main]  # the workers' collectives
    collectives = sorted(_span(e)[1:] for e in gloo if e.get("name", "").startswith("gloo:"))
    open_: list[tuple] = []
    live: dict[int, tuple[float, int, str]] = {}
    earlier: dict[tuple[str, int], list[tuple[int, float, float]]] = {}  # site -> (addr, allocated, step)
    out, unseen = [], 0

    def freed_unseen(addr: int, seen_at: float) -> None:
        nonlocal unseen
        t0, n, who = live.pop(addr)
        out.append((t0, _unseen_free(collectives, t0, seen_at), n, who))
        unseen += 1

    for t, _, kind, payload in marks:
        if kind == "open":
            open_.append(payload)
        elif kind == "close":
            if payload in open_:
                open_.remove(payload)
        else:
            args = payload["args"]
            addr, nbytes = args.get("Addr"), int(args["Bytes"])
            if nbytes > 0:
                if addr in live:  # its address again
                    freed_unseen(addr, t)
                on_main = payload.get("tid") == main
                site = _call_site(open_, nbytes) if on_main else None
                if site is not None:  # the same call of a later step: an earlier step's block is gone
                    key, step = site
                    for a, t_a, step_a in earlier.get(key, []):
                        if step_a < step and a in live and live[a][0] == t_a:
                            freed_unseen(a, t)
                    kept = [(a, t_a, step_a) for a, t_a, step_a in earlier.get(key, []) if a in live]
                    earlier[key] = [*kept, (addr, t, step)]
                live[addr] = (t, nbytes, _who(open_, on_main))
            elif addr in live:
                t0, n, who = live.pop(addr)
                out.append((t0, t, n, who))
    out += [(t0, float("inf"), n, who) for t0, n, who in live.values()]
    return out, unseen


def _call_site(open_: list[tuple], nbytes: int) -> tuple[tuple[str, int], float] | None:
    """(innermost library region with its unit's name, bytes) and the start of the step
    (outermost `bench::` window) of an allocation on the main thread, if inside both."""
    steps = [t0 for _, _, name, t0 in open_ if name.startswith("bench::")]
    library = [name for _, _, name, _ in open_ if name.startswith(LIBRARY)]
    if not steps or not library:
        return None
    return (library[-1], nbytes), steps[0]


def _unseen_free(collectives: list[tuple[float, float]], allocated: float, reused: float) -> float:
    """When a block allocated at `allocated`, freed unseen before `reused`, is taken as
    freed: the earliest end of a gloo collective started after its allocation."""
    ends = [end for start, end in collectives if allocated <= start and end <= reused]
    return min(ends, default=reused)


def _timeline(blocks: list[tuple[float, float, int, str]]) -> tuple[list[float], list[int]]:
    """Bytes alive after each allocation or free of `blocks` (a free first at a tie)."""
    changes = [(t1, 0, -n) for _, t1, n, _ in blocks if t1 != float("inf")]
    changes = sorted(changes + [(t0, 1, n) for t0, _, n, _ in blocks])
    times, totals, alive = [], [], 0
    for t, _, delta in changes:
        alive += delta
        times.append(t)
        totals.append(alive)
    return times, totals


def _who(open_: list[tuple], on_main: bool) -> str:
    if not on_main:
        return "c10d thread"
    names = [name for _, _, name, _ in open_]
    phases = [n for n in names if n.startswith("bench::") and n[7:] in ("fwd", "bwd", "step", "zero_grad")]
    phase = phases[-1][7:] if phases else "setup"
    library = [n for n in names if n.startswith(LIBRARY)]
    if library:
        return f"{phase}: {_region(library[-1])}"
    return f"{phase}: {'AccumulateGrad' if any('AccumulateGrad' in n for n in names) else 'compute'}"


def live_steps(build, pool: list, steps: int, tail: bool = True) -> tuple:
    """`build()` (a trainer of `benchmarks._train`) and `steps` of its steps on `pool`'s batches, all
    under the recorder: `bench::first`, then `bench::steady`, then (with `tail`) one more step,
    not measured, that lets the blocks the last steady step freed unseen show themselves. Returns
    the trainer and the trace."""
    recorder = LiveBytes().start()
    tr = build()
    for s, window in enumerate(["bench::first"] + ["bench::steady"] * (steps - 1) + ["bench::tail"] * tail):
        with record_function(window):
            tr.step(*pool[s % len(pool)], record=False)
    return tr, recorder.stop()


class LiveBytes:
    """The profiler, recording allocations (see the module's docstring)."""

    def __init__(self):
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)

    def start(self) -> LiveBytes:
        self._prof.start()
        return self

    def stop(self) -> Trace:
        self._prof.stop()
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            self._prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        finally:
            os.unlink(path)
        self._prof = None
        windows = [_span(e) for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"]
        windows.sort(key=lambda w: w[1])
        blocks, unseen = _attribute(events)
        times, totals = _timeline(blocks)
        return Trace(times, totals, windows, blocks, unseen)
