"""Which unit owns which parameter, from the modules listed in `shard_modules`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def outermost(modules: Sequence[nn.Module]) -> nn.Module | None:
    """The listed module that contains every other listed module, if there is one."""
    for candidate in modules:
        inside = {id(m) for m in candidate.modules()}
        if all(id(m) in inside for m in modules):
            return candidate
    return None


def module_order(modules: Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    """Every module under the listed ones, once each, in the order a model builds them
    (the outermost module's `modules()`, or each listed module's in turn), with a name
    for errors: the top module's class, then the path (`Net.layers.0.norm`)."""
    root = outermost(modules)
    seen, out = set(), []
    for top in [root] if root is not None else modules:
        for name, m in top.named_modules():
            if id(m) not in seen:
                seen.add(id(m))
                out.append((".".join(filter(None, [type(top).__name__, name])), m))
    return out


def assign_units(
    params: Sequence[torch.nn.Parameter], shard_modules: Sequence[nn.Module]
) -> tuple[list[int], list[nn.Module], dict[int, str]]:
    """Return, for each parameter, the index of its unit in `units`, the unit modules in
    the order they are listed, and a name for each parameter.

    A parameter belongs to the innermost listed module that holds it; one held by listed
    modules that do not nest (a tied embedding and head) belongs to their closest common
    listed ancestor. A parameter outside every listed module, a tie with no common listed
    ancestor, or a listed module that holds none of `params` (a module of another model, or
    one whose parameters the optimizer was not given), is a `ValueError` naming it.
    """
    listed = list(dict.fromkeys(shard_modules))  # drop repeats, keep order
    if not listed:
        raise ValueError("shard_modules is empty; list the modules to shard (e.g. [*model.layers, model])")
    inside = [{id(m) for m in top.modules()} for top in listed]
    size = [len(s) for s in inside]
    holders: dict[int, list[nn.Module]] = {}  # parameter id -> modules holding it directly
    names: dict[int, str] = {}
    root = outermost(listed)
    for top in [root] if root is not None else listed:
        for mname, module in top.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                holders.setdefault(id(p), [])
                if module not in holders[id(p)]:
                    holders[id(p)].append(module)
                names.setdefault(id(p), f"{mname}.{pname}" if mname else pname)

    def innermost(ids: set[int]) -> int | None:
        """The smallest listed module containing every module in `ids`."""
        found = [k for k, s in enumerate(inside) if ids <= s]
        return min(found, key=lambda k: size[k]) if found else None

    unit_of = []
    for i, p in enumerate(params):
        if id(p) not in holders:
            raise ValueError(
                f"parameter {i} (shape {tuple(p.shape)}) is not inside any module of shard_modules; "
                "list a module that holds it (the model itself, last, holds everything)"
            )
        homes = {innermost({id(h)}) for h in holders[id(p)]}
        if None in homes:
            raise ValueError(f"parameter '{names[id(p)]}' is not inside any module of shard_modules")
        owner = homes.pop() if len(homes) == 1 else innermost({id(listed[k]) for k in homes})
        if owner is None:
            raise ValueError(
                f"parameter '{names[id(p)]}' is shared by modules with no common module in shard_modules; "
                "list a module that contains all its uses (e.g. the model)"
            )
        unit_of.append(owner)
    given = {id(p) for p in params}
    for top in listed:
        if not any(id(p) in given for p in top.parameters()):
            k = list(shard_modules).index(top)
            raise ValueError(
                f"shard_modules[{k}] ({type(top).__name__}) holds none of the optimizer's parameters; "
                "list only modules of the model whose parameters the optimizer is given"
            )
    return unit_of, listed, {i: names[id(p)] for i, p in enumerate(params)}
