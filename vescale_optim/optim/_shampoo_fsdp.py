"""Shampoo over FSDP2's shards: every tile of a matrix computed once in the world, by the owner
of the whole matrix.

Under FSDP2 (`units.fsdp_shards`) every rank holds a piece of every parameter, cut as FSDP2's
placements say (torch.chunk's rows, uneven; HSDP's replicas; the cuts of a 2-D mesh), with no
regard for Shampoo's tiles, which are tiles of the full tensor. The element-wise part of a step
(momentum, the grafting state and update) runs on the local pieces as always (`Shampoo._update`,
exact: element-wise). Then, as Muon does under FSDP2 (`_muon_fsdp`), one all-to-all
(`WholeMoves`) brings each matrix parameter's gradient whole to its owner — on steps that
precondition, with its bias-corrected momentum and grafting update — the owners balanced over
the world by the root work of their tiles (`h^3 + w^3` per tile, the parameter's tiles kept
together). The owner keeps that parameter's factors and roots, every tile of the full tensor
under the one-process keys, runs the tiles' math of the other layouts (`TileGroup`: factors,
roots when due, preconditioned and grafted update), and a second all-to-all sends every rank
its piece of the update, applied to the local pieces. Steps before preconditioning starts move
the gradients only, and nothing comes back (the update is the grafting one, already local).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..owners.balance import assign_owners
from ..units.fsdp_shards import WholeMoves
from ..units.segment import Segment
from ..units.tp_view import TensorParallel
from ._shampoo_math import Tile, matrix_shape, schedule, tiles_of
from ._shampoo_tiles import CHANNELS, FACTORS, TileGroup
from .state_dict import Owned

Staged = tuple[torch.Tensor, torch.Tensor, torch.Tensor, Callable[[], None]]  # grads, mhat, update, apply


def _moves(params: Sequence[torch.Tensor], owners: Sequence[int], shards, world, copies: int) -> WholeMoves:
    """Moves of `copies` tensors per parameter (laid out like it, in a row), all to its owner."""
    where = [shards.where(p) for p in params for _ in range(copies)]
    return WholeMoves(
        [p for p in params for _ in range(copies)],
        [o for o in owners for _ in range(copies)],
        world,
        [w[0] for w in where],
        [w[1] for w in where],
    )


class FsdpShampoo:
    """The plan, the state and the step of Shampoo's matrices over FSDP2's shards (see the
    module's docstring): `segs` the optimizer's non-frozen segments, `shards` the runtime's
    `FsdpGrads` (where every rank's piece of each parameter lies), `world` every rank, `tp` the
    runtime's `TensorParallel` (each parameter's cut: FSDP2's local tensors).

    Between steps a rank keeps only the factors and roots of the matrices it owns (`local`,
    stacked by segment and tile shape); `kept` and `roots` count a step's roots kept instead of
    refreshed and roots computed, as `SegmentTiles` does."""

    def __init__(self, segs: Sequence[Segment], shards, world, tp: TensorParallel):
        self.segs, self.world = list(segs), world
        self.remote: list[TileGroup] = []  # no tile travels alone: whole matrices do
        self.position = {id(seg): s for s, seg in enumerate(self.segs)}
        self.where = [
            (s, i)
            for s, seg in enumerate(self.segs)
            for i, p in enumerate(seg.params)
            if matrix_shape(tuple(p.shape)) is not None
        ]
        params = [self.segs[s].params[i] for s, i in self.where]
        self.shapes = {(s, i): tp.cut(self.segs[s].params[i]).local_shape for s, i in self.where}
        self.tiles = [
            tiles_of(tuple(p.shape), self.segs[s].group["max_preconditioner_dim"], k)
            for k, ((s, _), p) in enumerate(zip(self.where, params))
        ]
        costs = [sum(t.cost for t in ts) for ts in self.tiles]
        self.owners = assign_owners(costs, world.world_size)
        self.gradients = _moves(params, self.owners, shards, world, 1)  # and the updates back
        self.inputs = _moves(params, self.owners, shards, world, CHANNELS)  # gradient, mhat, grafting update
        self._balance(params, costs)
        self.staged: dict[int, Staged] = {}
        self.kept: torch.Tensor | int = 0
        self.roots = 0
        self._allocate()

    def _balance(self, params: Sequence[torch.Tensor], costs: Sequence[float]) -> None:
        """Root work per rank after balancing (`loads`) and at each matrix's home, the rank holding
        most of it (`home_loads`); how many tiles there are and how many travel (those of matrices
        their owner does not hold whole)."""
        n, boxes = self.world.world_size, self.gradients.boxes
        self.loads, self.home_loads = [0.0] * n, [0.0] * n
        for k, cost in enumerate(costs):
            home = max(range(n), key=lambda r, k=k: (boxes[k][r].numel, -r))
            self.loads[self.owners[k]] += cost
            self.home_loads[home] += cost
        self.num_tiles = sum(len(ts) for ts in self.tiles)
        self.moved_tiles = sum(
            len(ts) for k, ts in enumerate(self.tiles) if boxes[k][self.owners[k]].numel < params[k].numel()
        )

    def _allocate(self) -> None:
        """This rank's matrices' tiles, stacked by segment and shape, with zero factors and roots."""
        groups: dict[tuple[int, int, int], TileGroup] = {}
        self.mine: list[Tile] = []  # TileGroup.tiles index this list
        self.at: dict[tuple[int, str], tuple[TileGroup, int]] = {}  # (matrix, tile key) -> its stack and slot
        for k in self.gradients.mine:
            s = self.where[k][0]
            for t in self.tiles[k]:
                g = groups.setdefault((s, t.h, t.w), TileGroup(t.h, t.w, self.segs[s].local_params))
                self.at[k, t.key] = g, len(g.tiles)
                g.tiles.append(len(self.mine))
                self.mine.append(t)
        for g in groups.values():
            g.allocate()
        self.groups = groups
        self.local = list(groups.values())

    # --- the step ---------------------------------------------------------------------------

    def stage(
        self,
        seg: Segment,
        grads: torch.Tensor,
        mhat: torch.Tensor,
        update: torch.Tensor,
        apply: Callable[[], None],
    ) -> bool:
        """Keep a segment's flat local gradient, bias-corrected momentum and grafting update, and
        how to apply the update once its matrices' pieces are in it, for `run`; whether some of
        its matrices refresh their roots this step (the same answer on every rank)."""
        s = self.position[id(seg)]
        self.staged[s] = grads, mhat, update, apply
        return any(schedule(seg.group, seg.steps[i])[1] for t, i in self.where if t == s and seg.active[i])

    def run(self) -> None:
        """The staged segments' matrices whole to their owners, their tiles' math there and the
        updates back into the staged updates, which are then applied (collective over the world:
        every rank stages the same segments, those with a parameter that steps)."""
        staged, self.staged = self.staged, {}
        if staged and self.where:
            self._exchange(staged)
        for *_, apply in staged.values():
            apply()

    def traffic(self) -> tuple[int, int]:
        """Bytes this rank has sent to other ranks and received from them so far (both exchanges)."""
        return tuple(a + b for a, b in zip(self.inputs.traffic, self.gradients.traffic))

    def _steps(self, staged: dict[int, Staged], k: int) -> int:
        """Matrix k's step count this step (0: it takes none)."""
        s, i = self.where[k]
        seg = self.segs[s]
        return seg.steps[i] if s in staged and seg.active[i] else 0

    def _exchange(self, staged: dict[int, Staged]) -> None:
        """One all-to-all of the matrices' gradients to their owners (with mhat and the grafting
        update where some matrix preconditions this step), the owners' math, and, where some
        matrix preconditions, one all-to-all of the updates back into the staged updates."""
        preconditions = any(
            schedule(self.segs[s].group, st)[0]
            for k, (s, _) in enumerate(self.where)
            if (st := self._steps(staged, k))
        )
        channels, moves = (CHANNELS, self.inputs) if preconditions else (1, self.gradients)
        like = next(iter(staged.values()))[1]
        pieces = [self._piece(staged, k, c, like) for k in range(len(self.where)) for c in range(channels)]
        wholes = moves.gather(pieces, "Shampoo's matrices to their owners")
        views = {
            k: [self._matrix(wholes[k * channels + c]) for c in range(channels)] for k in self.gradients.mine
        }
        self._compute(staged, views)
        if not preconditions:
            return
        back = self.gradients.scatter(
            {k: wholes[k * channels + 2] for k in self.gradients.mine}, like, "Shampoo's updates back"
        )
        for k, (s, i) in enumerate(self.where):
            if s in staged and back[k] is not None:
                lo, hi = self.segs[s].local_range(i)
                staged[s][2][lo:hi].copy_(back[k].reshape(-1))

    @staticmethod
    def _matrix(whole: torch.Tensor) -> torch.Tensor:
        """A whole parameter's tensor seen as `[shape[0], rest]`, the matrix its tiles cut."""
        return whole.view(matrix_shape(tuple(whole.shape)))

    def _piece(self, staged: dict[int, Staged], k: int, channel: int, like: torch.Tensor) -> torch.Tensor:
        """This rank's piece of matrix k's `channel` (gradient, mhat, grafting update) in its local
        shape; zeros for a segment that does not step."""
        s, i = self.where[k]
        seg, shape = self.segs[s], self.shapes[s, i]
        if s not in staged:
            return like.new_zeros(shape)
        lo, hi = seg.local_range(i)
        return staged[s][channel][lo:hi].view(shape).to(like.dtype)

    def _compute(self, staged: dict[int, Staged], views: dict[int, list[torch.Tensor]]) -> None:
        """Every owned tile's factors, roots when due and update (written over the grafting update
        of the whole matrix, `views[k][2]`, where preconditioning started)."""
        for (s, _, _), g in self.groups.items():
            tiles = [self.mine[j] for j in g.tiles]
            steps = [self._steps(staged, t.param) for t in tiles]
            if not any(steps):
                continue
            inputs = [
                torch.stack([views[t.param][c][t.r0 : t.r1, t.c0 : t.c1] for t in tiles])
                for c in range(len(views[tiles[0].param]))
            ]
            grad, mhat, graft = inputs if len(inputs) == CHANNELS else inputs * CHANNELS  # mhat unused then
            out, kept, roots = g.step(self.segs[s].group, steps, grad, mhat, graft)
            self.kept += kept
            self.roots += roots
            for t, u in zip(tiles, out if out is not None else ()):
                views[t.param][2][t.r0 : t.r1, t.c0 : t.c1].copy_(u)

    # --- checkpoints ------------------------------------------------------------------------

    def owned(self, seg: Segment) -> list[list[Owned]]:
        """Per parameter of `seg`, every tile's `L_i_j`, `R_i_j`, `L_inv_root_i_j` and
        `R_inv_root_i_j` of the full tensor, kept whole by the matrix's owner (a world rank)."""
        out: list[list[Owned]] = [[] for _ in seg.params]
        s = self.position.get(id(seg))
        for k, (t_s, i) in enumerate(self.where):
            if t_s != s:
                continue
            for t in self.tiles[k]:
                g, j = self.at.get((k, t.key), (None, 0))
                for name, side in zip(FACTORS, (t.h, t.w, t.h, t.w)):
                    tensor = g.state[name][j] if g is not None else None
                    out[i].append(Owned(f"{name}_{t.key}", (side, side), self.owners[k], tensor))
        return out
