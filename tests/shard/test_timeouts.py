"""Bounded hangs: a rank that skips a collective makes the others fail within
`set_collective_timeout`, and a rank that dies makes them fail at once; either way the
error names the operation. Each case breaks its world, so each gets its own."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch
from _tiny_gpt import batch, build, loss_fn
from _world import World

import vescale_optim as vo
from vescale_optim.shard.collectives import get_collective_timeout

TIMEOUT = 2.0


def _opt(model):
    return vo.AdamW(model.parameters(), lr=1e-2, shard_modules=[*model.layers, model])


def _skip(where: str, timeout: float | None):
    """Rank 1 leaves out one collective call (`where`); rank 0 makes it and reports how it failed."""
    import torch.distributed as dist

    vo.set_collective_timeout(timeout)
    rank = dist.get_rank()
    model = build()
    opt = _opt(model)
    if where == "step":  # both ranks run a step, then forward and backward; rank 1 skips the second step
        loss_fn(model, *batch(0, rank)).backward()
        opt.step()
        loss_fn(model, *batch(1, rank)).backward()
    if rank == 1:
        if where == "dies":  # after reporting back, as if killed
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
        return None
    start = time.monotonic()
    try:
        if where == "step":
            opt.step()
        else:
            time.sleep(1.0 if where == "dies" else 0.0)
            loss_fn(model, *batch(0, rank)).backward()
    except vo.CollectiveError as e:
        return time.monotonic() - start, str(e)
    return None


@pytest.mark.parametrize(
    "where, timeout, names",
    [
        ("forward", TIMEOUT, "all-gather of unit TinyGPT[0]'s parameters"),
        ("step", TIMEOUT, "all-reduce (any) of the step's agreement on which parameters step"),
        ("dies", None, "all-gather of unit TinyGPT[0]'s parameters"),
    ],
)
def test_a_missing_rank_fails_the_others_naming_the_collective(where, timeout, names):
    world = World(2)
    try:
        got = world.run(_skip, where, timeout, timeout=60)
    finally:
        world.kill()
    assert got[1] is None
    assert got[0] is not None, "rank 0 finished a collective that rank 1 never joined"
    elapsed, message = got[0]
    assert names in message and "did not complete on rank 0" in message, message
    assert re.search(r"\(\d[\d,]* (float32|int64) elements, group of 2 ranks\)", message), message
    if timeout is not None:
        assert f"within {timeout:g} s (set_collective_timeout)" in message
        assert timeout - 0.1 <= elapsed < timeout + 10, elapsed
    else:  # a dead peer closes the connection: no need to wait for any timeout
        assert "Connection closed by peer" in message and elapsed < 10, (elapsed, message)


def test_timeout_setting():
    assert get_collective_timeout() is None
    try:
        vo.set_collective_timeout(1.5)
        assert get_collective_timeout() == timedelta(seconds=1.5)
        vo.set_collective_timeout(timedelta(minutes=1))
        assert get_collective_timeout() == timedelta(minutes=1)
        with pytest.raises(ValueError, match="positive"):
            vo.set_collective_timeout(0)
    finally:
        vo.set_collective_timeout(None)
    assert get_collective_timeout() is None
    # one process: nothing to wait for
    model = build()
    opt = _opt(model)
    loss_fn(model, *batch(0, 0)).backward()
    opt.step()
    assert torch.isfinite(model.state_dict()["head.weight"]).all()
