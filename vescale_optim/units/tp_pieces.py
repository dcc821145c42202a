"""Whole matrices of tensor-parallel parameters as owner work over the dp x tp world.

A matrix whose parameter is a DTensor sharded over TP (`Shard(0)`: row blocks, `Shard(1)`:
column blocks) lies in T local shards, each laid out ragged over the data-parallel group. To
orthogonalize the *full* matrix once in the world, its work item gathers every TP shard's
pieces from the ranks of the whole dp x tp world (`TPWorld.comm`, one group over all of them):
the item's flat elements are the TP shards' local elements one shard after the other
(`tp_pieces`), which is the full matrix itself for `Shard(0)` and a `[T, rows, cols / T]`
stack for `Shard(1)`, which the owner turns into the full matrix and back (`to_full_`,
`from_full_`).

The owner layer sees the dp x tp world as a `Topology` (`TPWorld.sharded`): a replica per
data-parallel replica, a "shard rank" per (tp rank, dp shard), `t * shards + s`. A plain
matrix (replicated over TP) sees it as `TPWorld.replicated`: each tp rank a replica of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..owners.balance import spread_homes
from ..owners.plan import SegmentMoves, WorkItem, plan_owners
from ..shard.collectives import all_gather_object
from ..shard.comm import Comm
from ..shard.handle import group_size, new_group
from ..shard.mesh import Topology
from ..shard.redistribution import Piece
from .tensor_parallel import is_tp_sharded, local_shape


@dataclass(frozen=True)
class TPMatrix:
    """How a 2-D DTensor parameter's full matrix is cut over TP: `size` shards, this rank's
    `index`, along `dim` (0: row blocks, 1: column blocks), evenly."""

    size: int
    index: int
    dim: int


def is_expert_stack(p: torch.Tensor) -> bool:
    """Whether `p` is a stack of matrices `[E, out, in]` cut over its mesh by whole matrices
    alone (every `Shard` placement on dim 0: expert parallelism, e.g. `distribute_tensor(w,
    ep_mesh, [Shard(0)])`): each rank's local stack holds whole matrices, orthogonalized where
    they lie, by owners over the data-parallel group (no traffic over the expert mesh)."""
    shards = [pl for pl in getattr(p, "placements", ()) if pl.is_shard()]
    return is_tp_sharded(p) and p.ndim == 3 and all(pl.dim % 3 == 0 for pl in shards)


def tp_matrix(p: torch.Tensor) -> TPMatrix | None:
    """`p`'s TP cut (None for a parameter replicated over TP, and for an expert stack, whose
    local matrices are whole: `is_expert_stack`); NotImplementedError by name for what Muon
    does not orthogonalize under TP yet (not 2-D, uneven shards, several Shard placements)."""
    if not is_tp_sharded(p) or is_expert_stack(p):
        return None
    shards = [(d, pl) for d, pl in enumerate(p.placements) if pl.is_shard()]
    if p.ndim != 2 or len(shards) != 1:
        raise NotImplementedError(
            f"Muon orthogonalizes 2-D DTensor parameters sharded on one mesh dimension; got shape "
            f"{tuple(p.shape)} with placements {tuple(p.placements)}"
        )
    mesh_dim, pl = shards[0]
    dim, size = pl.dim % 2, p.device_mesh.size(mesh_dim)
    if p.shape[dim] % size or local_shape(p)[dim] * size != p.shape[dim]:
        raise NotImplementedError(
            f"Muon under tensor parallelism needs even TP shards; a parameter of shape {tuple(p.shape)} "
            f"is cut into {size} on dim {dim}"
        )
    return TPMatrix(size, p.device_mesh.get_local_rank(mesh_dim), dim)


def tp_pieces(pieces: Sequence[Piece], cut: TPMatrix, shards: int) -> tuple[Piece, ...]:
    """The pieces of a full matrix, from the pieces of one TP shard's local matrix (dp shard
    ranks, the same layout on every tp rank): TP shard t's copy of each at shard rank
    `t * shards + rank` and elements `t * local numel + ...`."""
    numel = sum(p.stop - p.start for p in pieces)
    return tuple(
        Piece(t * shards + p.rank, p.tensor, p.offset, t * numel + p.start, t * numel + p.stop)
        for t in range(cut.size)
        for p in pieces
    )


def to_full_(flat: torch.Tensor, rows: int, cols: int, cut: TPMatrix) -> torch.Tensor:
    """The full `(rows, cols)` matrix in `flat` (in place), from its TP shards one after the other."""
    if cut.dim == 1 and cut.size > 1:
        flat.copy_(flat.view(cut.size, rows, cols // cut.size).transpose(0, 1).reshape(-1))
    return flat.view(rows, cols)


def from_full_(flat: torch.Tensor, rows: int, cols: int, cut: TPMatrix) -> None:
    """`to_full_` undone: the TP shards one after the other again, in place."""
    if cut.dim == 1 and cut.size > 1:
        flat.copy_(flat.view(rows, cut.size, cols // cut.size).transpose(0, 1).reshape(-1))


@dataclass(frozen=True)
class TPWorld:
    """The dp x tp world: `comm` over all its ranks, `size` TP ranks, and the owner layer's two
    views of it (`sharded` for matrices cut over TP, `replicated` for plain ones)."""

    comm: Comm
    size: int
    sharded: Topology
    replicated: Topology

    def of(self, cuts: Sequence[TPMatrix | None]) -> Topology:
        """The view of a segment's matrices (all cut over TP, or none: `muon_tp_world`)."""
        return self.sharded if any(cuts) else self.replicated

    def homes(
        self,
        costs: Sequence[float],
        work: Sequence[Sequence[WorkItem]],
        cuts: Sequence[Sequence[TPMatrix | None]],
    ) -> tuple[list[int | None], list[tuple[int, ...]]]:
        """Per item (every segment's, in order) the world rank to keep it at (`spread_homes` over
        its segment's view) and the world ranks holding it whole."""
        homes, holders, at = [], [], 0
        for items, seg_cuts in zip(work, cuts):
            ranks, n = self.of(seg_cuts).ranks, len(items)
            homes += spread_homes(list(costs[at : at + n]), [it.home for it in items], ranks)
            holders += [() if it.home is None else tuple(row[it.home] for row in ranks) for it in items]
            at += n
        return homes, holders

    def moves(
        self,
        work: Sequence[Sequence[WorkItem]],
        owners: Sequence[Sequence[int]],
        counts: Sequence[Sequence[int]],
        cuts: Sequence[Sequence[TPMatrix | None]],
    ) -> list[SegmentMoves]:
        """Each segment's moves over its view of the world, from its in-place sources (a segment
        cut over TP has the same source on every tp rank of a dp shard)."""
        out = []
        for items, own, count, seg_cuts in zip(work, owners, counts, cuts):
            topo = self.of(seg_cuts)
            sources = [list(count) * (topo.shards // len(count))]
            out.append(plan_owners([items], topo, self.comm.rank, sources=sources, owners=own).segments[0])
        return out


def tp_world(world: Comm, tp: Comm, topo: Topology, index: int) -> TPWorld:
    """The dp x tp world of this rank, whose data-parallel group is `world` (laid out as `topo`)
    and whose tp group is `tp`, at TP coordinate `index` (collective over tp; a group over the
    whole world made by its members)."""
    mine = [world.global_rank(r) for r in range(world.world_size)]
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
    return TPWorld(
        comm,
        size,
        Topology(sharded, topo.replica, index * shards + topo.shard),
        Topology(replicated, topo.replica * size + index, topo.shard),
    )


def refuse_tp_muon(params: list, defaults: dict) -> None:
    """What Muon does not orthogonalize under TP yet, refused by name before anything is built:
    a matrix cut over TP (`tp_matrix`) in a group with `normuon`, `split_sizes` or `num_heads`."""
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    for gi, g in enumerate(groups):
        group = {**defaults, **g}
        ps = [group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"])
        if not group.get("use_muon", True) or not any(tp_matrix(p) for p in ps):
            continue
        for key in ("normuon", "split_sizes", "num_heads"):
            if group.get(key):
                raise NotImplementedError(
                    f"param group {gi}: Muon with {key} is not supported yet for DTensor parameters cut "
                    "over tensor parallelism"
                )


def muon_tp_world(runtime, segs: Sequence, cuts: Sequence[Sequence[TPMatrix | None]]) -> TPWorld | None:
    """The dp x tp world Muon's whole matrices travel over, when some Muon segment holds
    matrices cut over TP (None otherwise: the data-parallel world, as without TP; expert stacks
    are then orthogonalized on their own ranks, and plain matrices on every TP/EP rank). A
    segment mixing them with plain matrices, and expert stacks next to them, are refused by
    name (alike on every rank)."""
    if not any(c for seg_cuts in cuts for c in seg_cuts):
        return None
    if any(is_expert_stack(p) for seg in segs for p in seg.params):
        raise NotImplementedError(
            "Muon holds expert stacks (3-D DTensors sharded on dim 0) next to matrices cut over tensor "
            "parallelism; one of the two per optimizer is supported yet (AdamW takes both)"
        )
    for seg_cuts in cuts:
        if any(seg_cuts) and not all(seg_cuts):
            raise NotImplementedError(
                "a Muon segment holds matrices cut over tensor parallelism next to plain ones; put the "
                "plain matrices in a param group of their own (or parallelize them too)"
            )
    index = next(c.index for seg_cuts in cuts for c in seg_cuts if c)
    return tp_world(runtime.world, runtime.tp[0], runtime.topology, index)


def assemble(received: torch.Tensor, rowwise: Sequence[tuple[int, int, int, TPMatrix]], back: bool) -> None:
    """The received `Shard(1)` matrices `(offset, rows, cols, cut)` made full in place
    (`to_full_`), or, with `back`, laid out as TP shards again (`from_full_`)."""
    for o, rows, cols, cut in rowwise:
        flat = received[o : o + rows * cols]
        (from_full_ if back else to_full_)(flat, rows, cols, cut)
