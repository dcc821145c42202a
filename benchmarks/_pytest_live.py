"""A pytest plugin for the GPU check's `tests` stage: each test's outcome is appended to the
JSON-lines file `$GPU_CHECK_TESTS_LOG` as it finishes (on the controller under pytest-xdist),
so a stage stopped at its time limit still knows what passed and failed.

    GPU_CHECK_TESTS_LOG=out/tests.jsonl python -m pytest -p benchmarks._pytest_live -n 8 tests/...
"""

from __future__ import annotations

import json
import os

import pytest


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """One line per test: its outcome once known (a failed set-up or teardown counts as failed)."""
    path = os.environ.get("GPU_CHECK_TESTS_LOG")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):  # xdist's controller writes the workers' results
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        outcome = "skipped" if report.skipped else "passed" if report.passed else "failed"
    elif report.when == "teardown" and report.failed:
        outcome = "failed"
    else:
        return
    line = json.dumps({"nodeid": report.nodeid, "outcome": outcome, "seconds": round(report.duration, 3)})
    with open(path, "a") as f:
        f.write(line + "\n")
