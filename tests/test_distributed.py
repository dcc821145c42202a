"""`vo.init_distributed`: without a launch it starts nothing; a second call is refused; under
torchrun's shared store the ranks of an attempt agree on a generation no earlier attempt used,
whatever the earlier ones left in the store; and a restarted attempt's gloo group meets although
the dead attempt's addresses are still in the store (where plain `dist.init_process_group()`
connects to the dead rank and hangs)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import vescale_optim as vo
from vescale_optim.distributed import NAMESPACE, _generation
from vescale_optim.shard.handle import get_collective_timeout

ROOT = Path(__file__).resolve().parents[1]


def test_without_a_launch_it_starts_nothing(monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    try:
        device = vo.init_distributed(timeout=5, collective_timeout=7)
        assert get_collective_timeout() == timedelta(seconds=7)
    finally:
        vo.set_collective_timeout(None)
    cuda = torch.cuda.is_available()
    want = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    assert device == want and not dist.is_initialized()
    assert vo.init_distributed() == want  # nothing was started: nothing to refuse


def test_a_second_group_is_refused(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="joined a process group already"):
            vo.init_distributed()
    finally:
        dist.destroy_process_group()


def _attempt(port: int, world: int, timeout: float, order: list[int], delay: float) -> dict[int, object]:
    """One attempt's ranks as threads, each with its own client of the store, started in
    `order` `delay` seconds apart; what each returned (or raised)."""
    got: dict[int, object] = {}

    def rank(r: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout))
        try:
            got[r] = _generation(store, r, world, timedelta(seconds=timeout))
        except RuntimeError as e:
            got[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in order]
    for t in threads:
        t.start()
        time.sleep(delay)
    for t in threads:
        t.join(timeout + 10)
        assert not t.is_alive()
    # every rank that came answered or raised a RuntimeError (a thread dying of anything else
    # leaves no entry)
    assert sorted(got) == sorted(order), (got, order)
    return got


@pytest.mark.timeout(120)
def test_every_attempt_agrees_on_a_fresh_generation_whatever_earlier_ones_left():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    world, seen = 3, set()
    rng = random.Random(0)
    for attempt in range(6):
        if attempt % 2:  # a dead attempt: some ranks never come, rank 0 gives up (or is absent)
            present = rng.sample(range(world), rng.randint(1, world - 1))
            got = _attempt(server.port, world, 0.3, present, 0.0)
            if 0 in present:  # it answered the others that came, then gave up waiting
                assert "joined rank 0" in str(got.pop(0))
                assert len(set(got.values())) <= 1 and all(isinstance(n, int) for n in got.values()), got
                seen |= set(got.values())
            else:
                assert all("no answer from rank 0" in str(v) for v in got.values()), got
            # a dead attempt's rank 0 may also have answered tickets that no one will read
            server.set(f"{NAMESPACE}/answer/{server.add(f'{NAMESPACE}/tickets', 0) + 1000}", "999999")
            continue
        order = rng.sample(range(world), world)  # rank 0 first, last or between
        got = _attempt(server.port, world, 20, order, rng.choice([0.0, 0.05]))
        numbers = set(got.values())
        assert len(numbers) == 1 and all(isinstance(n, int) for n in numbers), got
        assert not numbers & seen, (numbers, seen)
        seen |= numbers


_RANK = """
import os, sys, time
import torch, torch.distributed as dist
import vescale_optim as vo
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt == 1 and os.environ["RANK"] == "1":
    time.sleep(1.5)  # rank 0 reads rank 1's address of the dead attempt: plain init_process_group hangs
device = vo.init_distributed(timeout=20)
x = torch.ones(1) * (attempt + 1)
dist.all_reduce(x)
print(f"attempt {attempt} rank {dist.get_rank()} device {device} sum {x.item():g}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_a_restarted_attempt_meets_although_the_dead_attempts_addresses_are_in_the_store(tmp_path):
    """torchrun's shared store, imitated: one TCPStore for two attempts of two gloo ranks."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    outs = []
    for attempt in range(2):
        procs = []
        for rank in (0, 1):
            env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": str(rank), "LOCAL_RANK": str(rank),
                   "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port),
                   "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": str(attempt),
                   "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
            procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))  # fmt: skip
        for p in procs:
            try:
                out, _ = p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                pytest.fail("a rank did not finish in 60 s")
            assert p.returncode == 0, out[-3000:]
            outs.append(out)
    text = "".join(outs)
    for attempt in range(2):
        for rank in range(2):
            assert f"attempt {attempt} rank {rank} device cpu sum {2 * (attempt + 1)}" in text, text
