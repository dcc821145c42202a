"""Streams and communicators of a unit's collectives (`units/streams.py`), on CPU.

- Reductions run on a communicator of their own on NCCL only (`reduction_comm`), made once
  per process group by `handle.duplicate_group`; gloo keeps one group.
- A `.grad` read under a stream other than the compute stream (issue 41, item 7): waiting
  for the reduction orders the reading stream after it, but the wait then frees the
  reduction's buffer, a block of the compute stream, which the compute stream never waited
  for. `Streams.waited_from` runs the wait with the compute stream current and makes the
  reading stream wait for it after. Shown with streams that record what they are told (a
  CPU stand-in for CUDA's), under the emulated asynchronous device, in a gloo world.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
import torch.distributed as dist
from _tiny_gpt import batch, build, loss_fn

import vescale_optim as vo
from vescale_optim.shard.handle import delayed, traced
from vescale_optim.units import streams as streams_module
from vescale_optim.units import unit as unit_module
from vescale_optim.units.streams import Streams, reduction_comm, separate_reductions


class _Stream:
    """A stream that records what it is told to wait for."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other: _Stream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")


class _RecordingStreams(Streams):
    """`Streams` as on CUDA, over recording streams: `compute` is current, unless `use`d."""

    def __init__(self, log: list, freed):
        self.device, self.cuda, self.log, self.freed = torch.device("cpu"), True, log, freed
        self.compute, self.user = _Stream("compute", log), _Stream("user", log)
        self.gather, self.reduce, self.replicas = (_Stream(n, log) for n in ("gather", "reduce", "replicas"))
        self.now = self.compute

    def current(self):
        return self.now

    @contextlib.contextmanager
    def use(self, stream):
        before, self.now = self.now, stream
        self.log.append(f"enter {stream.name}")
        try:
            yield
        finally:
            self.now = before
            self.log.append(f"leave {stream.name} (buffer freed: {self.freed()})")


def _read_grad_under_a_user_stream():
    """Backward of a 2-block model; when block 0's first gradient has accumulated (block 1's
    reduce-scatter still in flight, held back by `delayed()`), read a block 1 `.grad` under the
    user's stream. Returns what the streams were told during that read, and whether the value
    read equals `.grad` after backward."""
    log: list[str] = []
    box = {}

    def freed():  # whether block 1's gradients last reduce-scattered are freed (None: none yet)
        sent = box["unit"].grads.scattering if "unit" in box else None
        return None if sent is None else sent.untyped_storage().nbytes() == 0

    fake = _RecordingStreams(log, freed)
    made = unit_module.streams_for
    unit_module.streams_for = lambda device: fake
    try:
        model = build(layers=2)
        opt = vo.AdamW(model.parameters(), lr=1e-2, shard_modules=[*model.layers, model])
    finally:
        unit_module.streams_for = made
    box["unit"] = next(u for u in opt.units if u.name == "layers.1")
    p = box["unit"].params[0]
    seen = {}

    def read(_):
        if "value" in seen:
            return
        with fake.use(fake.user):
            del log[:]
            with traced(into=log, waits=True):
                seen["value"] = p.grad.local().clone()
        seen["log"] = list(log)

    for q in model.layers[0].parameters():
        q.register_post_accumulate_grad_hook(read)
    with delayed() as delays:
        loss_fn(model, *batch(0, dist.get_rank())).backward()
    return seen["log"], torch.equal(seen["value"], p.grad.local()), delays.held_at_wait


def test_a_grad_read_under_another_stream_frees_in_the_compute_streams_order(world):
    for log, same, held in world(2).run(_read_grad_under_a_user_stream, timeout=120):
        assert held > 0 and same, (held, same)
        # the wait (and the free it makes) runs with the compute stream current: that stream
        # waits for the reduce-scatter, and its next work is ordered after the free; then the
        # user's stream, current again, waits for the compute stream before it reads
        assert log == [
            "enter compute",
            "waited: reduce-scatter: unit layers.1's gradients",
            "leave compute (buffer freed: True)",
            "user waits for compute",
            "leave user (buffer freed: True)",
        ], log


def test_a_wait_from_the_compute_stream_changes_nothing():
    log: list[str] = []
    fake = _RecordingStreams(log, lambda: None)
    with fake.waited_from(fake.compute):
        log.append("wait")
    with fake.waited_from(None), fake.use(fake.user):  # nothing to keep in order (off CUDA)
        pass
    assert log == ["wait", "enter user", "leave user (buffer freed: None)"]


# --- the reductions' communicator ---------------------------------------------------------------


def _gloo_keeps_one_group():
    model = build(layers=2)
    opt = vo.AdamW(model.parameters(), lr=1e-2, shard_modules=[*model.layers, model])
    return all(u.reduce_comm is u.comm for u in opt.units), separate_reductions(opt.units[0].comm)


def test_gloo_reduces_on_the_gathers_group(world):
    for same, separate in world(2).run(_gloo_keeps_one_group, timeout=60):
        assert same and not separate


class _Group:
    """A process group's stand-in (kept by weak reference, as a `ProcessGroup` is)."""


def test_nccl_reduces_on_a_communicator_of_its_own_made_once_per_group(monkeypatch):
    made = []
    monkeypatch.setattr(streams_module.handle, "duplicate_group", lambda g: made.append(g) or f"copy of {g}")
    monkeypatch.setattr(streams_module, "Comm", lambda g: SimpleNamespace(group=g))

    def comm(group, device="cuda", size=4):
        return SimpleNamespace(group=group, active=size > 1, device=torch.device(device), world_size=size)

    dp, other = _Group(), _Group()
    first = reduction_comm(comm(dp))
    assert first.group == f"copy of {dp}" and reduction_comm(comm(dp)) is first
    assert reduction_comm(comm(other)).group == f"copy of {other}"
    for alone in (comm(dp, "cpu"), comm(dp, size=1)):  # gloo; a group of one
        assert reduction_comm(alone) is alone
    assert made == [dp, other]
