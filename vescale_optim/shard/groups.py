"""Process groups of part of a world, made from a parent group by all of its ranks
(`split_groups`): the one way this library makes a group that is not a whole world.

The rule: a group is made by every rank of the group it is made from, all making the same
calls in one order; never by a subset of them (its members alone). Why:

- On a world bound to a device (`init_process_group(device_id=...)`, as `vo.init_distributed`
  binds it), NCCL builds a subgroup by splitting the parent's communicator, and every rank of
  the parent takes part in the split: members calling alone wait for the others for ever.
  There the groups are torch's `split_group` of the parent, one call per layer of disjoint
  groups (`_layers`), every rank of the parent in every call.
- Otherwise (gloo; NCCL without a bound device) they are `new_group`s, every rank of the parent
  calling for every group. Over the whole default group torch names a group by a counter every
  rank advances alike. Over part of it (a `process_group=`, one dimension of a larger mesh,
  one pipeline stage) the ranks outside never call, so the call is made with
  `use_local_synchronization`, and torch then names the group after the ranks and the count of
  groups the calling process already holds: the members must hold equally many, or they wait
  under different names. So each call's groups are completed into a partition of the parent
  (every rank in none of them alone in a group of its own, `_partition`), and every call gives
  every rank of the parent exactly one group: ranks that held equally many still do.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed import ProcessGroup

from . import handle


def split_groups(
    parent: ProcessGroup | None, groups: Sequence[Sequence[int]]
) -> dict[tuple[int, ...], ProcessGroup]:
    """A process group for each of `groups` (ranks of `parent`, the default group when None;
    each ascending; groups may overlap), made from `parent` by every one of its ranks, all
    calling with the same `groups` in one order. Returns those this rank is in, by their ranks
    (a group's ranks in the order of `parent`'s). ValueError, alike on every rank, for a group
    that is empty, not ascending, repeats or leaves `parent`, or whose order torch's
    `new_group` (which orders a group by global rank) would not keep."""
    size, me = handle.group_size(parent), handle.group_rank(parent)
    wanted = list(dict.fromkeys(tuple(int(r) for r in g) for g in groups))
    for g in wanted:
        if not g or list(g) != sorted(set(g)) or g[0] < 0 or g[-1] >= size:
            raise ValueError(f"group {list(g)}: ranks must be distinct, ascending and in [0, {size})")
    pg = parent if parent is not None else handle.default_group()
    split = _splits(pg)
    whole = size == handle.group_size()  # every rank of the default group calls
    mine: dict[tuple[int, ...], ProcessGroup] = {}
    for layer in _layers(wanted):
        if split:  # one split of the parent's communicator; None on a rank in none of them
            made = handle.split_group(pg, layer)
            if made is not None:
                mine[next(g for g in layer if me in g)] = made
            continue
        for g in _partition(layer, size):
            made = _new_group(pg, whole, g)
            if me in g and g in layer:
                mine[g] = made
    return mine


def _splits(parent: ProcessGroup) -> bool:
    """Whether groups of `parent` are split from its communicator (torch's `split_group`):
    the default group is bound to a device and `parent` talks NCCL."""
    return handle.bound_device() is not None and "nccl" in handle.group_backend(parent)


def _layers(groups: list[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
    """`groups` dealt, in order, each to the first layer it shares no rank with."""
    layers: list[list[tuple[int, ...]]] = []
    for g in groups:
        layer = next((lay for lay in layers if not any(set(g) & set(h) for h in lay)), None)
        if layer is None:
            layers.append(layer := [])
        layer.append(g)
    return layers


def _partition(layer: list[tuple[int, ...]], size: int) -> list[tuple[int, ...]]:
    """`layer` (disjoint groups of ranks `0..size-1`) and every rank in none of them alone."""
    covered = {r for g in layer for r in g}
    return layer + [(r,) for r in range(size) if r not in covered]


def _new_group(parent: ProcessGroup, whole: bool, ranks: tuple[int, ...]) -> ProcessGroup | None:
    """torch's `new_group` of `parent`'s `ranks`, called by every rank of `parent` (`whole`:
    every rank of the default group; else with `use_local_synchronization`, the ranks outside
    `parent` not calling); this rank's group, or None."""
    global_ranks = [handle.global_rank(parent, r) for r in ranks]
    if global_ranks != sorted(global_ranks):
        raise ValueError(
            f"ranks {list(ranks)} of the process group are global ranks {global_ranks}: torch's new_group "
            "would order the new group by global rank, not as the process group orders them"
        )
    return handle.new_group(global_ranks, use_local_synchronization=not whole)
