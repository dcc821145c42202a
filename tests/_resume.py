"""Save a trained model and optimizer through one of the library's three checkpoint paths and
load them into a model and optimizer of another layout, as the TP resume tests do.

`kind` is "dcp" (`opt.sharded_model_state_dict` / `opt.sharded_state_dict` with
torch.distributed.checkpoint), "manager" (`vo.CheckpointManager`) or "full" (the whole model's
state and torch's `opt.state_dict()` format, held in memory). Collective: every rank calls it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp

import vescale_optim as vo


def save_and_load(kind: str, path: str, model, opt, step: int, whole: Callable, build: Callable) -> tuple:
    """`model` and `opt`, trained for `step` steps, saved through `kind` at `path`, then loaded into
    what `build(weights)` returns, `(model, opt, dp_rank)` of the new layout (`weights`: the whole
    model state for "full", else None), which is returned. `whole(model)` gives the model's whole
    state for "full"."""
    weights = saved = None
    if kind == "dcp":
        dcp.save({"model": opt.sharded_model_state_dict(model), "optim": opt.sharded_state_dict(model)},
                 checkpoint_id=path)  # fmt: skip
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
