"""Which parameters form each unit, and each unit laid out: the runtime's plan at construction.

`plan_units` groups the parameters into units: one per listed module with `shard_modules`
(`assign`), else size-capped buckets per dtype, device and param group (over FSDP2's shards a
large local shard in a unit of its own: `fsdp_shards.own_unit`). `build_units` lays out each
unit from the optimizer's `Declaration` of every parameter (its granule, state tier and
alignment, besides the config's alignment and the wire codecs' blocks) and cuts it into
`Segment`s, one per param group and state tier.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..shard.layout import bucket_indices, plan_layout, whole_blocks
from .assign import assign_units, outermost
from .config import ShardingConfig
from .fsdp_shards import own_unit
from .segment import Segment
from .tensor_parallel import local_numel
from .unit import Unit, UnitComms


@dataclass(frozen=True)
class Declaration:
    """What the optimizer says of one parameter: rank boundaries inside it fall on multiples
    of `granule` elements; its state lives in `tier` (segments are per param group and
    tier; `FROZEN` for parameters without state); it starts at a multiple of `align`
    (besides the config's own alignment: 8-bit state starts on a quantization block)."""

    granule: int
    tier: str
    align: int = 1


def device_problem(params: Sequence[torch.Tensor], comm, labels: dict[int, str]) -> str | None:
    """A parameter on another kind of device than the group moves (CPU parameters over
    NCCL), named, instead of a raw error from inside the first collective."""
    if not comm.active:
        return None
    for p in params:
        if not p.is_meta and p.device.type != comm.device.type:
            return (
                f"parameter {labels[id(p)]} is on {p.device}, but the process group ({comm.backend}) moves "
                f"{comm.device.type} tensors; move the model to {comm.device} before building the optimizer "
                "(model.to(device)), or build it on the meta device and pass device="
            )
    return None


@dataclass(frozen=True)
class UnitPlan:
    """Per unit its parameters' indices (`members`) and its module (`modules`, None for a
    bucket); each parameter's name by index (`names`); the modules `shard_modules` listed
    (`listed`) and the outermost of them (`root`, None without)."""

    members: list[list[int]] = field(default_factory=list)
    modules: list[nn.Module | None] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)
    listed: list[nn.Module] = field(default_factory=list)
    root: nn.Module | None = None

    @property
    def structure(self) -> list[tuple[str | None, list[int]]]:
        """What the ranks agree on: each unit's module class and parameter indices."""
        return [
            (type(m).__name__ if m is not None else None, idx) for idx, m in zip(self.members, self.modules)
        ]


def plan_units(
    params: list[torch.Tensor],
    param_groups: list[dict],
    config: ShardingConfig,
    labels: dict[int, str],
    over: bool,
) -> UnitPlan:
    """Which parameters (by index) form each unit (`over` FSDP2's shards, a large one alone:
    `own_unit`); ValueError for a parameter on the meta device without `shard_modules`."""
    if config.shard_modules is not None:
        unit_of, listed, names = assign_units(params, config.shard_modules)
        order = sorted(set(unit_of), key=unit_of.index)  # by first parameter: model order
        members = [[i for i, u in enumerate(unit_of) if u == k] for k in order]
        return UnitPlan(members, [listed[k] for k in order], names, listed, outermost(listed))
    for p in params:
        if p.is_meta:
            raise ValueError(
                f"parameter {labels[id(p)]} is on the meta device; building a model there needs "
                "shard_modules, whose modules' reset_parameters() initialise it"
            )
    # a bucket per param group too: groups may keep different state (a momentum here, two
    # moments there), and each bucket's layout gives every rank 1/W of its elements, so of its state
    group = {id(p): gi for gi, g in enumerate(param_groups) for p in g["params"]}
    keys = [i if over and own_unit(p) else (p.dtype, p.device, group[id(p)]) for i, p in enumerate(params)]
    members = bucket_indices([local_numel(p) for p in params], keys, config.bucket_cap_numel)
    return UnitPlan(members, [None] * len(members), {i: labels[id(p)] for i, p in enumerate(params)})


def unit_name(k: int, module: nn.Module | None, root: nn.Module | None) -> str:
    """How unit `k` is named: its module's name under `root`, else its class and index, or
    `bucket{k}`."""
    if module is None:
        return f"bucket{k}"
    if root is not None and module is not root:
        for name, m in root.named_modules():
            if m is module:
                return name
    return f"{type(module).__name__}[{k}]"


def build_units(
    plan: UnitPlan,
    params: list[torch.Tensor],
    param_groups: list[dict],
    declare: Callable[[torch.Tensor, int], Declaration],
    comms: UnitComms,
    config: ShardingConfig,
    labels: dict[int, str],
    external: bool,
) -> tuple[list[Unit], list[Segment]]:
    """Every unit of `plan`, laid out from each parameter's `Declaration`, and its segments
    (one per param group and state tier, in order of first appearance)."""
    group_of = {id(p): gi for gi, g in enumerate(param_groups) for p in g["params"]}
    index = {id(p): i for i, p in enumerate(params)}
    units: list[Unit] = []
    segments: list[Segment] = []
    for k, (idx, module) in enumerate(zip(plan.members, plan.modules)):
        ps, names = [params[i] for i in idx], [plan.names[i] for i in idx]
        declared = [declare(p, group_of[id(p)]) for p in ps]
        keys = [(group_of[id(p)], d.tier) for p, d in zip(ps, declared)]
        named = [_label(p, name, labels, config) for p, name in zip(ps, names)]
        layout = _layout(ps, declared, keys, comms.shard.world_size, config)
        name = unit_name(k, module, plan.root)
        unit = Unit(ps, names, layout, comms, config, index=k, name=name, labels=named, external=external)
        units.append(unit)
        for key in dict.fromkeys(keys):
            mine = [j for j, kk in enumerate(keys) if kk == key]
            group = param_groups[key[0]]
            segments.append(Segment(unit, mine, [index[id(ps[j])] for j in mine], group, key[1]))
    return units, segments


def _layout(
    ps: list[torch.Tensor], declared: list[Declaration], keys: list, world: int, config: ShardingConfig
):
    """A unit's layout over `world` ranks: each parameter's local elements, its declared granule
    and alignment, and the wire codecs' block (no rank boundary cuts one either)."""
    block = config.quantized_block or 1
    aligns = [math.lcm(config.align, d.align, block) for d in declared]
    granules = [whole_blocks(d.granule, block, local_numel(p)) for p, d in zip(ps, declared)]
    sizes = [local_numel(p) for p in ps]
    return plan_layout(sizes, granules, world, math.lcm(config.align, block), aligns=aligns, segments=keys)


def _label(p: torch.Tensor, name: str, labels: dict[int, str], config: ShardingConfig) -> str:
    """How errors name `p`: its param group's name for it, else its name in the model."""
    label = labels[id(p)]
    if label.startswith("#") and config.shard_modules is not None:
        return f"'{name}' (shape {tuple(p.shape)})"
    return label
