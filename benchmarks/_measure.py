"""Measuring helpers the training benchmarks share: RSS, timers, medians, machine load.

live_malloc()                       # glibc: large blocks by mmap, so RSS follows live tensors
base = status_kb("VmRSS"); reset_peak(); ...; status_kb("VmHWM")   # peak RSS since the reset
t = Timer(); fn = t.wrap(fn); ...; t.take()                          # seconds spent inside fn
median_of_max(per_rank_times)       # median over steps of the slowest rank's time
median_ratio(ours, peer)            # median over steps of the per-step ratio
load_average()                      # "1.41, 1.60, 1.74" (1, 5, 15 minutes)
window_seconds(prof, "FSDP::all_gather")   # seconds inside those profiler windows (None: none)
matmul_flops(prof)                  # FLOPs of the matrix products a profile saw
"""

from __future__ import annotations

import os
import statistics
import time


def status_kb(field: str) -> int:
    """A `/proc/self/status` field in KiB (`VmRSS`, `VmHWM`)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> bool:
    """Reset this process's peak RSS (`VmHWM`) to its current RSS; False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def live_malloc() -> bool:
    """glibc: serve allocations of 128 KiB and more by mmap (returned to the OS on free)
    and trim the heap eagerly, so RSS follows the live tensors rather than the allocator's
    high-water marks."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 128 * 1024) and libc.mallopt(m_trim_threshold, 128 * 1024))
    except (OSError, AttributeError):
        return False


class Timer:
    """Adds up wall time spent inside wrapped callables."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


def slowest(per_rank: list[list[float]]) -> list[float]:
    """The slowest rank's time in each step."""
    return [max(col) for col in zip(*per_rank)]


def median_of_max(per_rank: list[list[float]]) -> float:
    """Median over steps of the slowest rank's time in each step."""
    return statistics.median(slowest(per_rank))


def median_ratio(a: list[float], b: list[float]) -> float:
    """The median over steps of `a[i] / b[i]` (steps where `b[i] > 0`): two configurations that ran
    each step side by side, so the load on the machine hit both alike."""
    return statistics.median(x / y for x, y in zip(a, b) if y > 0)


def load_average() -> str:
    """The machine's load average over 1, 5 and 15 minutes, for printing beside a table."""
    try:
        return ", ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unknown"


def window_seconds(prof, prefix: str) -> float | None:
    """Seconds inside the outermost windows of a finished `torch.profiler.profile` whose names
    start with `prefix` (`record_function` labels: ours `vescale::...` and `vescale_optim....`,
    FSDP2's `FSDP::...`), added up; None when there is none, so a label that moved shows."""

    def nested(e) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if parent.name.startswith(prefix):
                return True
            parent = parent.cpu_parent
        return False

    outer = [e for e in prof.events() if e.name.startswith(prefix) and not nested(e)]
    return sum(e.time_range.elapsed_us() for e in outer) / 1e6 if outer else None


PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def matmul_flops(prof) -> int:
    """FLOPs of the innermost matrix products a finished `profile(..., with_flops=True)` saw (a
    product that calls another, as a DTensor's calls its local one, counts as the inner one)."""

    def calls_product(e) -> bool:
        return any(c.name in PRODUCTS or calls_product(c) for c in e.cpu_children)

    return sum(e.flops or 0 for e in prof.events() if e.name in PRODUCTS and not calls_product(e))


def peak_bytes(prof) -> int:
    """The most bytes allocated at once above where a finished `torch.profiler.profile(...,
    profile_memory=True)` started: its allocations (each operator's own) and frees in time order,
    added up. A temporary an operator frees before it returns is not seen, on either side of a
    comparison measured this way."""
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    held = peak = 0
    for e in events:
        held += e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        peak = max(peak, held)
    return peak
