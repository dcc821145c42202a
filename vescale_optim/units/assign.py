"""Which unit owns which parameter, from the modules listed in `shard_modules`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def _ancestry(root: nn.Module) -> tuple[dict[int, list[int]], dict[int, str]]:
    """For every module under `root`: the ids of its ancestors (root first) and its name."""
    chains: dict[int, list[int]] = {id(root): []}
    names: dict[int, str] = {id(root): ""}
    stack = [root]
    while stack:
        module = stack.pop()
        for name, child in module.named_children():
            if id(child) in chains:
                continue
            chains[id(child)] = [*chains[id(module)], id(module)]
            names[id(child)] = f"{names[id(module)]}.{name}" if names[id(module)] else name
            stack.append(child)
    return chains, names


def outermost(modules: Sequence[nn.Module]) -> nn.Module:
    """The listed module that contains every other listed module."""
    for candidate in modules:
        inside = {id(m) for m in candidate.modules()}
        if all(id(m) in inside for m in modules):
            return candidate
    raise ValueError(
        "shard_modules must have one module that contains all the others (usually the model "
        "itself, listed last: shard_modules=[*model.layers, model])"
    )


def assign_units(
    params: Sequence[torch.nn.Parameter], shard_modules: Sequence[nn.Module]
) -> tuple[list[int], list[nn.Module], dict[int, str]]:
    """Return, for each parameter, the index of its unit in `units`, the unit modules in
    the order they are listed, and a name for each parameter.

    A parameter belongs to the innermost listed module that holds it; one held by listed
    modules that do not nest (a tied embedding and head) belongs to their closest common
    listed ancestor. A parameter outside every listed module, or a tie with no common
    listed ancestor, is a `ValueError` naming it.
    """
    if not shard_modules:
        raise ValueError("shard_modules is empty; list the modules to shard (e.g. [*model.layers, model])")
    listed = list(dict.fromkeys(shard_modules))  # drop repeats, keep order
    root = outermost(listed)
    chains, module_names = _ancestry(root)
    listed_ids = {id(m): k for k, m in enumerate(listed)}
    owners: dict[int, list[int]] = {}  # parameter id -> ids of modules holding it directly
    param_names: dict[int, str] = {}
    for module in root.modules():
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(id(module))
            prefix = module_names.get(id(module), "")
            param_names.setdefault(id(p), f"{prefix}.{pname}" if prefix else pname)
    unit_of = []
    for i, p in enumerate(params):
        holders = owners.get(id(p))
        if holders is None:
            raise ValueError(
                f"parameter {i} (shape {tuple(p.shape)}) is not inside any module of shard_modules; "
                "list a module that holds it"
            )
        name = param_names[id(p)]
        candidates = []
        for holder in holders:
            chain = [*chains[holder], holder]
            inner = [m for m in chain if m in listed_ids]
            if not inner:
                raise ValueError(f"parameter '{name}' is not inside any module of shard_modules")
            candidates.append(chain[: chain.index(inner[-1]) + 1])
        common = candidates[0]
        for chain in candidates[1:]:
            k = 0
            while k < min(len(common), len(chain)) and common[k] == chain[k]:
                k += 1
            common = common[:k]
        owner = [m for m in common if m in listed_ids]
        if not owner:
            raise ValueError(
                f"parameter '{name}' is shared by modules with no common module in shard_modules; "
                "list a module that contains all its uses (e.g. the model)"
            )
        unit_of.append(listed_ids[owner[-1]])
    return unit_of, listed, {i: param_names[id(p)] for i, p in enumerate(params)}
