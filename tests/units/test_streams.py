"""Streams and communicators of a unit's collectives (`units/streams.py`), on CPU.

- Reductions run on a communicator of their own on NCCL only (`reduction_comm`), made once
  per process group by `handle.duplicate_group`; gloo keeps one group.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from _tiny_gpt import build

import vescale_optim as vo
from vescale_optim.units import streams as streams_module
from vescale_optim.units.streams import reduction_comm, separate_reductions

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
