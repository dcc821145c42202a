"""Shared output helpers for benchmarks: a Markdown table, a JSON file, a PNG.

    print(table(rows, ["model", "W", "padding %"]))
    save_json("padding", {"env": environment(), "rows": rows})   # benchmarks/results/padding.json
    save_png("padding", fig)                                      # benchmarks/results/padding.png

Results go to `benchmarks/results/` (git-ignored), created on first use.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"

__all__ = ["RESULTS_DIR", "environment", "save_json", "save_png", "table"]


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
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str] | None = None,
    *,
    floatfmt: str = ".3g",
) -> str:
    """A Markdown table of `rows` (dicts), one column per key in `columns` (default: the
    keys of the first row). Missing keys print empty, floats with `floatfmt`, large ints
    with thousands separators; numbers are right-aligned."""
    if columns is None:
        columns = list(rows[0]) if rows else []
    cells = [[_cell(row.get(c), floatfmt) for c in columns] for row in rows]
    numeric = [
        all(isinstance(row.get(c), int | float) for row in rows if row.get(c) is not None) for c in columns
    ]
    widths = [max([len(c), 3, *(len(r[j]) for r in cells)]) for j, c in enumerate(columns)]

    def line(values):
        return (
            "| "
            + " | ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric))
            + " |"
        )

    rule = (
        "|" + "|".join("-" * (w + 1) + ":" if num else "-" * (w + 2) for w, num in zip(widths, numeric)) + "|"
    )
    return "\n".join([line(list(columns)), rule, *(line(r) for r in cells)])


def save_json(name: str, payload: Any) -> Path:
    """Write `payload` to `benchmarks/results/NAME.json` (tuples become lists, other
    non-JSON values their `str`) and return the path."""
    path = RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return path


def save_png(name: str, fig: Any) -> Path:
    """Save a matplotlib figure to `benchmarks/results/NAME.png` and close it."""
    path = RESULTS_DIR / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def environment() -> dict[str, Any]:
    """Where a result was measured: versions, CPU count, git commit."""
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "argv": sys.argv,
    }
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        pass
    try:
        env["commit"] = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=Path(__file__).parent,
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        env["commit"] = None
    return env
