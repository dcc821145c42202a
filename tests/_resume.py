"""What the resume tests share.

The runs the CheckpointManager tests save and resume (tests/checkpoint/): the tiny GPT with one of
the library's optimizers (`_fsdp_cases.make_ours`) and an lr scheduler, a stateful counter, the
training loop (optionally scaled by draws from the random generators), the whole state in torch's
format, and an exact comparison of nested states.

`save_and_load`: save a trained model and optimizer through one of the library's three checkpoint
paths and load them into a model and optimizer of another layout, as the TP resume tests do.
`kind` is "dcp" (`opt.sharded_model_state_dict` / `opt.sharded_state_dict` with
torch.distributed.checkpoint), "manager" (`vo.CheckpointManager`) or "full" (the whole model's
state and torch's `opt.state_dict()` format, held in memory). Collective: every rank calls it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _fsdp_cases import make_ours
from _tiny_gpt import batch, build, loss_fn

import vescale_optim as vo


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_and_load(kind: str, path: str, model, opt, step: int, whole: Callable, build: Callable) -> tuple:
    """`model` and `opt`, trained for `step` steps, saved through `kind` at `path`, then loaded into
    what `build(weights)` returns, `(model, opt, dp_rank)` of the new layout (`weights`: the whole
    model state for "full", else None), which is returned. `whole(model)` gives the model's whole
    state for "full"."""
    weights = saved = None
    if kind == "dcp":
        dcp.save(
            {"model": opt.sharded_model_state_dict(model), "optim": opt.sharded_state_dict(model)},
            checkpoint_id=path,
        )
    elif kind == "manager":
        vo.CheckpointManager(path, model, opt).save(step)
    else:
        weights, saved = whole(model), opt.state_dict()
    torch.distributed.barrier()
    model, opt, dp_rank = build(weights)
    if kind == "dcp":
        pieces = {"model": opt.sharded_model_state_dict(model), "optim": opt.sharded_state_dict(model)}
        dcp.load(pieces, checkpoint_id=path)
        opt.load_sharded_model_state_dict(pieces["model"])
        opt.load_sharded_state_dict(pieces["optim"], model)
    elif kind == "manager":
        assert vo.CheckpointManager(path, model, opt).load().step == step
    else:
        opt.load_state_dict(saved)
    return model, opt, dp_rank


class Counter:
    """A stateful object: how many batches this run has seen."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def make(kind, sharded=True, mesh=None, seed=0, comm_bits=None):
    """A tiny GPT (wider for 8-bit state, which needs tensors of 4096+ elements), its
    optimizer and a scheduler; `comm_bits=8`: 8-bit all-gathers and gradient reductions
    (what is saved stays full precision)."""
    model = build(seed=seed, dim=64 if kind == "adamw8" else 16)
    sharding = {"shard_modules": [*model.layers, model] if sharded else None}
    if comm_bits is not None:
        sharding.update(gather_bits=comm_bits, reduce_bits=comm_bits, comm_block=16)
    if mesh is not None:
        from torch.distributed.device_mesh import init_device_mesh

        sharding["mesh"] = init_device_mesh("cpu", mesh, mesh_dim_names=("replicate", "shard"))
    if kind == "adamw8":
        opt = vo.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), state_bits=8, **sharding)
    else:
        opt = make_ours(kind, model, **sharding)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.25 * s))
    return model, opt, sched


def train(model, opt, sched, counter, first, last, noise):
    """Steps `first`..`last`; with `noise` the loss is scaled by draws from torch's and
    Python's random generators, so the trajectory depends on the random states too."""
    for t in range(first, last):
        loss = loss_fn(model, *batch(t, _rank()))
        if noise:
            loss = loss * (1 + 0.1 * torch.rand(()).item() + 0.1 * random.random())
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        counter.n += 1


def full(model, opt, sched):
    """Everything in torch's format, copied (collective)."""
    weights = {k: v.clone() for k, v in model.state_dict().items()}  # without units: the live tensors
    return {"model": weights, "optim": opt.state_dict(), "sched": sched.state_dict()}


def assert_same(got, want, where=""):
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (where, got.keys(), want.keys())
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), where
    else:
        assert got == want, where
