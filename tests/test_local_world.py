"""The local gloo launcher shared by tests, benchmarks and the demo: results by rank, a persistent
world reused across calls, a fresh one per `run_local`, and every failure as the call's error."""

from __future__ import annotations

import os
import pickle
import time

import pytest

from vescale_optim.local_world import LocalWorld, RankError, run_local


def _whoami(tag: str) -> tuple:
    import torch
    import torch.distributed as dist

    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return tag, dist.get_rank(), dist.get_world_size(), os.getpid(), t.item(), torch.get_num_threads()


def _fail_on(rank: int) -> str:
    import torch.distributed as dist

    if dist.get_rank() == rank:
        raise ValueError(f"rank {rank} refuses")
    return "fine"


def _hang_on(rank: int) -> None:
    import torch.distributed as dist

    if dist.get_rank() == rank:
        time.sleep(600)


def _die_on(rank: int) -> None:
    import torch.distributed as dist

    if dist.get_rank() == rank:
        os._exit(3)


@pytest.mark.timeout(120)
def test_a_persistent_world_answers_by_rank_and_outlives_a_failed_call():
    with LocalWorld(2, threads=1) as world:
        first = world.run(_whoami, "a", timeout=60)
        assert [r[:3] for r in first] == [("a", 0, 2), ("a", 1, 2)]
        assert [r[4] for r in first] == [3.0, 3.0]  # the ranks share one gloo group
        assert world.threads == [1, 1] and [r[5] for r in first] == [1, 1]
        with pytest.raises(RankError, match=r"rank 1 of 2 failed:(.|\n)*ValueError: rank 1 refuses") as e:
            world.run(_fail_on, 1, timeout=60)
        assert e.value.rank == 1 and "_fail_on" in e.value.details
        assert world.alive  # every rank answered: the world stays usable
        again = world.run(_whoami, "b", timeout=60)
        assert [r[3] for r in again] == [r[3] for r in first]  # the same processes
    assert not world.alive


@pytest.mark.timeout(120)
def test_a_call_past_its_timeout_kills_the_world():
    world = LocalWorld(2, threads=1)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of a 2-rank world did not finish within 3 s"):
        world.run(_hang_on, 1, timeout=3)
    assert time.monotonic() - start < 30
    assert not world.alive
    with pytest.raises(RuntimeError, match="no longer alive"):
        world.run(_whoami, "x")


@pytest.mark.timeout(120)
def test_a_rank_that_dies_fails_the_call():
    world = LocalWorld(2, threads=1)
    with pytest.raises(RankError, match=r"rank 0 of 2 failed:\nthe process exited \(code 3\)"):
        world.run(_die_on, 0, timeout=60)
    assert not world.alive


@pytest.mark.timeout(120)
def test_run_local_starts_fresh_processes_each_call_on_either_store():
    one = run_local(_whoami, 2, "file", timeout=60, threads=1)
    two = run_local(_whoami, 2, "tcp", timeout=60, threads=1, store="tcp")
    assert [r[:3] for r in two] == [("tcp", 0, 2), ("tcp", 1, 2)] and [r[4] for r in two] == [3.0, 3.0]
    assert not {r[3] for r in one} & {r[3] for r in two}


def test_what_cannot_travel_fails_in_the_caller():
    with pytest.raises(ValueError, match="at least one rank"):
        LocalWorld(0)
    with pytest.raises(ValueError, match="store must be"):
        LocalWorld(1, store="nfs")
    with pytest.raises((pickle.PicklingError, AttributeError)):
        run_local(lambda: None, 1, timeout=60, threads=1)
