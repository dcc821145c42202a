"""Tensor parallelism as an optimizer sees it: one `TensorParallel` object, built by the runtime.

A model tensor-parallelised with torch's `parallelize_module` (or cut over an expert mesh) holds
DTensor parameters; the runtime lays out each one's local shard over the data-parallel mesh
(`tensor_parallel`). An optimizer whose math needs more than the local shard (a whole matrix, a
tile of the full tensor) reads tensor parallelism from here alone, as FSDP2's parameter group
reads each `FSDPParam`:

- per parameter its cut (`ParamCut`, built by `param_cut` from the parameter alone): the whole
  tensor's shape, this rank's shard's shape and where it starts in the whole (its box), the
  placements, and one `MeshCut` per `Shard` placement (which tensor dimension, into how many
  shards, this rank's index);
- the TP group (`group`: the mesh dimension some parameter is sharded over; None without TP),
  this rank's `index` in it and its `size`;
- the dp x tp world (`world()`, a `DpTpWorld`): one group over every rank of the data-parallel
  mesh times the TP group, and two views of it as owner `Topology`s, made once, on first use.

The runtime builds it from the parameters and its groups; optimizers consume it
(`runtime.tensor_parallel`), and checks that run before the runtime exists read `param_cut`.
Over FSDP2's shards its DTensors are FSDP2's cuts and there is no TP group.

The dp x tp world's group is the one group this object makes (`dp_tp_world`). Today its members
make it alone (`new_group` with local synchronization, or the default group when it spans every
rank). Under pipeline parallelism each stage builds its own optimizer over its own dp (x tp)
ranks, so the group must be creatable by a stage's ranks alone, which a device-bound NCCL world
does not allow yet (a subgroup splits its parent's communicator, every rank of the parent taking
part: ARCHITECTURE.md, "Process groups"); it is made here and nowhere else, the one place to change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..shard.collectives import all_gather_object
from ..shard.comm import Comm
from ..shard.handle import group_size, new_group
from ..shard.mesh import Topology
from .tensor_parallel import box_at, is_dtensor, local_shape


@dataclass(frozen=True)
class MeshCut:
    """One `Shard` placement of a parameter: mesh dimension `mesh_dim`, of `ways` ranks, cuts
    tensor dimension `dim` (normalised: `0 <= dim < ndim`); this rank holds shard `index`."""

    mesh_dim: int
    dim: int
    ways: int
    index: int


@dataclass(frozen=True)
class ParamCut:
    """How one parameter lies over its mesh: the whole tensor's `shape`, this rank's
    `local_shape` (what the units lay out), `origin` (where this rank's shard starts in the whole:
    its box is `origin` + `local_shape`), `placements`, and one `MeshCut` per `Shard` placement
    (`cuts`, in mesh-dimension order). A plain parameter is its own whole: no placements, no cuts."""

    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    origin: tuple[int, ...]
    placements: tuple = ()
    cuts: tuple[MeshCut, ...] = ()

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtensor(self) -> bool:
        """Whether the parameter is a DTensor (a plan's, sharded or replicated)."""
        return bool(self.placements)

    @property
    def sharded(self) -> bool:
        """Whether its elements differ over its mesh (a `Shard` placement): a replicated one is
        the same tensor on every TP rank."""
        return bool(self.cuts)


def param_cut(p: torch.Tensor) -> ParamCut:
    """`p`'s `ParamCut`, from its global shape, placements and mesh (no communication)."""
    shape = tuple(p.shape)
    if not is_dtensor(p):
        return ParamCut(shape, shape, (0,) * len(shape))
    mesh, placements = p.device_mesh, tuple(p.placements)
    coordinate = mesh.get_coordinate()
    origin, _ = box_at(shape, placements, tuple(mesh.mesh.shape), coordinate)
    cuts = tuple(
        MeshCut(d, pl.dim % len(shape), mesh.size(d), coordinate[d])
        for d, pl in enumerate(placements)
        if pl.is_shard()
    )
    return ParamCut(shape, local_shape(p), tuple(origin), placements, cuts)


@dataclass(frozen=True)
class DpTpWorld:
    """The dp x tp world: `comm` over all its ranks, `size` TP ranks, this rank's tp `index`, and
    two views of it as owner topologies. `sharded`: one replica per data-parallel replica, a
    "shard rank" per (tp rank, dp shard), `t * shards + s` (where the TP shards of a matrix cut
    over TP lie side by side). `replicated`: each tp rank a replica of its own (a tensor
    replicated over TP, the same on every tp rank, computed once in the world)."""

    comm: Comm
    size: int
    index: int
    sharded: Topology
    replicated: Topology


def dp_tp_world(dp: Comm, tp: Comm, topo: Topology, index: int) -> DpTpWorld:
    """The dp x tp world of this rank, whose data-parallel group is `dp` (laid out as `topo`) and
    whose tp group is `tp`, at TP coordinate `index` (collective over tp; a group over the whole
    world made by its members)."""
    mine = [dp.global_rank(r) for r in range(dp.world_size)]
    rows = dict(all_gather_object((index, mine), tp))
    ranks = sorted({g for row in rows.values() for g in row})
    if len(ranks) == group_size():
        comm = Comm(None)
    else:
        comm = Comm(new_group(ranks, use_local_synchronization=True))
    at = {g: i for i, g in enumerate(ranks)}
    size, shards = len(rows), topo.shards

    def of(t: int, replica: int, shard: int) -> int:
        return at[rows[t][topo.ranks[replica][shard]]]

    sharded = tuple(
        tuple(of(t, r, s) for t in range(size) for s in range(shards)) for r in range(topo.replicas)
    )
    replicated = tuple(
        tuple(of(t, r, s) for s in range(shards)) for r in range(topo.replicas) for t in range(size)
    )
    return DpTpWorld(
        comm,
        size,
        index,
        Topology(sharded, topo.replica, index * shards + topo.shard),
        Topology(replicated, topo.replica * size + index, topo.shard),
    )


class TensorParallel:
    """Tensor parallelism of one runtime's parameters (see the module's docstring): each
    parameter's `cut(p)`, the TP `group` (`groups`: every TP group, at most one), and the dp x tp
    `world()` over the data-parallel group `dp` laid out as `topology`."""

    def __init__(self, params: Sequence[torch.Tensor], dp: Comm, topology: Topology, groups: Sequence[Comm]):
        self._cuts = {id(p): param_cut(p) for p in params}
        self.groups = tuple(groups)
        self.dp, self.topology = dp, topology
        self._world: DpTpWorld | None = None

    def cut(self, p: torch.Tensor) -> ParamCut:
        """How parameter `p` (one of the runtime's) lies over tensor parallelism."""
        return self._cuts[id(p)]

    @property
    def group(self) -> Comm | None:
        """The TP group (None: no parameter is sharded over tensor parallelism)."""
        return self.groups[0] if self.groups else None

    @property
    def size(self) -> int:
        return 1 if self.group is None else self.group.world_size

    @property
    def index(self) -> int:
        """This rank's TP coordinate (its rank in the TP group)."""
        return 0 if self.group is None else self.group.rank

    def world(self) -> DpTpWorld:
        """The dp x tp world (made on the first call, which every rank of it makes alike:
        collective over the TP group)."""
        if self.group is None:
            raise ValueError("no parameter is sharded over tensor parallelism: there is no dp x tp world")
        if self._world is None:
            self._world = dp_tp_world(self.dp, self.group, self.topology, self.index)
        return self._world


__all__ = ["DpTpWorld", "MeshCut", "ParamCut", "TensorParallel", "dp_tp_world", "param_cut"]
