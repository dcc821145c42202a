"""Muon over FSDP2's shards: each full matrix orthogonalized once in the world, by one owner.

Under FSDP2 (`units.fsdp_shards`) every rank holds a piece of every matrix, cut as FSDP2's
placements say (rows, HSDP replicas, the columns TP cut). Momentum runs on the local pieces as
always (`Muon._update`); then one all-to-all brings each parameter's update `U` whole to its
owner, chosen by balancing Newton–Schulz FLOPs over the world's ranks (a parameter's matrices,
a stack's too, stay together); the owner orthogonalizes each matrix of it (`matrix_view`,
batched per parameter), and a second all-to-all sends every rank its piece of `O`, which the
segment applies with the full matrix's adjusted learning rate. What torchtitan's and dion's
Muon do on FSDP2's DTensors, but every matrix computed once and the work balanced.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..kernels.newton_schulz import newton_schulz
from ..owners.balance import assign_owners
from ..units.fsdp_shards import WholeMoves
from ..units.segment import Segment
from ..units.tp_view import TensorParallel
from ._muon_math import adjusted_lr, matrix_view, ns_flops, ns_steps_of
from ._muon_plan import CostModel, MuonPlan


def refused(segs: list[Segment]) -> str | None:
    """What Muon does not do over FSDP2's shards yet, named."""
    for seg in segs:
        for key in ("normuon", "split_sizes", "num_heads"):
            if seg.group.get(key):
                return (
                    f"Muon's {key}= does not run over FSDP2's shards yet; drop it, or leave the model "
                    "unwrapped and pass shard_modules= (or wrap it in DDP)"
                )
    return None


class FsdpMuon:
    """The plan and the step of Muon's matrices over FSDP2's shards (see the module's docstring)."""

    def __init__(self, segs: list[Segment], shards, world, cost_model: CostModel, tp: TensorParallel):
        self.segs, self.world = segs, world
        self.where = [(s, i) for s, seg in enumerate(segs) for i in range(len(seg.params))]
        params = [segs[s].params[i] for s, i in self.where]
        self.shapes = [tp.cut(p).local_shape for p in params]  # FSDP2's local tensors
        steps = [ns_steps_of(segs[s].group) for s, _ in self.where]
        self.views = [matrix_view(tuple(p.shape)) for p in params]
        costs = [n * ns_flops(r, c, k) for (n, r, c), k in zip(self.views, steps)]
        owners = assign_owners(costs, world.world_size)
        where = [shards.where(p) for p in params]
        self.moves = WholeMoves(params, owners, world, [w[0] for w in where], [w[1] for w in where])
        loads = [0.0] * world.world_size
        for c, o in zip(costs, owners):
            loads[o] += c
        per_matrix = [o for o, (n, _, _) in zip(owners, self.views) for _ in range(n)]
        self.plan = MuonPlan(
            per_matrix,
            {},
            {},
            loads,
            [0.0] * world.world_size,
            [x / cost_model.flops for x in loads],
            cost_model,
        )

    def run(self, updates: dict[int, torch.Tensor], muon, meanwhile: Callable[[], None]) -> None:
        """This step's updates (segment position -> flat `U` of its local pieces) orthogonalized
        whole by their owners and applied to the local pieces; counts the owner's work in its stats.
        `meanwhile()` (work of the step's own, AdamW's) runs while the updates travel to the owners,
        and the pieces of the matrices this rank owns are applied while the others travel back."""
        pieces = []
        for (s, i), shape in zip(self.where, self.shapes):
            seg, update = self.segs[s], updates.get(s)
            lo, hi = seg.local_range(i)
            pieces.append(update[lo:hi].view(shape) if update is not None else None)
        like = next(p for p in pieces if p is not None)
        pieces = [p if p is not None else like.new_zeros(shape) for p, shape in zip(pieces, self.shapes)]
        wholes = self.moves.gather(pieces, "Muon's updates to their owners", meanwhile)
        for k, whole in wholes.items():
            s, i = self.where[k]
            seg = self.segs[s]
            if not seg.active[i]:
                continue
            count, rows, cols = self.views[k]
            group, steps = seg.group, ns_steps_of(seg.group)
            matrices = whole.view(count, rows, cols) if count > 1 else whole.view(rows, cols)
            out = newton_schulz(matrices, steps, group["ns_coefficients"], group["eps"], muon.ns_backend)
            wholes[k] = out.reshape(whole.shape)  # (the result, not copied back: the pieces go from it)
            muon.orthogonalized += count
            muon.step_stats["ns_matrices"] += count
            muon.step_stats["ns_flops"] += count * ns_flops(rows, cols, steps)
        me, applied = self.world.rank, lambda own: self._apply(updates, own)  # (own pieces, meanwhile)
        back = self.moves.scatter(wholes, like, "Muon's orthogonalized pieces back", applied)
        self._apply(updates, [None if o == me else b for o, b in zip(self.moves.owners, back)])

    def _apply(self, updates: dict[int, torch.Tensor], back: list[torch.Tensor | None]) -> None:
        """The orthogonalized pieces `back` (by matrix; None: not now) applied to this rank's pieces
        of the stepping parameters with torch.optim.Muon's two in-place steps (FSDP2's memory
        itself where the unit borrows it)."""
        for k, (s, i) in enumerate(self.where):
            seg, (lo, hi) = self.segs[s], self.segs[s].local_range(i)
            if s not in updates or not seg.active[i] or back[k] is None or hi <= lo:
                continue
            g, lr = seg.group, float(seg.group["lr"])
            alr = adjusted_lr(lr, g["adjust_lr_fn"], *self.views[k][1:])
            piece = seg.local_params[lo:hi].view(back[k].shape)
            piece.mul_(1 - lr * g["weight_decay"]).add_(back[k], alpha=-alr)
