"""Measuring helpers the training benchmarks share: RSS, medians, machine load, profiler windows.

live_malloc()                       # glibc: large blocks by mmap, so RSS follows live tensors
base = status_kb("VmRSS"); reset_peak(); ...; status_kb("VmHWM")   # peak RSS since the reset
slowest(per_rank_times)             # the slowest rank's time in each step
median_ratio(ours, peer)            # median over steps of the per-step ratio
load_average()                      # "1.41, 1.60, 1.74" (1, 5, 15 minutes)
window_seconds(prof, "FSDP::all_gather")   # seconds inside those profiler windows (None: none)
matmul_flops(prof)                  # FLOPs of the matrix products a profile saw
"""

from __future__ import annotations

import os
import statistics


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


def slowest(per_rank: list[list[float]]) -> list[float]:
    """The slowest rank's time in each step."""
    return [max(col) for col in zip(*per_rank)]


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


def matmul_flops(prof, within: str | None = None) -> int:
    """FLOPs of the innermost matrix products a finished `profile(..., with_flops=True)` saw (a
    product that calls another, as a DTensor's calls its local one, counts as the inner one); with
    `within`, only those that started inside a `record_function(within)` window."""

    def calls_product(e) -> bool:
        return any(c.name in PRODUCTS or calls_product(c) for c in e.cpu_children)

    events = list(prof.events())
    spans = [(e.time_range.start, e.time_range.end) for e in events if e.name == within]
    inside = lambda e: within is None or any(s <= e.time_range.start <= t for s, t in spans)  # noqa: E731
    return sum(e.flops or 0 for e in events if e.name in PRODUCTS and inside(e) and not calls_product(e))
