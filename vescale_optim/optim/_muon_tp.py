"""Muon's matrices of tensor- and expert-parallel parameters as owner work over the dp x tp world.

Muon reads tensor parallelism from the runtime's `TensorParallel` (`units.tp_view`): each
parameter's cut, the TP group and the dp x tp world. A matrix whose parameter is cut over TP
(`Shard(0)`: row blocks, `Shard(1)`: column blocks) lies in T local shards, each laid out ragged
over the data-parallel group. To orthogonalize the *full* matrix once in the world, its work item
gathers every TP shard's pieces from the ranks of the whole dp x tp world (`DpTpWorld.comm`): the
item's flat elements are the TP shards' local elements one shard after the other (`tp_pieces`),
which is the full matrix itself for `Shard(0)` and a `[T, rows, cols / T]` stack for `Shard(1)`,
which the owner turns into the full matrix and back (`to_full_`, `from_full_`). An expert stack
cut by whole matrices over the same mesh dimension (`Experts`: expert parallelism on the TP
dimension, or on an ep dimension with no TP) holds other matrices on each tp rank: each is an
item of its own tp rank's pieces (`expert_pieces`), owned by one of that tp rank's ranks
(`allowed`), so it never crosses EP.

The owner layer sees the dp x tp world in its `sharded` view for TP-cut and expert matrices and
in its `replicated` view for plain ones (replicated over TP: each tp rank a replica of its own,
so it too is computed once in the world). A segment holding both kinds moves each kind in a plan
of its own view (`moves`: one part per view).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..owners.balance import spread_homes
from ..owners.plan import SegmentMoves, WorkItem, plan_owners
from ..shard.mesh import Topology
from ..shard.redistribution import Piece
from ..units.tp_view import DpTpWorld, ParamCut
from ._muon_math import group_blocks, row_blocks


@dataclass(frozen=True)
class TPMatrix:
    """How a 2-D DTensor parameter's full matrix is cut over TP: `size` shards, this rank's
    `index`, along `dim` (0: row blocks, 1: column blocks), evenly."""

    size: int
    index: int
    dim: int


@dataclass(frozen=True)
class Experts:
    """An expert stack's cut over the TP (or EP) mesh dimension: `size` ranks, this rank's `index`,
    each holding whole matrices (`is_expert_stack`) that are not the other ranks'."""

    size: int
    index: int


def is_expert_stack(cut: ParamCut) -> bool:
    """Whether the parameter is a stack of matrices `[E, out, in]` cut over its mesh by whole
    matrices alone (every `Shard` placement on dim 0: expert parallelism, e.g.
    `distribute_tensor(w, ep_mesh, [Shard(0)])`): each rank's local stack holds whole matrices,
    orthogonalized where they lie, by owners over the data-parallel group (no traffic over the
    expert mesh)."""
    return cut.sharded and cut.ndim == 3 and all(c.dim == 0 for c in cut.cuts)


def tp_matrix(cut: ParamCut) -> TPMatrix | None:
    """The parameter's TP cut as a matrix (None for a parameter replicated over TP, and for an
    expert stack, whose local matrices are whole: `is_expert_stack`); NotImplementedError by name
    for what Muon does not orthogonalize under TP yet (not 2-D, uneven shards, several Shard
    placements)."""
    if not cut.sharded or is_expert_stack(cut):
        return None
    if cut.ndim != 2 or len(cut.cuts) != 1:
        raise NotImplementedError(
            f"Muon orthogonalizes 2-D DTensor parameters sharded on one mesh dimension; got shape "
            f"{cut.shape} with placements {cut.placements}"
        )
    (c,) = cut.cuts
    if cut.shape[c.dim] % c.ways or cut.local_shape[c.dim] * c.ways != cut.shape[c.dim]:
        raise NotImplementedError(
            f"Muon under tensor parallelism needs even TP shards; a parameter of shape {cut.shape} "
            f"is cut into {c.ways} on dim {c.dim}"
        )
    return TPMatrix(c.ways, c.index, c.dim)


def tp_kind(cut: ParamCut) -> TPMatrix | Experts | None:
    """How the parameter lies over TP for Muon: cut (`tp_matrix`), an expert stack, or plain (None)."""
    if not is_expert_stack(cut):
        return tp_matrix(cut)
    return Experts(cut.cuts[0].ways, cut.cuts[0].index)


def needs_world(kinds: Sequence[Sequence[TPMatrix | Experts | None]], normuon: bool) -> bool:
    """Whether Muon's whole matrices travel over the dp x tp world rather than the data-parallel
    one: when some Muon segment holds matrices cut over TP (`kinds`: per segment, per parameter),
    or expert stacks next to plain matrices (each plain matrix then computed once in the world, not
    on every EP rank), or expert stacks with NorMuon (some segment's `normuon`: its state is then
    the whole stack's, kept by owners of the dp x tp world, under the one-process keys)."""
    flat = [k for seg_kinds in kinds for k in seg_kinds]
    cut = any(isinstance(k, TPMatrix) for k in flat)
    experts = any(isinstance(k, Experts) for k in flat)
    return cut or (experts and (None in flat or normuon))


# --- a matrix's pieces in the dp x tp world ------------------------------------------------


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


def expert_pieces(pieces: Sequence[Piece], t: int, shards: int) -> tuple[Piece, ...]:
    """The pieces of tp rank `t`'s copy of a local matrix (dp shard ranks; the same layout on
    every tp rank), as shard ranks `t * shards + rank` of the sharded view."""
    return tuple(Piece(t * shards + p.rank, p.tensor, p.offset, p.start, p.stop) for p in pieces)


def to_full_(flat: torch.Tensor, rows: int, cols: int, cut: TPMatrix) -> torch.Tensor:
    """The full `(rows, cols)` matrix in `flat` (in place), from its TP shards one after the other."""
    if cut.dim == 1 and cut.size > 1:
        flat.copy_(flat.view(cut.size, rows, cols // cut.size).transpose(0, 1).reshape(-1))
    return flat.view(rows, cols)


def from_full_(flat: torch.Tensor, rows: int, cols: int, cut: TPMatrix) -> None:
    """`to_full_` undone: the TP shards one after the other again, in place."""
    if cut.dim == 1 and cut.size > 1:
        flat.copy_(flat.view(rows, cut.size, cols // cut.size).transpose(0, 1).reshape(-1))


def assemble(received: torch.Tensor, rowwise: Sequence[tuple[int, int, int, TPMatrix]], back: bool) -> None:
    """The received `Shard(1)` matrices `(offset, rows, cols, cut)` made full in place
    (`to_full_`), or, with `back`, laid out as TP shards again (`from_full_`)."""
    for o, rows, cols, cut in rowwise:
        flat = received[o : o + rows * cols]
        (from_full_ if back else to_full_)(flat, rows, cols, cut)


# --- blocks (`split_sizes` / `num_heads`) of a TP-cut matrix ----------------------------------


def blocked(group: dict) -> bool:
    return group.get("split_sizes") is not None or group.get("num_heads") is not None


def tp_blocks(shape: tuple[int, int], group: dict, cut: TPMatrix, t: int) -> list[tuple[int, ...]] | None:
    """The blocks (`split_sizes` / `num_heads` rows) of TP shard `t`'s local matrix, of a matrix of
    `shape` cut as `cut` says: `(local offset, local rows, local cols, rows, cols)`, the last two the
    block's shape in the full matrix. A `Shard(1)` cut holds a column slice of every block (each
    made whole over TP by its owner); a `Shard(0)` cut holds whole blocks, or None when its rows
    cut one."""
    rows, cols = shape
    sizes, out, top = row_blocks(rows, group.get("split_sizes"), group.get("num_heads")), [], 0
    lo, hi = t * rows // cut.size, (t + 1) * rows // cut.size
    for n in sizes:
        a, z, top = top, top + n, top + n
        if cut.dim == 1:
            out.append((a * cols // cut.size, n, cols // cut.size, n, cols))
        elif a < hi and z > lo:
            if a < lo or z > hi:
                return None
            out.append(((a - lo) * cols, n, cols, n, cols))
    return out


def local_blocks(cut: ParamCut, group: dict, kind: TPMatrix | Experts | None) -> list[tuple[int, ...]]:
    """This rank's blocks of a parameter's local tensor as `tp_blocks` gives them (any parameter)."""
    if isinstance(kind, TPMatrix) and blocked(group):
        return tp_blocks(cut.shape, group, kind, kind.index) or []
    if isinstance(kind, TPMatrix):
        return [(0, *cut.local_shape, *cut.shape)]
    return [(at, r, c, r, c) for at, r, c in group_blocks(cut.local_shape, group)]


def refuse_tp_blocks(param_groups: list[dict], cut_of) -> None:
    """A `Shard(0)` cut whose TP shards do not hold whole blocks of its group's `split_sizes` /
    `num_heads`, refused by name before anything is built (every rank sees the same cuts;
    `cut_of(p)`: the parameter's `ParamCut`)."""
    for gi, group in enumerate(param_groups):
        names, ps = group.get("param_names"), group["params"]
        for j, p in enumerate(ps if group.get("use_muon", True) and blocked(group) else ()):
            kind = tp_matrix(cut_of(p)) if p.ndim == 2 else None
            if not (isinstance(kind, TPMatrix) and kind.dim == 0):
                continue
            for t in range(kind.size):
                if tp_blocks(tuple(p.shape), group, kind, t) is None:
                    name = f"'{names[j]}' " if names else ""
                    raise NotImplementedError(
                        f"param group {gi}, parameter {name}#{j} of shape {tuple(p.shape)}: its TP shard {t} "
                        f"(rows {t * p.shape[0] // kind.size} to {(t + 1) * p.shape[0] // kind.size}) cuts a "
                        "block of split_sizes / num_heads; Muon orthogonalizes whole blocks under a Shard(0) "
                        "cut only where each TP shard holds whole blocks"
                    )


# --- owners in the dp x tp world ----------------------------------------------------------

SHARDED, REPLICATED = 0, 1  # the two views of the dp x tp world an item lies in (`TPItem.view`)


@dataclass(frozen=True)
class TPItem:
    """Where a work item lies in the dp x tp world: its `view` (SHARDED for a TP-cut or expert
    matrix, REPLICATED for a plain one) and, for an expert matrix, the tp rank holding it (`tp`)."""

    view: int
    tp: int | None = None


def view_of(world: DpTpWorld, view: int) -> Topology:
    return world.sharded if view == SHARDED else world.replicated


def homes(
    world: DpTpWorld, costs: Sequence[float], items: Sequence[WorkItem], tags: Sequence[TPItem]
) -> tuple[list[int | None], list[tuple[int, ...]]]:
    """Per item (every segment's, in order) the world rank to keep it at (`spread_homes` over its
    view, each view's items together) and the world ranks holding it whole."""
    found: list[int | None] = [None] * len(items)
    for view in (SHARDED, REPLICATED):
        at = [k for k, tag in enumerate(tags) if tag.view == view]
        ranks = view_of(world, view).ranks
        for k, h in zip(at, spread_homes([costs[k] for k in at], [items[k].home for k in at], ranks)):
            found[k] = h
    holders = [
        () if it.home is None else tuple(row[it.home] for row in view_of(world, tag.view).ranks)
        for it, tag in zip(items, tags)
    ]
    return found, holders


def allowed(world: DpTpWorld, tags: Sequence[TPItem]) -> list[tuple[int, ...] | None]:
    """Per item the world ranks that may own it: an expert matrix's tp rank's (no EP traffic),
    any for the rest (None)."""
    shards = world.sharded.shards // world.size
    ranks = world.sharded.ranks
    mine = [
        tuple(sorted(row[t * shards + s] for row in ranks for s in range(shards))) for t in range(world.size)
    ]
    return [None if tag.tp is None else mine[tag.tp] for tag in tags]


def moves(
    world: DpTpWorld,
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
            topo = view_of(world, view)
            sources = [list(count) * (topo.shards // len(count))]
            picked, fixed = [[items[k] for k in at]], [own[k] for k in at]
            plan = plan_owners(picked, topo, world.comm.rank, sources=sources, owners=fixed)
            parts.append((at, plan.segments[0]))
        out.append(parts)
    return out
