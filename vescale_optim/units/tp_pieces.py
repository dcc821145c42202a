"""Muon's matrices of tensor- and expert-parallel parameters as owner work over the dp x tp world.

A matrix whose parameter is a DTensor sharded over TP (`Shard(0)`: row blocks, `Shard(1)`:
column blocks) lies in T local shards, each laid out ragged over the data-parallel group. To
orthogonalize the *full* matrix once in the world, its work item gathers every TP shard's
pieces from the ranks of the whole dp x tp world (`TPWorld.comm`, one group over all of them):
the item's flat elements are the TP shards' local elements one shard after the other
(`tp_pieces`), which is the full matrix itself for `Shard(0)` and a `[T, rows, cols / T]`
stack for `Shard(1)`, which the owner turns into the full matrix and back (`to_full_`,
`from_full_`). An expert stack cut by whole matrices over the same mesh dimension (`Experts`:
expert parallelism on the TP dimension, or on an ep dimension with no TP) holds other matrices
on each tp rank: each is an item of its own tp rank's pieces (`expert_pieces`), owned by one of
that tp rank's ranks (`TPWorld.allowed`), so it never crosses EP.

The owner layer sees the dp x tp world as a `Topology` (`TPWorld.sharded`): a replica per
data-parallel replica, a "shard rank" per (tp rank, dp shard), `t * shards + s`; TP-cut and
expert matrices live there. A plain matrix (replicated over TP) sees it as `TPWorld.replicated`:
each tp rank a replica of its own, so it too is computed once in the world. A segment holding
both kinds moves each kind in a plan of its own view (`TPWorld.moves`: one part per view).
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


SHARDED, REPLICATED = 0, 1  # the two views of the dp x tp world (`TPWorld.view`)


@dataclass(frozen=True)
class Experts:
    """An expert stack's cut over the TP (or EP) mesh dimension: `size` ranks, this rank's `index`,
    each holding whole matrices (`is_expert_stack`) that are not the other ranks'."""

    size: int
    index: int


def tp_kind(p: torch.Tensor) -> TPMatrix | Experts | None:
    """How `p` lies over TP for Muon: cut (`tp_matrix`), an expert stack, or plain (None)."""
    if not is_expert_stack(p):
        return tp_matrix(p)
    dim = next(d for d, pl in enumerate(p.placements) if pl.is_shard())
    return Experts(p.device_mesh.size(dim), p.device_mesh.get_local_rank(dim))


@dataclass(frozen=True)
class TPItem:
    """Where a work item lies in the dp x tp world: its `view` (SHARDED for a TP-cut or expert
    matrix, REPLICATED for a plain one) and, for an expert matrix, the tp rank holding it (`tp`)."""

    view: int
    tp: int | None = None


def expert_pieces(pieces: Sequence[Piece], t: int, shards: int) -> tuple[Piece, ...]:
    """The pieces of tp rank `t`'s copy of a local matrix (dp shard ranks; the same layout on
    every tp rank), as shard ranks `t * shards + rank` of the sharded view."""
    return tuple(Piece(t * shards + p.rank, p.tensor, p.offset, p.start, p.stop) for p in pieces)


@dataclass(frozen=True)
class TPWorld:
    """The dp x tp world: `comm` over all its ranks, `size` TP ranks, this rank's tp `index`,
    and the owner layer's two views of it (`sharded` for matrices cut over TP and expert
    matrices, `replicated` for plain ones)."""

    comm: Comm
    size: int
    index: int
    sharded: Topology
    replicated: Topology

    def view(self, tag: TPItem) -> Topology:
        return self.sharded if tag.view == SHARDED else self.replicated

    def homes(
        self, costs: Sequence[float], items: Sequence[WorkItem], tags: Sequence[TPItem]
    ) -> tuple[list[int | None], list[tuple[int, ...]]]:
        """Per item (every segment's, in order) the world rank to keep it at (`spread_homes` over
        its view, each view's items together) and the world ranks holding it whole."""
        homes: list[int | None] = [None] * len(items)
        for view in (SHARDED, REPLICATED):
            at = [k for k, tag in enumerate(tags) if tag.view == view]
            ranks = (self.sharded if view == SHARDED else self.replicated).ranks
            for k, h in zip(at, spread_homes([costs[k] for k in at], [items[k].home for k in at], ranks)):
                homes[k] = h
        holders = [() if it.home is None else tuple(row[it.home] for row in self.view(tag).ranks)
                   for it, tag in zip(items, tags)]  # fmt: skip
        return homes, holders

    def allowed(self, tags: Sequence[TPItem]) -> list[tuple[int, ...] | None]:
        """Per item the world ranks that may own it: an expert matrix's tp rank's (no EP traffic),
        any for the rest (None)."""
        shards = self.sharded.shards // self.size
        mine = [tuple(sorted(row[t * shards + s] for row in self.sharded.ranks for s in range(shards)))
                for t in range(self.size)]  # fmt: skip
        return [None if tag.tp is None else mine[tag.tp] for tag in tags]

    def moves(
        self,
        work: Sequence[Sequence[WorkItem]],
        owners: Sequence[Sequence[int]],
        counts: Sequence[Sequence[int]],
        tags: Sequence[Sequence[TPItem]],
    ) -> list[list[tuple[list[int], SegmentMoves]]]:
        """Each segment's moves, one part per view its items use (the item indices and their
        moves), from its in-place sources (the same source on every tp rank of a dp shard)."""
        out = []
        for items, own, count, seg_tags in zip(work, owners, counts, tags):
            parts = []
            for view in (SHARDED, REPLICATED):
                at = [k for k, tag in enumerate(seg_tags) if tag.view == view]
                if not at:
                    continue
                topo = self.sharded if view == SHARDED else self.replicated
                sources = [list(count) * (topo.shards // len(count))]
                plan = plan_owners([[items[k] for k in at]], topo, self.comm.rank, sources=sources,
                                   owners=[own[k] for k in at])  # fmt: skip
                parts.append((at, plan.segments[0]))
            out.append(parts)
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
        index,
        Topology(sharded, topo.replica, index * shards + topo.shard),
        Topology(replicated, topo.replica * size + index, topo.shard),
    )


def muon_tp_world(
    runtime, segs: Sequence, kinds: Sequence[Sequence[TPMatrix | Experts | None]]
) -> TPWorld | None:
    """The dp x tp world Muon's whole matrices travel over (None: the data-parallel world, as
    without TP): when some Muon segment holds matrices cut over TP, or expert stacks next to
    plain matrices (each plain matrix then computed once in the world, not on every EP rank), or
    expert stacks with NorMuon (whose state is then the whole stack's, kept by owners of the dp x
    tp world, under the one-process keys)."""
    flat = [k for seg_kinds in kinds for k in seg_kinds]
    cut = any(isinstance(k, TPMatrix) for k in flat)
    experts = any(isinstance(k, Experts) for k in flat)
    normuon = any(seg.group["normuon"] for seg in segs)
    if not (cut or (experts and (None in flat or normuon))):
        return None
    index = next(k.index for k in flat if k is not None)
    return tp_world(runtime.dp, runtime.tp[0], runtime.topology, index)


def assemble(received: torch.Tensor, rowwise: Sequence[tuple[int, int, int, TPMatrix]], back: bool) -> None:
    """The received `Shard(1)` matrices `(offset, rows, cols, cut)` made full in place
    (`to_full_`), or, with `back`, laid out as TP shards again (`from_full_`)."""
    for o, rows, cols, cut in rowwise:
        flat = received[o : o + rows * cols]
        (from_full_ if back else to_full_)(flat, rows, cols, cut)
