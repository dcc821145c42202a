"""A persistent local gloo world for multi-rank tests.

Each `World` keeps `size` worker processes alive, all in one gloo process group.
`world.run(fn, *args)` runs `fn(*args)` on every rank and returns the per-rank
results. A rank that raises fails the call with its traceback; a call that does not
finish within `timeout` seconds kills the world and raises `TimeoutError`, so a hang
is a test failure rather than a stuck CI.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from datetime import timedelta

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch"])


def _worker(rank: int, size: int, init_file: str, tasks, results) -> None:
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=120),
    )
    results.put((rank, True, "ready"))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - the traceback goes back to the parent
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankError(RuntimeError):
    pass


class World:
    def __init__(self, size: int, start_timeout: float = 120.0):
        self.size = size
        self._dir = tempfile.TemporaryDirectory(prefix="vo_world_")
        init_file = os.path.join(self._dir.name, "store")
        self._results = _CTX.Queue()
        self._tasks = [_CTX.Queue() for _ in range(size)]
        self._procs = [
            _CTX.Process(
                target=_worker,
                args=(r, size, init_file, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(size)
        ]
        for p in self._procs:
            p.start()
        self._collect(start_timeout)

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def run(self, fn, *args, timeout: float = 120.0, **kwargs) -> list:
        """Run `fn(*args, **kwargs)` on every rank; return the results in rank order."""
        if not self.alive:
            raise RuntimeError(f"world of {self.size} ranks is no longer alive")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        return self._collect(timeout)

    def _collect(self, timeout: float) -> list:
        out: dict[int, object] = {}
        errors: dict[int, str] = {}
        wait = timeout
        while len(out) + len(errors) < self.size:
            try:
                rank, ok, payload = self._results.get(timeout=wait)
            except queue.Empty:
                self.close()
                if errors:
                    break
                missing = sorted(set(range(self.size)) - set(out))
                raise TimeoutError(
                    f"ranks {missing} of a {self.size}-rank world did not finish in {timeout}s"
                ) from None
            if ok:
                out[rank] = payload
            else:
                errors[rank] = payload
                wait = 10.0  # the others may be stuck in a collective with the failed rank
        if errors:
            if len(out) + len(errors) < self.size:
                self.close()
            rank = min(errors)
            raise RankError(f"rank {rank} of {self.size} failed:\n{errors[rank]}")
        return [out[r] for r in range(self.size)]

    def kill(self) -> None:
        """End every rank at once: for a world broken on purpose (a rank left a collective)."""
        for p in self._procs:
            p.kill()
        self.close()

    def close(self) -> None:
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                with contextlib.suppress(OSError, ValueError):
                    q.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._dir.cleanup()


class WorldPool:
    """Lazily started worlds, one per size, closed together."""

    def __init__(self):
        self._worlds: dict[int, World] = {}

    def __call__(self, size: int) -> World:
        w = self._worlds.get(size)
        if w is None or not w.alive:
            w = self._worlds[size] = World(size)
        return w

    def close(self) -> None:
        for w in self._worlds.values():
            w.close()
        self._worlds.clear()
