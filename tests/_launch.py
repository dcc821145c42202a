"""Scripts run as users run them (torchrun, or a plain interpreter) by the integration tests: a
command in a session of its own whose hang fails the test instead of the suite, and the weights
fingerprint the example scripts print."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest


def run_script(
    cmd: list[str], cwd: Path, timeout: float = 150, env: dict[str, str] | None = None, tail: int = 4000
) -> str:
    """Run `cmd` in `cwd` in its own session (`env`: its environment, else this one's); its output.
    On timeout the session (launcher and ranks) is killed; a timeout or a failed exit fails the test
    with the last `tail` characters of the output, stderr included."""
    to = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, **to, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout} s:\n{out[-tail:]}")
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}:\n{out[-tail:]}")
    return out


def fingerprint(out: str) -> str:
    """The one weights fingerprint a run of an example printed."""
    found = re.findall(r"weights fingerprint (\S+);", out)
    assert len(found) == 1, out[-2000:]
    return found[0]
