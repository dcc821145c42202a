"""Running a benchmark's `main` from a test: the repository root importable, and
`benchmarks/results/` redirected to a temporary folder while it runs."""

import contextlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@contextlib.contextmanager
def results_in(folder: Path):
    """`benchmarks/results/` is `folder` inside the block."""
    import benchmarks._report as report

    saved, report.RESULTS_DIR = report.RESULTS_DIR, folder
    try:
        yield folder
    finally:
        report.RESULTS_DIR = saved


def config_row(result: dict, config: str) -> dict:
    """The row of `config` in a benchmark's result."""
    return next(r for r in result["rows"] if r["config"] == config)
