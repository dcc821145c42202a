"""Faults around CheckpointManager: a save killed in the middle (a rank dead while writing, or
rank 0 dead before renaming) leaves the previous checkpoint as the newest, and the run resumes
from it to the same weights as an uninterrupted one; every bad checkpoint is a clear
CheckpointError on every rank, and nothing in memory changes."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import random
import shutil
import signal
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _fsdp_cases import SHAMPOO
from _resume import Counter, assert_same, full, make, train
from _tiny_gpt import build

import vescale_optim as vo
from vescale_optim.checkpoint import MANIFEST


def _everything(model, opt, sched, counter):
    """All a load could change: model, optimizer, scheduler, stateful, random states."""
    return {
        **full(model, opt, sched),
        "counter": counter.n,
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
    }


# --- a save killed in the middle --------------------------------------------------------------


def _die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def _crash(rank: int, store: str, directory: str, where: str) -> None:
    """Train to 4 saving at 2, then die while saving 4: rank 1 once it has written its
    files ("write"), or rank 0 once every rank has, before renaming ("rename")."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    model, opt, sched = make("adamw")
    manager = vo.CheckpointManager(directory, model, opt, sched)
    train(model, opt, sched, Counter(), 0, 2, False)
    manager.save(2)
    train(model, opt, sched, Counter(), 2, 4, False)
    if where == "write" and rank == 1:
        original = dcp.FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            original(self, plan, planner).wait()
            _die()

        dcp.FileSystemWriter.write_data = write_then_die
    if where == "rename" and rank == 0:
        vo.CheckpointManager._commit = _die
    try:
        manager.save(4)
    except Exception:  # noqa: BLE001 - the survivor: its peer died under it
        os._exit(3)
    os._exit(0)


def _resume_latest(directory: str):
    model, opt, sched = make("adamw", seed=7)
    manager = vo.CheckpointManager(directory, model, opt, sched)
    loaded = manager.load()
    train(model, opt, sched, Counter(), loaded.step, 4, False)
    manager.save(4)
    return loaded.step, full(model, opt, sched)["model"]


def _uninterrupted():
    model, opt, sched = make("adamw")
    train(model, opt, sched, Counter(), 0, 4, False)
    return full(model, opt, sched)["model"]


@pytest.mark.parametrize("where", ["write", "rename"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint(world, tmp_path, where):
    directory = tmp_path / "run"
    ctx = multiprocessing.get_context("forkserver")
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=_crash, args=(r, store, str(directory), where)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
            pytest.fail(f"a rank of the crashing run hung ({where})")
    dead = 1 if where == "write" else 0
    assert procs[dead].exitcode == -signal.SIGKILL and procs[1 - dead].exitcode == 3
    assert sorted(p.name for p in directory.iterdir()) == [".step-4.tmp", "step-2"]
    assert (directory / ".step-4.tmp" / ".metadata").exists() == (where == "rename")

    want = world(2).run(_uninterrupted)
    for (step, got), expected in zip(world(2).run(_resume_latest, str(directory)), want):
        assert step == 2
        assert_same(got, expected)
    assert sorted(p.name for p in directory.iterdir()) == ["step-2", "step-4"]  # the leftover is gone


# --- bad checkpoints --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One process: AdamW (fp32, and 8-bit and fp32 on a wider model) and Shampoo runs, each
    saved at step 2."""
    root = tmp_path_factory.mktemp("saved")
    for kind in ("adamw", "adamw8", "adamw32", "shampoo"):
        model, opt, sched = _make(kind, seed=0)
        counter = Counter()
        manager = vo.CheckpointManager(root / kind, model, opt, sched, stateful={"counter": counter})
        train(model, opt, sched, counter, 0, 2, False)
        manager.save(2)
    return root


def _biggest(path):
    return max(path.glob("*.distcp"), key=lambda f: f.stat().st_size)


def _truncate(path, nbytes):
    with open(path, "r+b") as f:
        f.truncate(nbytes)


def _fail_halfway(self, plan, planner):
    """DCP reads half of what it planned, then the storage fails."""
    half = dataclasses.replace(plan, items=plan.items[: len(plan.items) // 2])
    _READ(self, half, planner).wait()
    raise OSError("the storage went away")


_READ = dcp.FileSystemReader.read_data

DAMAGE = {
    "truncated data file": (
        lambda p: _truncate(_biggest(p), _biggest(p).stat().st_size // 2),
        "is truncated",
    ),
    "missing data file": (lambda p: _biggest(p).unlink(), "is missing"),
    "missing metadata": (lambda p: (p / ".metadata").unlink(), ".metadata is missing"),
    "truncated metadata": (lambda p: _truncate(p / ".metadata", 20), ".metadata is truncated (20 bytes; "),
    "missing manifest": (lambda p: (p / MANIFEST).unlink(), f"it has no {MANIFEST}: not complete"),
    "damaged manifest": (lambda p: (p / MANIFEST).write_text("{"), "is damaged"),
    "storage fails while reading": (None, "the storage went away"),
}


def _make(kind, seed):
    """`test_resume.make`'s runs, and: AdamW with amsgrad, "adamw8"'s with fp32 state, Shampoo
    with tiles of 4."""
    if kind not in ("amsgrad", "adamw32", "shampoo4"):
        return make(kind, seed=seed)
    model = build(seed=seed, dim=64 if kind == "adamw32" else 16)
    sharding = {"shard_modules": [*model.layers, model]}
    if kind == "amsgrad":
        opt = vo.AdamW(model.parameters(), amsgrad=True, **sharding)
    elif kind == "adamw32":
        opt = vo.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), **sharding)
    else:
        opt = vo.Shampoo(model.parameters(), **{**SHAMPOO, "max_preconditioner_dim": 4}, **sharding)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def _loader(kind="adamw", scheduler=True, stateful="counter"):
    """A run at step 1 (so different from the checkpoint) to load into."""
    torch.manual_seed(3)
    random.seed(3)
    model, opt, sched = _make(kind, seed=7)
    counter = Counter()
    train(model, opt, sched, counter, 0, 1, False)
    manager = vo.CheckpointManager(
        "unused", model, opt, sched if scheduler else None, stateful={stateful: counter}
    )
    return manager, (model, opt, sched, counter)


def _refused(directory, step=2, **loader):
    """Load `directory`'s step: the CheckpointError's message, after checking nothing changed."""
    manager, objects = _loader(**loader)
    manager.directory = directory
    before = _everything(*objects)
    with pytest.raises(vo.CheckpointError) as info:
        manager.load(step)
    assert_same(_everything(*objects), before)
    assert "Nothing was changed." in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_refused_and_nothing_changes(saved, tmp_path, damage, monkeypatch):
    directory = tmp_path / "copy"
    shutil.copytree(saved / "adamw", directory)
    hurt, message = DAMAGE[damage]
    if hurt is None:
        monkeypatch.setattr(dcp.FileSystemReader, "read_data", _fail_halfway)
    else:
        hurt(directory / "step-2")
    assert message in _refused(directory)


# case: (the saved run, the run loading it, what the error says)
MISMATCH = {
    "another optimizer class": (
        "adamw",
        dict(kind="muon"),
        "its optimizer is vescale_optim.optim.adamw.AdamW, this one is vescale_optim.optim.muon.Muon",
    ),
    "amsgrad (shapes the state)": (
        "adamw",
        dict(kind="amsgrad"),
        "param group 0 has amsgrad=False there, True here (it shapes the state: build the optimizer with "
        "amsgrad=False)",
    ),
    "8-bit state into fp32": (
        "adamw8",
        dict(kind="adamw32"),
        "its optimizer state is stored in 8 bits, this optimizer's in 32 (build it with state_bits=8)",
    ),
    "fp32 state into 8-bit": (
        "adamw32",
        dict(kind="adamw8"),
        "its optimizer state is stored in 32 bits, this optimizer's in 8 (build it with state_bits=32)",
    ),
    "another model": (
        "adamw",
        dict(kind="adamw8"),
        "another model: shapes: embed.weight [37, 16] there, [37, 64] here",
    ),
    "other tiles": (
        "shampoo",
        dict(kind="shampoo4"),
        "param group 0 has max_preconditioner_dim=8 there, 4 here",
    ),
    "no scheduler": (
        "adamw",
        dict(scheduler=False),
        "its LR scheduler is torch.optim.lr_scheduler.LambdaLR, this one is None",
    ),
    "another stateful object": ("adamw", dict(stateful="data"), "it has no state for stateful ['data']"),
}


@pytest.mark.parametrize("case", list(MISMATCH))
def test_a_checkpoint_of_something_else_is_refused_and_nothing_changes(saved, case):
    run, loader, message = MISMATCH[case]
    assert message in _refused(saved / run, **loader)


def test_a_missing_step_is_refused_and_the_same_settings_load(saved):
    assert "no such checkpoint" in _refused(saved / "adamw", step=7)
    manager, _ = _loader("shampoo")
    manager.directory = saved / "shampoo"
    assert manager.load().step == 2  # the same settings load


def test_every_rank_refuses_together(world, saved, tmp_path):
    """Only rank 1's view is damaged (as if its file system lagged): both ranks refuse."""
    directory = tmp_path / "copy"
    shutil.copytree(saved / "adamw", directory)
    shutil.copytree(saved / "adamw", tmp_path / "damaged")
    _truncate(_biggest(tmp_path / "damaged" / "step-2"), 10)
    messages = world(2).run(_refused_per_rank, str(directory), str(tmp_path / "damaged"))
    for m in messages:
        assert "is truncated" in m, m


def _refused_per_rank(good, damaged):
    return _refused(Path(damaged if dist.get_rank() == 1 else good))


# --- a save that fails on one rank ------------------------------------------------------------


def _no_space(*args):
    raise OSError(28, "No space left on device")


def _fails_on_rank_0(directory: str, where: str, async_save: bool):
    """Rank 0 alone fails to prepare the save's folder (its `directory` is a file) or to
    commit it (the manifest write fails): (each rank's error, its cause, seconds to raise,
    the steps after the world saved again)."""
    model, opt, sched = make("adamw")
    target = Path(directory) / ("a-file" if where == "prepare" else "run")
    if where == "prepare" and dist.get_rank() == 0:
        target.parent.mkdir(exist_ok=True)
        target.write_text("not a folder")
    manager = vo.CheckpointManager(
        target, model, opt, sched, async_save=async_save, timeout=timedelta(seconds=60)
    )
    if where == "commit" and dist.get_rank() == 0:
        manager._commit = _no_space  # this manager's, on rank 0 only
    start, error = time.monotonic(), None
    try:
        manager.save(2)
        manager.wait()
    except vo.CheckpointError as e:
        error = e
    assert error is not None, "the save did not fail here"
    took = time.monotonic() - start
    manager.__dict__.pop("_commit", None)
    manager.directory = Path(directory) / "run"
    manager.save(3)  # the world goes on
    manager.close()
    return str(error), type(error.__cause__).__name__, took, manager.steps()


@pytest.mark.parametrize(("where", "async_save"), [("prepare", False), ("commit", False), ("commit", True)])
def test_a_save_failing_on_rank_0_raises_on_every_rank(world, tmp_path, where, async_save):
    results = world(2).run(_fails_on_rank_0, str(tmp_path), where, async_save, timeout=60)
    cause = "FileExistsError" if where == "prepare" else "OSError"
    for rank, (message, chained, took, steps) in enumerate(results):
        assert "step-2 failed: rank 0: " + cause in message, message
        assert where == "prepare" or "No space left on device" in message, message
        assert chained == (cause if rank == 0 else "NoneType")  # the failed rank's own error is chained
        assert took < 15, took  # not the process group's timeout
        assert steps == [3]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-3"]


# --- a save behind a newer checkpoint, a load that fails halfway --------------------------------


def test_a_save_behind_a_newer_checkpoint_warns_once(tmp_path):
    model, opt, sched = make("adamw")
    manager = vo.CheckpointManager(tmp_path, model, opt, sched, keep=None)
    manager.save(10)
    manager.save(20)
    manager.load(10)
    rewind = r"newer checkpoints \['step-20'\]: latest\(\) and load\(\) still choose step-20"
    with pytest.warns(UserWarning, match=rewind):
        manager.save(11)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        manager.save(12)  # said once
        manager.save(20)  # the same step again: no rewind
    assert manager.steps() == [10, 11, 12, 20]


def test_a_stateful_failing_to_load_says_what_was_loaded(saved):
    manager, (model, opt, sched, counter) = _loader()
    manager.directory = saved / "adamw"

    def refuse(state):
        raise ValueError("no such position")

    counter.load_state_dict = refuse
    with pytest.raises(vo.CheckpointError, match="incomplete") as info:
        manager.load(2)
    assert (
        "stateful['counter']'s load_state_dict failed (ValueError: no such position); the model, the "
        "optimizer, the LR scheduler were loaded already"
    ) in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)
