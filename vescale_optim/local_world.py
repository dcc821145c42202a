"""Local CPU worlds: N gloo ranks as processes on this machine, for tests, benchmarks and the demo.

    with LocalWorld(4) as world:            # 4 ranks in one gloo process group, kept alive
        world.run(fn, x, timeout=60)        # [fn(x) on rank 0, ..., fn(x) on rank 3]
        world.run(other)                    # the same processes again
    run_local(fn, 4, x)                     # a fresh world for one call, closed after it

Ranks are forked from multiprocessing's fork server, which imports torch (and `preload`) once,
so a rank starts in a fraction of a second instead of importing torch again; the list only
counts before the server starts (the first world of a process). Each rank sets
`torch.set_num_threads(threads)` (default: this process's CPUs shared out among the ranks) and
joins a gloo group through a file store in a temporary folder (or a TCP store on localhost).
`fn` and its arguments must be picklable (a module-level function); results come back pickled
by value.

Every failure is the call's: a rank that raises fails it with a `RankError` holding that rank's
traceback (the lowest such rank; the others get `GRACE` seconds to answer, after which the
world is killed, since they may be stuck in a collective with it); a rank that dies without
answering fails it the same way; a call that does not finish within `timeout` seconds kills
the world and raises `TimeoutError`, so a hang ends as an error rather than a stuck job.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

__all__ = ["GRACE", "LocalWorld", "RankError", "cpus", "run_local", "threads_per_rank"]

GRACE = 10.0  # seconds the other ranks get to answer once one has failed


def cpus() -> int:
    """CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_per_rank(size: int) -> int:
    """This process's CPUs shared out among `size` ranks, at least one each."""
    return max(1, cpus() // size)


class RankError(RuntimeError):
    """A rank of a local world failed a call: `rank` is which, `details` its traceback."""

    def __init__(self, rank: int, size: int, details: str):
        super().__init__(f"rank {rank} of {size} failed:\n{details}")
        self.rank, self.details = rank, details


def _worker(
    rank: int, size: int, init_method: str, threads: int, collective_timeout: float, tasks, results
) -> None:
    """One rank: join the group, answer `ready`, then run tasks until told to stop (None)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=collective_timeout),
        )
    except BaseException:  # noqa: BLE001 - the traceback goes back to the parent
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, pickle.dumps(torch.get_num_threads())))
    try:
        while (task := tasks.get()) is not None:
            try:
                fn, args, kwargs = pickle.loads(task)
                answer = (rank, True, pickle.dumps(fn(*args, **kwargs)))
            except BaseException:  # noqa: BLE001 - the traceback goes back to the parent
                answer = (rank, False, traceback.format_exc())
            results.put(answer)
    finally:
        dist.destroy_process_group()


def _init_method(store: str, folder: str) -> str:
    if store == "file":
        return f"file://{os.path.join(folder, 'store')}"
    if store == "tcp":
        with socket.socket() as s:  # a free port now; the store binds it a moment later
            s.bind(("127.0.0.1", 0))
            return f"tcp://127.0.0.1:{s.getsockname()[1]}"
    raise ValueError(f"store must be 'file' or 'tcp', got {store!r}")


class LocalWorld:
    """`size` ranks in one gloo process group, kept alive across calls (see the module's
    docstring). `threads` is the list of each rank's `torch.get_num_threads()`."""

    def __init__(
        self,
        size: int,
        *,
        threads: int | None = None,
        preload: Sequence[str] = (),
        store: str = "file",
        start_timeout: float = 120.0,
        collective_timeout: float = 120.0,
    ):
        if size < 1:
            raise ValueError(f"a world needs at least one rank, got {size}")
        self.size, self._closed = size, False
        self._dir = tempfile.TemporaryDirectory(prefix="vo_world_")
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", __name__, *preload])
        init = _init_method(store, self._dir.name)
        threads = threads_per_rank(size) if threads is None else threads
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, size, init, threads, collective_timeout, self._tasks[r], self._results),
                daemon=True,
                name=f"rank-{r}-of-{size}",
            )
            for r in range(size)
        ]
        try:
            for p in self._procs:
                p.start()
            self.threads: list[int] = self._collect(start_timeout, "start")
        except BaseException:
            self.kill()
            raise

    def __enter__(self) -> LocalWorld:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return not self._closed and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = 120.0, **kwargs: Any) -> list:
        """Run `fn(*args, **kwargs)` on every rank; return the results in rank order.
        `timeout=None` waits as long as the ranks live."""
        if not self.alive:
            raise RuntimeError(f"world of {self.size} ranks is no longer alive")
        task = pickle.dumps((fn, args, kwargs))  # here, so that what cannot travel fails here
        for q in self._tasks:
            q.put(task)
        return self._collect(timeout, "finish")

    def _collect(self, timeout: float | None, what: str) -> list:
        """Every rank's answer, or the first failure (see the module's docstring)."""
        out: dict[int, bytes] = {}
        errors: dict[int, str] = {}
        start = time.monotonic()
        grace_end = None
        while len(out) + len(errors) < self.size:
            try:
                rank, ok, payload = self._results.get(timeout=1.0)
            except queue.Empty:
                now, missing = time.monotonic(), self._missing(out, errors)
                for r in missing:
                    if not self._procs[r].is_alive():
                        code = self._procs[r].exitcode
                        errors[r] = f"the process exited (code {code}) without answering"
                if errors and grace_end is None:
                    grace_end = now + GRACE
                if grace_end is not None and now >= grace_end:
                    break
                if grace_end is None and timeout is not None and now - start >= timeout:
                    self.kill()
                    raise TimeoutError(
                        f"ranks {missing} of a {self.size}-rank world did not {what} within {timeout:g} s"
                    ) from None
                continue
            if ok:
                out[rank] = payload
            else:
                errors[rank] = payload
                grace_end = grace_end or time.monotonic() + GRACE
        if errors:
            if self._missing(out, errors):
                self.kill()
            rank = min(errors)
            raise RankError(rank, self.size, errors[rank])
        return [pickle.loads(out[r]) for r in range(self.size)]

    def _missing(self, out: dict, errors: dict) -> list[int]:
        return [r for r in range(self.size) if r not in out and r not in errors]

    def kill(self) -> None:
        """End every rank at once: for a world broken on purpose (a rank left a collective)."""
        for p in self._procs:
            if p.is_alive():
                p.kill()
        self.close()

    def close(self) -> None:
        """Ask every rank to leave its group and exit; kill those that do not within 5 s."""
        if self._closed:
            return
        self._closed = True
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                with contextlib.suppress(OSError, ValueError):
                    q.put(None)
        for p in self._procs:
            if p.pid is None:
                continue
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for q in (*self._tasks, self._results):
            q.close()
        self._dir.cleanup()


def run_local(
    fn: Callable[..., Any],
    size: int,
    *args: Any,
    timeout: float | None = None,
    threads: int | None = None,
    preload: Sequence[str] = (),
    store: str = "file",
    collective_timeout: float = 900.0,
    **kwargs: Any,
) -> list:
    """`fn(*args, **kwargs)` on every rank of a fresh `size`-rank world, closed afterwards: each call
    gets new processes, so per-process measurements (peak RSS) do not mix."""
    with LocalWorld(
        size, threads=threads, preload=preload, store=store, collective_timeout=collective_timeout
    ) as world:
        return world.run(fn, *args, timeout=timeout, **kwargs)
