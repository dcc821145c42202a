"""Which live runtime keeps a parameter in a sharded unit: between uses such a parameter's
`.data` is a stand-in, so a second optimizer over it would shard the stand-in instead of its
values; the runtime refuses it by name at construction."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

# id(parameter) -> (the parameter, the runtime whose sharded unit holds it), both weakly
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def owned_elsewhere(params: Sequence[torch.Tensor], labels: dict[int, str]) -> str | None:
    """A parameter that a live runtime (another optimizer) keeps in a sharded unit, named."""
    for p in params:
        entry = _OWNERS.get(id(p))
        if entry is not None and entry[0]() is p and entry[1]() is not None:
            return (
                f"parameter {labels[id(p)]} is already sharded by another vescale_optim optimizer "
                "(shard_modules): its unit holds the parameter's values and its hooks stay on the model, "
                "so a second one would shard a stand-in; give each parameter to one optimizer (param "
                "groups may differ in their hyperparameters; edit opt.param_groups to change "
                "them), and to start over build the model anew and load a checkpoint into it"
            )
    return None


def claim(params: Sequence[torch.Tensor], runtime: object) -> None:
    """`runtime` keeps `params` in its sharded units (for as long as both live)."""
    owner = weakref.ref(runtime)
    for p in params:
        key = id(p)
        _OWNERS[key] = (weakref.ref(p, lambda _, key=key: _OWNERS.pop(key, None)), owner)
