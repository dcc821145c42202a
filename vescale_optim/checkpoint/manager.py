"""Checkpoints of a training run: atomic, resumable at any world size, optionally asynchronous.

`CheckpointManager` saves the model's parameters and buffers, the optimizer's state and
param groups, an LR scheduler, every rank's random states, `stateful` objects (anything
with `state_dict()` / `load_state_dict()`) and user `extra` values through
`torch.distributed.checkpoint` into `DIR/step-N/`. Each rank writes only its own pieces
and a load at another world size or mesh reshards them.

A save is written under a hidden temporary name and renamed by rank 0 once every rank
has written its part, so a crash in the middle of a save leaves the earlier checkpoints
as they were, and the newest `step-N` is always complete. A load checks what it can
before it changes anything (the manifest, DCP's metadata, every file's size, the
optimizer's class and state-shaping hyperparameters, the model's names and shapes),
reads into new CPU buffers, and only then writes them into the live objects.

Every file's size and checksum (`checksum.ALGORITHM`) are computed from the bytes as they
are written, on the thread that writes them (an asynchronous save's writer thread, off the
training thread), and recorded in the manifest. A load verifies them before anything
else, the files shared out over the ranks (each reads its share once) and the verdict
agreed by every rank, so a damaged file is a `CheckpointError` on every rank naming the
file and the step. `latest()` and `load()` without a step choose the newest checkpoint that
is complete and verifies; `load()` warns about the newer ones it skipped.

A save stages its state in host memory first (`staging.HostStager`): CUDA tensors by
non-blocking copies into pinned buffers kept for the next save, with one device
synchronisation a save; CPU tensors as before. DCP then writes plain CPU memory, so an
asynchronous save's writer thread does no CUDA work.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from ..shard import handle
from ..shard.collectives import Comm, all_gather_object
from . import checksum, outcome
from . import manifest as _manifest
from .dcp_tree import blank, check_files, map_leaves, take
from .manifest import BY_NAME, MANIFEST, fsync_dir
from .outcome import CheckpointError
from .parts import Parts
from .rng import rng_state, set_rng_state
from .staging import HostStager, StagingStats, on_device
from .verdict import Verifier, refused

_NAME = re.compile(r"step-(\d+)")


@dataclass(frozen=True)
class Loaded:
    """What `CheckpointManager.load` restored: the step, its folder and the saved `extra`."""

    step: int
    path: Path
    extra: dict


class _Blob:
    """A value DCP keeps as one pickled item (scheduler state, extras, random states)."""

    def __init__(self, value):
        self.value = value


@contextlib.contextmanager
def _quiet():
    """Without a process group DCP says it works in one process, each time: we know."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class CheckpointManager:
    """Save and resume a training run in `directory/step-N/`; every call is collective.

    `model` and `optimizer` (a vescale_optim optimizer, with or without `shard_modules`,
    any mesh) are always saved: one of each, or, as torchtitan's checkpointer takes them,
    a list of model parts with one optimizer each (this rank's pipeline stages, each part
    the model with the modules other stages own deleted, so its names are the whole
    model's; each optimizer over its stage's data-parallel ranks). Parameters and
    optimizer state are keyed by parameter name, so the stages' parts merge into one
    checkpoint that loads at another pipeline degree, data-parallel size or without
    pipelining. Also saved: `scheduler` when given, `stateful` objects (by name) with
    their `state_dict()`, which every rank has the same (rank 0's is kept), and each
    rank's random states (torch's, CUDA's when in use, Python's, numpy's; restored when
    the world size is unchanged). `keep` is how many checkpoints up to the newest stay
    (None: all). With `async_save=True` a save copies this rank's pieces to CPU and
    writes them in a background thread over a gloo process group of its own (created
    here, with `timeout`), while training goes on. `directory` must be one that every
    rank sees.

    Every save stages CUDA state in pinned CPU buffers, allocated by the first save and
    reused by the next ones (`last_staging.pinned_bytes`; `close()` frees them), with
    one synchronisation a save; `last_staging` tells what the last save's staging did
    and how long it took.

    With `verify=True` (the default) every save records each file's checksum, computed as
    it is written, and every load checks them (each rank reads its share of the files once
    more: about one extra read of the checkpoint over the world, see
    `benchmarks/checkpoint.py`); a damaged checkpoint raises `CheckpointError` when its step
    is asked for and is skipped, with a warning, by `load()` without a step. `verify=False`
    records sizes only and checks sizes only.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        model: nn.Module | list[nn.Module],
        optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
        scheduler=None,
        *,
        stateful: Mapping[str, object] | None = None,
        keep: int | None = 3,
        async_save: bool = False,
        timeout: timedelta | None = None,
        verify: bool = True,
    ):
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be a positive number of checkpoints or None, not {keep!r}")
        stateful = dict(stateful or {})
        for name, obj in stateful.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"stateful[{name!r}] has no state_dict() and load_state_dict()")
        self.directory, self.model, self.optimizer = Path(directory), model, optimizer
        self.scheduler, self.stateful, self.keep, self.async_save = scheduler, stateful, keep, async_save
        self.verify = bool(verify)
        self._distributed = handle.initialized()
        self.rank = handle.group_rank() if self._distributed else 0
        self.world_size = handle.group_size() if self._distributed else 1
        self._parts = Parts(model, optimizer)
        self._group = None
        self._comm = Comm()  # the main thread's exchanges of verdicts (the default group)
        self._world = self._parts.agree(self._comm)  # every stage's groups and model, for manifests
        self._verifier = Verifier(self._comm, self.verify)
        if async_save and self._distributed:  # DCP's collectives from the background thread
            self._group = handle.new_group(backend="gloo", timeout=timeout)
        self._pending: tuple[Future, Path] | None = None  # an asynchronous save and its folder
        self._rewinds: set[int] = set()  # newer checkpoints a save was already warned about
        self._skipped: set[int] = set()  # newer checkpoints a load skipped as damaged or incomplete
        self._thread: ThreadPoolExecutor | None = None  # the asynchronous saves' writer
        self._stager = HostStager()

    @property
    def last_staging(self) -> StagingStats | None:
        """What the last save's staging did on this rank (None before the first save):
        `seconds` it held training up, bytes copied from the device (`device_bytes`) or
        on the CPU (`copied_bytes`), the pinned buffers kept (`pinned_bytes`) and those it
        allocated (`new_pinned_bytes`, 0 when it reused them all), `syncs` waited for."""
        return self._stager.last

    # --- where checkpoints are ----------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints in the directory, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [
            int(m[1])
            for d in self.directory.iterdir()
            if (m := _NAME.fullmatch(d.name)) and (d / MANIFEST).is_file()
        ]
        return sorted(found)

    def latest(self) -> int | None:
        """The step of the newest checkpoint that is complete and verifies (every file of
        its manifest there, of its size and checksum), or None (collective: rank 0's list of
        steps, newest first, each verified by the ranks sharing its files out until one is
        sound, the verdict agreed; verdicts are kept while the files are unchanged, so a
        `load()` that follows does not read them again)."""
        newest_first = self._agree(self.steps()[::-1] if self.rank == 0 else None)
        return self._verifier.newest(newest_first, self.path)[0]

    def path(self, step: int) -> Path:
        return self.directory / f"step-{step}"

    # --- saving -------------------------------------------------------------------------

    def _state(self, extra, rng_ranks: list[int], by_index: bool = False) -> dict:
        """What a checkpoint holds, as DCP sees it: live pieces and tensors, no copies
        (`by_index`: the optimizer state in the layout of manifests of format 1 and 2)."""
        model, optim = self._parts.state(by_index)
        sd = {
            "model": model,
            "optim": optim,
            "extra": _Blob(extra),
            "rng": {str(r): _Blob(rng_state() if r == self.rank else None) for r in rng_ranks},
        }
        if self.scheduler is not None:
            sd["scheduler"] = _Blob(self.scheduler.state_dict())
        if self.stateful:
            sd["stateful"] = {name: _Blob(obj.state_dict()) for name, obj in self.stateful.items()}
        return sd

    def _describe(self, step: int) -> dict:
        return _manifest.describe(step, self.world_size, self._world, self.scheduler, list(self.stateful))

    def _settle(self, error: BaseException | None, final: Path) -> None:
        """Where the ranks wait for each other: each one's outcome, so that a failure on
        any rank raises on every rank (the failed one's chained to its own error)."""
        failed = outcome.failures(error, self.rank, self._group, self._distributed)
        if failed:
            raise CheckpointError(f"saving {final} failed: {'; '.join(failed)}") from error

    def _warn_rewind(self, step: int) -> None:
        """Rank 0: complete checkpoints newer than `step` mean the run went back (a load
        of an older step); `latest()` would resume from them. Said once for each."""
        newer = [s for s in self.steps() if s > step and s not in self._skipped]
        if set(newer) - self._rewinds:
            self._rewinds.update(newer)
            warnings.warn(
                f"saving step {step} while {self.directory} holds newer checkpoints "
                f"{[f'step-{s}' for s in newer]}: latest() and load() still choose "
                f"step-{newer[-1]}; remove them to resume from this run",
                stacklevel=3,
            )

    def save(self, step: int, *, extra: dict | None = None) -> Path:
        """Save everything as `step` (collective); returns the folder it becomes.

        `extra`: values every rank has the same (picklable, tensors too), returned by
        `load()`. Synchronous saves return once the folder is complete; asynchronous ones
        once this rank's pieces are copied to CPU (`wait()` for the rest). A previous
        asynchronous save is finished first.
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, not {step!r}")
        self.wait()
        final, tmp = self.path(step), self.directory / f".step-{step}.tmp"
        error = None
        if self.rank == 0:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._warn_rewind(step)
                for stale in self.directory.glob(".step-*"):  # left by a save that never finished
                    shutil.rmtree(stale, ignore_errors=True)
                tmp.mkdir()
            except Exception as e:  # noqa: BLE001 - every rank raises it, in _settle
                error = e
        self._settle(error, final)
        sd = self._state(dict(extra or {}), [self.rank])
        manifest = self._describe(step) if self.rank == 0 else None
        staged = self._stager.stage(sd, asynchronous=self.async_save)
        if not self.async_save:
            try:
                files = self._write(staged, tmp)
                if self.rank == 0:
                    self._commit(tmp, final, self._with_files(manifest, files))
            except (Exception, dcp.CheckpointException) as e:  # DCP's own is a BaseException
                error = e
            self._settle(error, final)
            return final
        device = self._stager.last.device
        if device is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            device = torch.cuda.current_device()

        def write() -> Path:  # on the writer thread: the staged state is plain CPU memory
            with on_device(device):
                files = self._write(staged, tmp)  # checksums computed here, on this thread
            if self.rank == 0:
                self._commit(tmp, final, self._with_files(manifest, files))
            return final

        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vescale-checkpoint")
        self._pending = (self._thread.submit(write), final)
        return final

    def _write(self, staged: dict, tmp: Path) -> dict[str, tuple[int, str | None]]:
        """DCP writes this rank's part of the staged state into `tmp` (collective); on rank
        0 (DCP's coordinator), every file of the checkpoint with its size and checksum."""
        writer = checksum.SummingWriter(tmp, checksums=self.verify)
        with _quiet():
            dcp.save(staged, storage_writer=writer, process_group=self._group, no_dist=not self._distributed)
        return writer.files

    def _with_files(self, manifest: dict, files: dict[str, tuple[int, str | None]]) -> dict:
        """The manifest with the files the save wrote: name -> [bytes, checksum or None]."""
        table = {name: [size, digest] for name, (size, digest) in sorted(files.items())}
        return {**manifest, "checksum": checksum.ALGORITHM if self.verify else None, "files": table}

    def _commit(self, tmp: Path, final: Path, manifest: dict) -> None:
        """Rank 0, once every rank's part is written: the manifest, then the name."""
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1, default=repr)
            f.flush()
            os.fsync(f.fileno())
        old = None
        if final.exists():  # the same step saved again: the new one replaces it
            old = final.with_name(f".{final.name}.old")
            final.rename(old)
        try:
            tmp.rename(final)
        except OSError:
            if old is not None:  # the one it was to replace stays
                old.rename(final)
            raise
        fsync_dir(self.directory)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        if self.keep is not None:
            older = [s for s in self.steps() if s < manifest["step"]]
            for s in older[: max(0, len(older) - (self.keep - 1))]:
                shutil.rmtree(self.path(s), ignore_errors=True)

    def wait(self) -> None:
        """Finish an asynchronous save (collective when one was in flight): when it
        returns, the checkpoint is complete and named on every rank. A failure on any rank
        (rank 0's commit included) raises `CheckpointError` on every rank."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        error = None
        try:
            pending[0].result()
        except (Exception, dcp.CheckpointException) as e:  # DCP's own is a BaseException
            error = e
        self._settle(error, pending[1])

    def close(self) -> None:
        """Finish any asynchronous save; free the staging buffers and the writer thread
        (a later save makes them again), even when the save failed."""
        try:
            self.wait()
        finally:
            self._stager.release()
            if self._thread is not None:
                self._thread.shutdown()
                self._thread = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()

    # --- loading ------------------------------------------------------------------------

    def _agree(self, value):
        """Rank 0's `value` on every rank."""
        return all_gather_object(value, self._comm)[0]

    def _refuse(self, path: Path, step: int, problems: list[str]) -> None:
        """Raise on every rank if any rank found a problem (so none goes on alone)."""
        problems = list(dict.fromkeys(p for mine in all_gather_object(problems, self._comm) for p in mine))
        if problems:
            raise refused(path, step, problems)

    def load(self, step: int | None = None) -> Loaded | None:
        """Restore the checkpoint of `step`, by default the newest one that is complete and
        verifies (collective). Returns what was loaded, or None when `step` is None and there
        is no checkpoint.

        A checkpoint that is incomplete or damaged (a file missing, of another size, or whose
        bytes do not match the checksum the manifest recorded), or that does not fit these
        objects, raises `CheckpointError` on every rank, naming the step and the file,
        before anything is changed. Without `step`, damaged or incomplete newer checkpoints
        are skipped with a warning naming each and what is wrong with it, and the newest
        sound one is loaded; if there are checkpoints but none is sound, that raises (it
        is not a fresh start). A sound checkpoint that does not fit raises either way."""
        self.wait()
        steps, step = self._agree((self.steps()[::-1] if self.rank == 0 and step is None else [], step))
        found = self._verifier.choose(self.directory, step, steps, self.path, self._describe)
        if found is None:
            return None
        chosen, manifest = found
        if step is None:  # the newer ones are not sound: a save after this is no rewind
            self._skipped.update(s for s in steps if s > chosen)
        path = self.path(chosen)
        same_world = manifest["world_size"] == self.world_size
        live = self._state(None, [self.rank] if same_world else [], manifest["format"] < BY_NAME)
        self._refuse(path, chosen, check_files(path, live))
        loaded = map_leaves(live, blank)
        try:
            with _quiet():
                dcp.load(loaded, checkpoint_id=path, process_group=self._group, no_dist=not self._distributed)
            self._parts.validate(loaded["optim"])
        except (Exception, dcp.CheckpointException) as e:  # DCP's own is a BaseException
            raise refused(path, chosen, [outcome.reason(e)]) from e
        with torch.no_grad():
            take(live, loaded)
        self._parts.load(live["model"], live["optim"])
        rest = [(f"stateful[{n!r}]", obj, loaded["stateful"][n].value) for n, obj in self.stateful.items()]
        if self.scheduler is not None:
            rest.insert(0, ("the LR scheduler", self.scheduler, loaded["scheduler"].value))
        outcome.load_rest(path, rest)
        if same_world:
            set_rng_state(loaded["rng"][str(self.rank)].value)
        elif self.rank == 0:
            warnings.warn(
                f"{path} was saved by {manifest['world_size']} ranks and is loaded by "
                f"{self.world_size}: the random states are not restored",
                stacklevel=2,
            )
        return Loaded(chosen, path, loaded["extra"].value)


__all__ = ["CheckpointError", "CheckpointManager", "Loaded"]
