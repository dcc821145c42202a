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


@pytest.mark.parametrize(("local_rank", "visible", "want"), [(3, 1, 0), (5, 4, 1), (2, 8, 2)])
def test_the_nccl_device_is_local_rank_modulo_the_visible_gpus(monkeypatch, local_rank, visible, want):
    """A launcher that shows each process only its own GPUs (SLURM's --gpus-per-task=1: local
    rank 3 sees one, cuda:0) still numbers LOCAL_RANK 0, 1, ...: init_distributed takes
    LOCAL_RANK modulo the visible devices (made current and bound to the group), and the group
    device check of shard/comm asks for that same device. CUDA and the group are stood in for."""
    import vescale_optim.distributed as vd
    from vescale_optim.shard.comm import _group_device

    made = {}
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", str(local_rank))):
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setattr(vd, "_joined", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: made.setdefault("current", d))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: made.update(backend=backend, **kw))
    device = vo.init_distributed()
    assert device == torch.device("cuda", want) == made["current"] == made["device_id"]
    assert made["backend"] == "nccl"
    monkeypatch.setattr(torch.cuda, "current_device", lambda: want)
    assert _group_device(None, "nccl") == torch.device("cuda", want)
    if visible > 1:  # another current device would share a GPU with another rank
        monkeypatch.setattr(torch.cuda, "current_device", lambda: (want + 1) % visible)
        with pytest.raises(RuntimeError, match=rf"set_device\({want}\)"):
            _group_device(None, "nccl")


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
            env = {
                **os.environ,
                "PYTHONPATH": str(ROOT),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(server.port),
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_RESTART_COUNT": str(attempt),
                "CUDA_VISIBLE_DEVICES": "",
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
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
