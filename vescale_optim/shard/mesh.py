"""Where a rank sits in a `replicate x shard` device mesh, and the groups it talks to.

Parameters, gradients and state are sharded over the `shard` dimension and replicated
over `replicate`. A 1-D mesh may be one dimension of a larger root mesh (`world["dp"]` next
to a tensor-parallel `world["tp"]`): the collectives then run on its group alone. A `Topology`
maps `(replica, shard)` coordinates to ranks of the `dp` group (every rank of the mesh: the
default group, or a group of its own for a 2-D mesh inside a larger root mesh, HSDP next to tensor
parallelism), so plans for work split across replicas can name any rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import handle
from .collectives import Comm
from .groups import split_groups

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
    (inactive with one), and `dp` (every rank of the data-parallel mesh) for work split over both;
    `all_ranks`, the default group, when the mesh is part of a larger root mesh (`world["dp"]`
    next to `world["tp"]`): every rank there is, each of them building the optimizer, so checks
    and random states that must be alike over the other dimensions (tensor parallelism) can be
    exchanged even by a rank that holds nothing of them (None otherwise: `dp` is all)."""

    shard: Comm
    replicate: Comm
    dp: Comm
    topology: Topology
    all_ranks: Comm | None = None


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
    all_ranks = Comm(None) if mesh.size() < handle.group_size() else None
    if mesh.ndim == 1:  # the whole world, or one dimension of a larger root mesh (world["dp"])
        shard = Comm(mesh.get_group(0))
        return Groups(shard, Comm.alone(), shard, Topology.flat(shard), all_ranks)
    names = tuple(mesh.mesh_dim_names or DIM_NAMES)
    roles = tuple(next((r for r in DIM_NAMES if n == r or n.endswith("_" + r)), n) for n in names)
    if sorted(roles) != sorted(DIM_NAMES):
        raise ValueError(
            f"mesh dimensions are named {names}; name them {DIM_NAMES} (or e.g. dp_replicate, dp_shard)"
        )
    rdim, sdim = roles.index("replicate"), roles.index("shard")
    grid = mesh.mesh if rdim == 0 else mesh.mesh.T
    dp = Comm(None) if mesh.size() == handle.group_size() else Comm(_group_of(grid))
    shard, replicate = Comm(mesh.get_group(sdim)), Comm(mesh.get_group(rdim))
    at = {dp.global_rank(r): r for r in range(dp.world_size)}  # default-group rank -> world's
    ranks = tuple(tuple(at[int(r)] for r in row) for row in grid.tolist())
    return Groups(shard, replicate, dp, Topology(ranks, replicate.rank, shard.rank), all_ranks)


def _group_of(grid):
    """A process group of the ranks of a 2-D mesh that is part of a larger root mesh (HSDP next
    to tensor parallelism: `world["dp_replicate", "dp_shard"]`; torch's mesh names no group over
    two of its dimensions). The ranks first check, in one exchange over the world, that their
    slices tile it (each rank in exactly one), so a mesh over part of the world alone is refused
    on every rank; then every rank makes every slice's group from the world (`groups`)."""
    ranks = sorted(int(r) for r in grid.reshape(-1).tolist())
    me = handle.group_rank()
    slices = handle.all_gather_object(ranks if me in ranks else None)
    covered = sorted(r for s in {tuple(s) for s in slices if s is not None} for r in s)
    if covered != list(range(len(slices))) or any(s is None or r not in s for r, s in enumerate(slices)):
        raise ValueError(
            f"mesh of shape {tuple(grid.shape)} spans ranks {ranks} of a world of {len(slices)}, and "
            "the ranks' meshes do not tile the world: a 2-D mesh covers every rank, or is the "
            "data-parallel part of one root mesh (world['dp_replicate', 'dp_shard'] next to world['tp'])"
        )
    return split_groups(None, sorted({tuple(s) for s in slices}))[tuple(ranks)]
