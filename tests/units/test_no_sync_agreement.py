"""`no_sync()` on some ranks only, for the same micro-batch: `NoSyncMismatchError` on every
rank, in that backward, before any reduce-scatter of it is issued, so the group goes on.

The device's run-ahead is emulated (`delayed()`: a collective runs only when waited for), and
each backward is followed by a host sync (`loss.item()`, then whatever the emulated device was
given runs, as a GPU's host sync waits for it). Before, a rank that reduced had queued a
reduce-scatter no other rank joined: the host sync blocked it until the group's timeout (the
verdict was read only at the step on CUDA), a later micro-batch's collectives paired with the
orphan, and under ZeRO-2 only the first backward of a step was checked at all.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from _reference import mean_grad_reference
from _small_model import small_loss, small_model

import vescale_optim as vo
from vescale_optim.shard.handle import delayed, run_delayed, traced

TIMEOUT_S = 10.0  # an unmatched collective fails in this time instead of the group's


def _optimizer(model, sharded: bool):
    units = dict(shard_modules=[model[0], model]) if sharded else dict(bucket_cap_numel=48)  # 2 buckets
    return vo.AdamW(model.parameters(), lr=0.01, **units)


def _mismatch(sharded: bool, micro: int, at: int):
    """`micro` micro-batches and a step; before micro-batch `at` every rank is inside
    `no_sync()`, in it rank 0 alone, after it none. Returns where this rank raised (the phase
    it was in), the trace of collectives and events, how many waits the emulation held back,
    whether the shards are unchanged, and the averaged gradient of a fresh run afterwards in
    the same group."""
    rank = dist.get_rank()
    model = small_model()
    opt = _optimizer(model, sharded)
    shards = [u.shard.clone() for u in opt.runtime.units]
    events: list[str] = []
    raised, phase = None, ""
    vo.set_collective_timeout(TIMEOUT_S)
    try:
        with delayed() as delays, traced(into=events):
            try:
                for m in range(micro):
                    quiet = m < at or (m == at and rank == 0)
                    loss = small_loss(model, m, rank)
                    phase = f"backward {m}"
                    events.append(phase)
                    with opt.no_sync() if quiet else contextlib.nullcontext():
                        loss.backward()
                    phase = f"host sync {m}"
                    loss.item()
                    run_delayed()  # what the device was given runs, as a GPU's host sync waits for it
                phase = "step"
                opt.step()
            except vo.NoSyncMismatchError as e:
                raised = (phase, str(e))
        unchanged = all(torch.equal(s, u.shard) for s, u in zip(shards, opt.runtime.units))
        # the group goes on: a fresh run in it averages its gradients right
        fresh = small_model()
        _optimizer(fresh, sharded)
        small_loss(fresh, 7, rank).backward()
        grads = {n: p.grad.full_tensor() for n, p in fresh.named_parameters()}
    finally:
        vo.set_collective_timeout(None)
    return raised, events, delays.held_at_wait, unchanged, grads


CASES = {
    "first micro-batch, host sync before the step": (1, 0),
    "micro-batch 2 of 3": (3, 1),
}


@pytest.mark.parametrize("sharded", [False, True], ids=["zero2", "zero3"])
@pytest.mark.parametrize("case", list(CASES))
def test_no_sync_on_one_rank_raises_on_every_rank_before_any_reduce_scatter(world, case, sharded):
    micro, at = CASES[case]
    results = world(2).run(_mismatch, sharded, micro, at, timeout=90)
    model = small_model()
    mean_grad_reference(model.parameters(), 2, lambda r: small_loss(model, 7, r).backward())
    for rank, (raised, events, held, unchanged, grads) in enumerate(results):
        assert held > 0, held  # the emulation held collectives back
        assert raised is not None, f"rank {rank} raised nothing"
        where, message = raised
        assert where == f"backward {at}", (rank, where)  # in that backward, on every rank
        assert "ranks [0] ran a backward inside `with opt.no_sync():` and ranks [1] did not" in message
        mismatched = events[events.index(f"backward {at}") :]
        assert not any(e.startswith("reduce-scatter") for e in mismatched), mismatched
        assert unchanged
        for n, p in model.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-6, atol=1e-7, msg=n)
    assert results[0][1] == results[1][1]  # the same collectives on both ranks: none left unmatched


def _agreed(sharded: bool, micro: int):
    """Every rank inside `no_sync()` for all micro-batches but the last: no error, one
    agreement per backward, each read before the backward's first reduce-scatter."""
    rank = dist.get_rank()
    model = small_model()
    opt = _optimizer(model, sharded)
    events: list[str] = []
    with delayed(), traced(into=events):
        for m in range(micro):
            events.append(f"backward {m}")
            with opt.no_sync() if m < micro - 1 else contextlib.nullcontext():
                small_loss(model, m, rank).backward()
        opt.step()
    return events


@pytest.mark.parametrize("sharded", [False, True], ids=["zero2", "zero3"])
def test_every_backward_agrees_once(world, sharded):
    events = world(2).run(_agreed, sharded, 3, timeout=60)[0]
    agreements = [i for i, e in enumerate(events) if "agreement on no_sync" in e]
    starts = [events.index(f"backward {m}") for m in range(3)]
    assert len(agreements) == 3 and all(s < a for s, a in zip(starts, agreements)), events
    assert not any(e.startswith("reduce-scatter") for e in events[: agreements[-1]]), events
