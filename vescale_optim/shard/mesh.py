"""Where a rank sits in a `replicate x shard` device mesh, and the groups it talks to.

Parameters, gradients and state are sharded over the `shard` dimension and replicated
over `replicate`. A 1-D mesh may be one dimension of a larger root mesh (`world["dp"]` next
to a tensor-parallel `world["tp"]`): the collectives then run on its group alone. A `Topology`
maps `(replica, shard)` coordinates to ranks of the world group (a 2-D mesh spans it), so plans
for work split across replicas can name any rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import handle
from .collectives import Comm

DIM_NAMES = ("replicate", "shard")


@dataclass(frozen=True)
class Topology:
    """`ranks[r][s]`: the world rank of shard rank `s` in replica `r`; this rank is at
    `(replica, shard)`. One replica and world ranks equal to shard ranks without a mesh."""

    ranks: tuple[tuple[int, ...], ...]
    replica: int
    shard: int

    @property
    def replicas(self) -> int:
        return len(self.ranks)

    @property
    def shards(self) -> int:
        return len(self.ranks[0])

    @property
    def world_size(self) -> int:
        return self.replicas * self.shards

    def world_rank(self, replica: int, shard: int) -> int:
        return self.ranks[replica][shard]

    def coords(self, world_rank: int) -> tuple[int, int]:
        for r, row in enumerate(self.ranks):
            if world_rank in row:
                return r, row.index(world_rank)
        raise ValueError(f"rank {world_rank} is not in the mesh")

    def shard_of(self, world_rank: int) -> int:
        return self.coords(world_rank)[1]

    @staticmethod
    def flat(comm: Comm) -> Topology:
        return Topology((tuple(range(comm.world_size)),), 0, comm.rank)


@dataclass(frozen=True)
class Groups:
    """The groups an optimizer uses: `shard` for its units, `replicate` across replicas
    (inactive with one), and `world` (every rank of the mesh) for work split over both."""

    shard: Comm
    replicate: Comm
    world: Comm
    topology: Topology


def resolve(mesh=None, process_group=None) -> Groups:
    """The groups of a 1-D or 2-D `DeviceMesh` (dims named `replicate` and `shard`, in any
    order; unnamed 2-D meshes are `(replicate, shard)`), or of one process group."""
    if mesh is None:
        comm = Comm(process_group)
        return Groups(comm, Comm.alone(), comm, Topology.flat(comm))
    if process_group is not None:
        raise ValueError("pass either mesh= or process_group=, not both (a 1-D mesh replaces the group)")
    if not handle.initialized():
        raise ValueError("a mesh was given but torch.distributed is not initialised")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"mesh has {mesh.ndim} dimensions {tuple(mesh.shape)}; expected 1 (shard) or 2 (replicate, shard)"
        )
    if mesh.ndim == 1:  # the whole world, or one dimension of a larger root mesh (world["dp"])
        shard = Comm(mesh.get_group(0))
        return Groups(shard, Comm.alone(), shard, Topology.flat(shard))
    if mesh.size() != handle.group_size():
        raise ValueError(
            f"mesh of shape {tuple(mesh.shape)} spans {mesh.size()} ranks but the world has "
            f"{handle.group_size()}; a 2-D mesh must cover every rank (HSDP over part of a larger mesh, "
            "next to tensor parallelism, is not supported yet: pass a 1-D data-parallel mesh there)"
        )
    names = mesh.mesh_dim_names or DIM_NAMES
    if sorted(names) != sorted(DIM_NAMES):
        raise ValueError(f"mesh dimensions are named {names}; name them {DIM_NAMES}")
    rdim, sdim = names.index("replicate"), names.index("shard")
    grid = mesh.mesh if rdim == 0 else mesh.mesh.T
    ranks = tuple(tuple(int(r) for r in row) for row in grid.tolist())
    shard, replicate = Comm(mesh.get_group(sdim)), Comm(mesh.get_group(rdim))
    return Groups(shard, replicate, Comm(None), Topology(ranks, replicate.rank, shard.rank))
