"""Shared output helpers for benchmarks: a Markdown table, a JSON file, a PNG, the host.

    print(table(rows, ["model", "W", "padding %"]))
    save_json("padding", {"env": environment(), "rows": rows})   # benchmarks/results/padding.json
    save_png("padding", fig)                                      # benchmarks/results/padding.png
    print(host_line(results.threads))      # CPU, AVX-512, native bf16, threads per rank, load average
    print(FSDP2_ON_CPU)                    # beside every table of CPU time ratios against FSDP2

Results go to `benchmarks/results/` (git-ignored), created on first use.

Why the host: on a CPU without native bf16 (AVX512_BF16 or AMX) bf16 matrix products run about
8x slower than fp32, so Newton–Schulz-heavy ratios (Muon) measured on two hosts differ several-fold;
a number means little without the host, its threads per rank and its load.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks._measure import load_average

RESULTS_DIR = Path(__file__).resolve().parent / "results"


FSDP2_ON_CPU = (
    "On CPU, FSDP2 issues its collectives synchronously (its overlap of communication with compute "
    "needs CUDA streams), so all of its communication is exposed here: a CPU time ratio against "
    "FSDP2 is not what a GPU shows."
)


def _cell(value: Any, floatfmt: str) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return format(value, floatfmt)
    if isinstance(value, int):
        return f"{value:,d}" if abs(value) >= 100_000 else str(value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None, *, floatfmt: str = ".3g"
) -> str:
    """A Markdown table of `rows` (dicts), one column per key in `columns` (default: the
    keys of the first row). Missing keys print empty, floats with `floatfmt`, large ints
    with thousands separators; numbers are right-aligned."""
    if columns is None:
        columns = list(rows[0]) if rows else []
    cells = [[_cell(row.get(c), floatfmt) for c in columns] for row in rows]
    numeric = [all(isinstance(r.get(c), int | float) for r in rows if r.get(c) is not None) for c in columns]
    widths = [max([len(c), 3, *(len(r[j]) for r in cells)]) for j, c in enumerate(columns)]

    def line(values):
        padded = (v.rjust(w) if n else v.ljust(w) for v, w, n in zip(values, widths, numeric))
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" if n else "-" * (w + 2) for w, n in zip(widths, numeric)) + "|"
    return "\n".join([line(list(columns)), rule, *(line(r) for r in cells)])


def require_finite(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> None:
    """Raise if a row's value in one of `columns` is a float that is nan or infinite: a benchmark
    fails loudly rather than printing a number it did not measure."""
    label = lambda i, row: row.get("config", row.get("optimizer", i))  # noqa: E731
    bad = [(label(i, row), c, row.get(c)) for i, row in enumerate(rows) for c in columns]
    bad = [b for b in bad if isinstance(b[2], float) and not math.isfinite(b[2])]
    if bad:
        raise RuntimeError(f"numbers that were not measured (row, column, value): {bad}")


def save_json(name: str, payload: Any) -> Path:
    """Write `payload` to `benchmarks/results/NAME.json` (tuples become lists, other
    non-JSON values their `str`) and return the path."""
    path = RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return path


def pyplot():
    """`matplotlib.pyplot` on the Agg backend, or None where matplotlib is not installed (the
    benchmarks then skip their plots)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_png(name: str, fig: Any) -> Path:
    """Save a matplotlib figure to `benchmarks/results/NAME.png` and close it."""
    path = RESULTS_DIR / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _cpu_info() -> tuple[str, set[str]] | None:
    """The CPU's model name and flags from `/proc/cpuinfo`; None where it cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    model = fields.get("model name") or fields.get("Model name") or fields.get("cpu model") or "unknown"
    return model, set(fields.get("flags", fields.get("Features", "")).split())


def host(threads: Sequence[int] | int | None = None) -> dict[str, Any]:
    """The CPU model, whether it has AVX-512 and native bf16 (AVX512_BF16 / AMX), `threads` per
    rank (what `torch.get_num_threads()` said in each rank; default this process's) and the
    load average. "unknown" where `/proc/cpuinfo` cannot be read."""
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    info = _cpu_info()
    if info is None:
        model, avx512, bf16 = "unknown", "unknown", "unknown"
    else:
        model, flags = info
        avx512 = "yes" if "avx512f" in flags else "no"
        native = [name for f, name in (("avx512_bf16", "AVX512_BF16"), ("amx_bf16", "AMX")) if f in flags]
        bf16 = " + ".join(native) or "no"
    per_rank = [threads] if isinstance(threads, int) else list(threads)
    out = {"cpu": model, "avx512": avx512, "native_bf16": bf16, "threads_per_rank": per_rank}
    return {**out, "load_average": load_average()}


def host_line(threads: Sequence[int] | int | None = None) -> str:
    """`host(threads)` as one line, for printing beside a table."""
    h = host(threads)
    per_rank = sorted(set(h["threads_per_rank"]))
    slow = " (bf16 matmuls emulated: ~8x slower than fp32)" if h["native_bf16"] == "no" else ""
    each = "/".join(map(str, per_rank))
    cpu = f"host: {h['cpu']}; AVX-512 {h['avx512']}; native bf16 {h['native_bf16']}{slow}"
    return f"{cpu}; {each} thread(s) per rank; load average {h['load_average']}"


def environment(threads: Sequence[int] | int | None = None) -> dict[str, Any]:
    """Where a result was measured: versions, CPU count, git commit, `host(threads)`."""
    env: dict[str, Any] = dict(python=sys.version.split()[0], platform=platform.platform())
    env.update(cpus=os.cpu_count())
    env.update(host=host(threads), argv=sys.argv)
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        pass
    try:
        git = ["git", "rev-parse", "--short", "HEAD"]
        proc = subprocess.run(git, cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5)
        env["commit"] = proc.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["commit"] = None
    return env
