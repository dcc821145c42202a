"""Whether the ranks of a tensor-parallel world applied the same TP plan, checked at construction.

Each rank describes its parameters (`tp_description`: global shape, placements, TP mesh shape;
None for a plain tensor) and names its tensor-parallel peers (the ranks of its DTensor parameters'
meshes; none without DTensors). Every rank that builds the optimizer (`checks_world`: the root world,
or a pipeline stage's dp x tp ranks) joins the exchange, whether or not it holds DTensors, so a
rank left out of the plan (a plain model on one rank, DTensors on its peers)
raises with them instead of leaving them waiting in an exchange over their TP group it never joins.
A rank sends a digest of its descriptions and its peers, one small exchange; only when some rank's
digest differs from one of its peers' do the ranks exchange the descriptions themselves, to name
the parameter. Together with the data-parallel check of the same descriptions (`optim._checks`), a
plan that differs anywhere is refused on every rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from ..shard.collectives import Comm, all_gather_object, all_reduce_
from .tensor_parallel import is_dtensor, tp_description
from .tp_view import TensorParallel


def _peers(params: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """The default-group ranks of the meshes of this rank's DTensor parameters."""
    ranks = {int(r) for p in params if is_dtensor(p) for r in p.device_mesh.mesh.reshape(-1).tolist()}
    return tuple(sorted(ranks))


def checks_world(tensor_parallel: TensorParallel, dp: Comm, all_ranks: Comm | None) -> Comm | None:
    """The ranks that build this optimizer over one model part, for the checks and random states
    that must be alike beyond the data-parallel mesh `dp` (collective over `dp`, at construction).

    None when nothing beyond `dp` takes part: `dp` is every rank (`all_ranks` None), or no rank
    of `dp` holds tensor-parallel parameters, while the root mesh holds more ranks (pipeline
    stages, each building an optimizer of its own). `all_ranks` when the root mesh is `dp` x TP
    (every rank builds this optimizer: a rank left out of the TP plan is found there). Else the
    stage's dp x tp world, made by its members alone."""
    if all_ranks is None:
        return None
    size = torch.tensor([tensor_parallel.size], device=dp.device)
    all_reduce_(size, dp, "max", what="the tensor-parallel size over the data-parallel mesh")
    tp = int(size.item())  # at construction: one read
    if dp.world_size * tp == all_ranks.world_size:
        return all_ranks
    if tp == 1 or tensor_parallel.group is None:  # a rank without a TP group: the dp check finds it
        return None
    return tensor_parallel.world().comm


def tp_plan_problem(
    params: Sequence[torch.Tensor], everyone: Comm | None, labels: dict[int, str]
) -> str | None:
    """Why this rank and its tensor-parallel peers hold different TP plans, if some do anywhere in
    the world (the same answer on every rank; collective over `everyone`, the ranks that build
    this optimizer: `checks_world`). None (and no exchange) without one: the data-parallel mesh
    spans them all, so a DTensor's mesh meets it in more than one rank, which `dtensor_problem`
    refuses first, or holds this rank alone."""
    if everyone is None or not everyone.active:
        return None
    mine = [(labels[id(p)], tp_description(p)) for p in params]
    digest = hashlib.sha256(repr(mine).encode()).hexdigest()
    answers = all_gather_object((digest, _peers(params)), everyone)
    at = {everyone.global_rank(i): i for i in range(everyone.world_size)}
    pairs = [(i, at[g]) for i, (_, peers) in enumerate(answers) for g in peers if g in at and at[g] != i]
    if all(answers[i][0] == answers[j][0] for i, j in pairs):
        return None
    every = all_gather_object(mine, everyone)  # a problem: the descriptions, to name it
    for i, j in pairs:
        if every[i] != every[j]:
            return _difference(everyone.global_rank(i), every[i], everyone.global_rank(j), every[j])
    return None


def _difference(rank: int, ours: list, peer: int, theirs: list) -> str:
    """How rank `rank`'s plan (`ours`) and its tensor-parallel peer `peer`'s differ, in words."""
    advice = "every rank must apply the same parallelize_module plan before building the optimizer"
    if all(d is None for _, d in theirs):
        first = next((name, d) for name, d in ours if d is not None)
        return (
            f"rank {peer} holds no DTensor parameters, but its tensor-parallel peer rank {rank} does "
            f"(parameter {first[0]} as {_described(first[1])}): {advice}"
        )
    for a, b in zip(ours, theirs):
        if a != b:
            return (
                f"rank {rank} holds parameter {a[0]} as {_described(a[1])}, its tensor-parallel peer rank "
                f"{peer} holds {b[0]} as {_described(b[1])}: {advice}"
            )
    return (
        f"rank {rank} passed {len(ours)} parameters, its tensor-parallel peer rank {peer} {len(theirs)}: "
        + advice
    )


def _described(description: tuple | None) -> str:
    if description is None:
        return "a plain tensor"
    shape, placements, mesh = description
    return f"a DTensor of shape {shape}, placements ({', '.join(placements)}) on a mesh of shape {mesh}"
