"""Elastic restarts: a worker killed with SIGKILL makes `torchrun --max-restarts N` restart the
group, which joins again (`vo.init_distributed`), resumes from the newest complete checkpoint
and ends with the weights of an uninterrupted run with the same flags.

- the demo (`-m vescale_optim.demo --resume`): a worker killed once `step-10` exists; the same
  `params_sha256` and losses;
- examples/train_torchrun.py, a user's script: three trials, run at once, of a worker (rank 1,
  0, 1) killed as soon as `step-10` exists; a worker killed in the middle of writing `step-20` (its own
  pieces written, the checkpoint not complete: the restart resumes from `step-10`); both
  workers killed in turn, after `step-10` and, restarted, after `step-20` (two restarts). Each
  ends with the uninterrupted run's weights fingerprint.

Every torchrun runs in a session of its own, under a deadline: a hang kills the session and
fails the test."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # make test-fast leaves it out

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--nproc-per-node",
    "2",
    "--standalone",
    "--max-restarts",
    "1",
    "--monitor-interval",
    "0.1",
]
TINY = [
    "--batch-size",
    "4",
    "--seq-len",
    "32",
    "--d-model",
    "32",
    "--n-layers",
    "2",
    "--n-heads",
    "2",
    "--warmup",
    "3",
    "--val-tokens",
    "256",
    "--no-progress",
]
FLAGS = ["--steps", "100", "--checkpoint-every", "10", "--resume", "--timeout", "20"]
LIMIT = 150  # seconds for one torchrun, restarts included

EXAMPLE = ROOT / "examples" / "train_torchrun.py"
FAULTY = ROOT / "tests" / "_elastic_example.py"  # the example, with a death inside a checkpoint write
EXAMPLE_FLAGS = [
    "--dim",
    "32",
    "--layers",
    "2",
    "--batch-size",
    "8",
    "--seq-len",
    "16",
    "--steps",
    "40",
    "--save-every",
    "10",
    "--log-every",
    "10",
    "--timeout",
    "20",
]
EXAMPLE_LIMIT = 90


def _launch(folder: Path, cmd: list[str], **env: str) -> tuple[subprocess.Popen, Path]:
    """`cmd` in `folder`, in a session of its own, its output into `folder/log`."""
    folder.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    with open(folder / "log", "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            cmd, cwd=folder, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return proc, folder / "log"


def _start(folder: Path) -> tuple[subprocess.Popen, Path]:
    """torchrun of the demo, checkpointing into `folder/ckpt`."""
    cmd = [
        *TORCHRUN,
        "-m",
        "vescale_optim.demo",
        *TINY,
        *FLAGS,
        "--checkpoint-dir",
        str(folder / "ckpt"),
        "--out",
        str(folder / "out"),
    ]
    return _launch(folder, cmd)


def _start_example(folder: Path, restarts: int, script: Path = EXAMPLE, **env: str):
    """torchrun of examples/train_torchrun.py (or `script`), checkpointing into `folder/ckpt`."""
    cmd = [
        *TORCHRUN[:6],
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        "0.1",
        str(script),
        *EXAMPLE_FLAGS,
        "--checkpoint-dir",
        str(folder / "ckpt"),
    ]
    return _launch(folder, cmd, **env)


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


def _await(path: Path, proc: subprocess.Popen, log: Path, deadline: float) -> None:
    """Until `path` exists; fails if torchrun ends or the deadline passes first."""
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            pytest.fail(f"no {path.name} before torchrun ended or the deadline:\n{log.read_text()[-4000:]}")
        time.sleep(0.01)


def _kill(proc: subprocess.Popen, rank: int, not_of: dict[int, int] | None = None) -> dict[int, int]:
    """SIGKILL torchrun's worker `rank` (of an attempt other than `not_of`); its workers, by rank."""
    workers = _workers(proc.pid)
    for _ in range(200):  # a new attempt's workers, once torchrun has started both
        if sorted(workers) == [0, 1] and not (not_of and set(workers.values()) & set(not_of.values())):
            break
        time.sleep(0.02)
        workers = _workers(proc.pid)
    assert sorted(workers) == [0, 1], workers
    os.kill(workers[rank], signal.SIGKILL)  # raises if it had already finished: the test would prove nothing
    return workers


def _fingerprint(out: str) -> str:
    found = re.findall(r"done at step 40; weights fingerprint (\S+);", out)
    assert len(found) == 1, out[-4000:]
    return found[0]


def _starts(out: str, ckpt: Path) -> list[str]:
    """How each attempt began: "scratch", or the checkpoint folder it resumed from."""
    starts = re.findall(r"on 2 rank\(s\), cpu; (from scratch|resumed from (\S+))", out)
    return ["scratch" if a == "from scratch" else str(Path(b).relative_to(ckpt)) for a, b in starts]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The example's weights fingerprint, never interrupted: started at once, awaited by calling."""
    folder = tmp_path_factory.mktemp("elastic") / "uninterrupted"
    proc, log = _start_example(folder, 0)
    deadline, found = time.monotonic() + EXAMPLE_LIMIT, []

    def fingerprint() -> str:
        if not found:
            out = _finish(proc, log, deadline)
            assert _starts(out, folder / "ckpt") == ["scratch"], out[-4000:]
            found.append(_fingerprint(out))
        return found[0]

    yield fingerprint
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


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


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds torchrun's workers through /proc")
@pytest.mark.timeout(EXAMPLE_LIMIT + 60)
def test_the_example_killed_after_a_checkpoint_restarts_and_ends_bit_identical(tmp_path, uninterrupted):
    """Three trials at once, beside the uninterrupted run (nothing here depends on speed: each
    kill waits for its checkpoint, and 30 steps are left after it): rank 1, 0 and 1 killed."""
    victims = (1, 0, 1)
    runs = [_start_example(tmp_path / f"trial{t}", 1) for t in range(len(victims))]
    deadline = time.monotonic() + EXAMPLE_LIMIT
    waiting = set(range(len(victims)))
    try:
        while waiting:  # kill each trial's victim as soon as that trial's step-10 exists
            for t in sorted(waiting):
                proc, log = runs[t]
                if (tmp_path / f"trial{t}" / "ckpt" / "step-10").exists():
                    _kill(proc, victims[t])
                    waiting.discard(t)
                elif proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(
                        f"trial {t}: no step-10 before torchrun ended or the deadline:\n"
                        f"{log.read_text()[-4000:]}"
                    )
            time.sleep(0.01)
        outs = [_finish(proc, log, deadline) for proc, log in runs]
    finally:
        for proc, _ in runs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for t, out in enumerate(outs):
        tail = f"trial {t}:\n{out[-4000:]}"
        assert _starts(out, tmp_path / f"trial{t}" / "ckpt") == ["scratch", "step-10"], tail
        assert _fingerprint(out) == uninterrupted(), tail


@pytest.mark.timeout(EXAMPLE_LIMIT + 60)
def test_the_example_killed_while_writing_a_checkpoint_resumes_from_the_one_before(tmp_path, uninterrupted):
    folder = tmp_path / "in_save"
    marker = folder / "died.json"
    proc, log = _start_example(folder, 1, FAULTY, DIE_IN_SAVE="20", DIE_RANK="1", DIE_MARKER=str(marker))
    out = _finish(proc, log, time.monotonic() + EXAMPLE_LIMIT)
    died = json.loads(marker.read_text())  # what the checkpoint folder held as rank 1 died
    assert died["written"] and not died["complete"], died
    assert died["newest"] == "step-10", died
    assert _starts(out, folder / "ckpt") == ["scratch", "step-10"], out[-4000:]
    assert _fingerprint(out) == uninterrupted(), out[-4000:]
    assert sorted(p.name for p in (folder / "ckpt").iterdir()) == ["step-20", "step-30", "step-40"]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds torchrun's workers through /proc")
@pytest.mark.timeout(EXAMPLE_LIMIT + 60)
def test_the_example_with_both_workers_killed_in_turn_restarts_twice(tmp_path, uninterrupted):
    folder = tmp_path / "twice"
    proc, log = _start_example(folder, 2)
    deadline = time.monotonic() + EXAMPLE_LIMIT
    _await(folder / "ckpt" / "step-10", proc, log, deadline)
    first = _kill(proc, 1)
    _await(folder / "ckpt" / "step-20", proc, log, deadline)  # written by the restarted attempt
    _kill(proc, 0, not_of=first)
    out = _finish(proc, log, deadline)
    assert _starts(out, folder / "ckpt") == ["scratch", "step-10", "step-20"], out[-4000:]
    assert _fingerprint(out) == uninterrupted(), out[-4000:]
