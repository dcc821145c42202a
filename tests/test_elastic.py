"""Elastic restart: under `torchrun --max-restarts 1 -m vescale_optim.demo --resume`, a worker
killed with SIGKILL once a checkpoint exists makes torchrun restart the group, which resumes
from the newest complete checkpoint and ends with the same weights (`params_sha256`) and
losses as an uninterrupted run with the same flags."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
            "--max-restarts", "1", "--monitor-interval", "0.1"]  # fmt: skip
TINY = ["--batch-size", "4", "--seq-len", "32", "--d-model", "32", "--n-layers", "2", "--n-heads", "2",
        "--warmup", "3", "--val-tokens", "256", "--no-progress"]  # fmt: skip
FLAGS = ["--steps", "100", "--checkpoint-every", "10", "--resume", "--timeout", "20"]
LIMIT = 150  # seconds for one torchrun, restarts included


def _start(folder: Path) -> tuple[subprocess.Popen, Path]:
    """torchrun of the demo, checkpointing into `folder/ckpt`, in a session of its own."""
    folder.mkdir()
    cmd = [*TORCHRUN, "-m", "vescale_optim.demo", *TINY, *FLAGS,
           "--checkpoint-dir", str(folder / "ckpt"), "--out", str(folder / "out")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(folder / "log", "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, cwd=folder, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    return proc, folder / "log"


def _finish(proc: subprocess.Popen, log: Path, deadline: float) -> str:
    """Wait for torchrun to exit by `deadline`; its output. A hang kills its session and fails."""
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"torchrun did not finish in time:\n{log.read_text()[-4000:]}")
    out = log.read_text()
    assert proc.returncode == 0, out[-4000:]
    return out


def _workers(agent: int) -> dict[int, int]:
    """The pids of torchrun's worker processes (its children), by RANK."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0") if ppid == agent else []
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        for var in env:
            if var.startswith(b"RANK="):
                found[int(var[5:])] = int(entry.name)
    return found


def _summary(folder: Path) -> dict:
    return json.loads((folder / "out" / "summary.json").read_text())["runs"]["adamw"]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds torchrun's workers through /proc")
@pytest.mark.timeout(2 * LIMIT + 30)
def test_a_worker_killed_after_a_checkpoint_restarts_and_ends_bit_identical(tmp_path):
    proc, log = _start(tmp_path / "elastic")
    deadline = time.monotonic() + LIMIT
    first = tmp_path / "elastic" / "ckpt" / "step-10"
    while not first.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            _finish(proc, log, deadline)
            pytest.fail(f"no checkpoint before torchrun ended:\n{log.read_text()[-4000:]}")
        time.sleep(0.02)
    workers = _workers(proc.pid)
    assert sorted(workers) == [0, 1], workers
    os.kill(workers[1], signal.SIGKILL)  # raises if it had already finished: the test would prove nothing
    out = _finish(proc, log, deadline)
    assert "resumed from" in out, out[-4000:]

    # the same flags, never interrupted (after the first, so as not to share the cores)
    reference, ref_log = _start(tmp_path / "uninterrupted")
    _finish(reference, ref_log, time.monotonic() + LIMIT)

    got, want = _summary(tmp_path / "elastic"), _summary(tmp_path / "uninterrupted")
    assert want["resumed_from_step"] == 0 and want["final_step"] == got["final_step"] == 100
    assert got["resumed_from_step"] in range(10, 100, 10), got["resumed_from_step"]
    assert len(got["params_sha256"]) == 64
    assert got["params_sha256"] == want["params_sha256"]
    assert got["loss"] == want["loss"]  # the steps before the checkpoint come from it
