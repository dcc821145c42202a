"""Shampoo's tiles on a rank: the ones it owns, stacked by shape with their factors and roots,
and the moves that bring a tile whose rows its owner does not hold to the owner and its
update back. The math is `_shampoo_math`'s; the optimizer is `shampoo.Shampoo`."""

from __future__ import annotations

import torch

from ..shard.mesh import Topology
from ..shard.redistribution import Piece, owner_offsets, plan_gather_to_owner, plan_scatter_from_owner
from ..units.moves import Move
from ..units.segment import Segment
from ._shampoo_math import (
    Tile,
    inverse_roots_,
    matrix_shape,
    precondition,
    schedule,
    update_factors_,
)

FACTORS = ("L", "R", "L_inv_root", "R_inv_root")


class TileGroup:
    """Tiles of one shape owned by this rank, with their factors and roots stacked `[K, d, d]`;
    `at` holds, for tiles that travel, where each one lies in the step's receive and result
    buffers."""

    def __init__(self, h: int, w: int, like: torch.Tensor):
        self.tiles: list[int] = []
        self.at: list[tuple[int, int]] = []
        self.h, self.w, self.like = h, w, like

    def allocate(self) -> None:
        k, h, w = len(self.tiles), self.h, self.w
        new = lambda d: self.like.new_zeros(k, d, d)  # noqa: E731
        self.state = dict(zip(FACTORS, (new(h), new(w), new(h), new(w))))

    def step(
        self, group: dict, steps: list[int], grad: torch.Tensor, mhat: torch.Tensor, graft: torch.Tensor
    ) -> tuple[torch.Tensor | None, int, int]:
        """Update the factors from `grad` `[K, h, w]` and refresh the roots when due, for the
        tiles whose parameter steps (`steps[j]`, its step count; 0: it takes none). Return
        every tile's update (the grafting update `graft` where preconditioning has not
        started; None if it started nowhere), how many roots were kept instead of refreshed,
        and how many were computed."""
        s, beta2 = self.state, group["betas"][1]
        out, kept, roots = None, 0, 0
        for step, idx in _by_step(steps):
            pick = (lambda x: x) if idx is None else (lambda x, idx=idx: x[idx])
            left, right = pick(s["L"]), pick(s["R"])
            update_factors_(left, right, pick(grad), beta2)
            apply, refresh = schedule(group, step)
            if refresh:
                kw = dict(step=step, beta2=beta2, epsilon=group["epsilon"], dtype=group["root_dtype"])
                roots_lr = pick(s["L_inv_root"]), pick(s["R_inv_root"])
                kept += inverse_roots_(roots_lr[0], left, **kw) + inverse_roots_(roots_lr[1], right, **kw)
                roots += 2 * len(left)
            if idx is not None:  # indexing copied: write back
                s["L"][idx], s["R"][idx] = left, right
                if refresh:
                    s["L_inv_root"][idx], s["R_inv_root"][idx] = roots_lr
            if apply:
                out = graft.clone() if out is None else out
                use = pick(graft) if group["grafting"] is not None else None
                update = precondition(pick(s["L_inv_root"]), pick(mhat), pick(s["R_inv_root"]), use)
                if idx is None:
                    out = update
                else:
                    out[idx] = update
        return out, kept, roots


def _by_step(steps: list[int]):
    """`(step, indices)` for each step count among the tiles that step (indices None when
    every tile steps at one count: no indexing, the common case)."""
    if steps and steps[0] and all(st == steps[0] for st in steps):
        return [(steps[0], None)]
    found: dict[int, list[int]] = {}
    for j, st in enumerate(steps):
        if st:
            found.setdefault(st, []).append(j)
    return [(st, torch.tensor(idx)) for st, idx in found.items()]


class SegmentTiles:
    """One segment's tiles seen from this rank: the tiles it owns (grouped by shape), and the
    plans that bring a tile whose rows its owner does not hold to the owner (gradient, mhat
    and grafting update) and the tile's update back. Between steps it holds only factors and
    roots: tiles are read from the step's flat tensors and staging buffers live for one step.

    Owners are ranks of the world (`topology`); `held[k][s]` are the rows of tile k that
    shard rank s holds, in every replica. With replicas, an owner gathers from its own
    replica and sends the update to every replica, so each tile is computed once."""

    def __init__(self, seg: Segment, tiles: list[Tile], owners: list[int], held, topology: Topology, me: int):
        self.tiles, self.owners, self.held, self.topology, self.me = tiles, owners, held, topology, me
        self.seg, self.like = seg, seg.local_params
        self.where = {}  # param -> (local range, first local row, columns)
        for t in tiles:
            n = matrix_shape(seg.params[t.param].shape)[1]
            lo, hi = seg.local_range(t.param)
            self.where[t.param] = (lo, hi, seg.tensor_range(t.param)[0] // n, n)
        if topology.replicas == 1:  # a tile whose owner holds all its rows stays in place
            moved = [k for k, t in enumerate(tiles) if held[k][owners[k]] != (0, t.h)]
        else:
            moved = list(range(len(tiles)))
        # by first holder, so that runs from one rank arrive in order (received in place)
        moved.sort(key=lambda k: (min(r for r, (a, b) in enumerate(held[k]) if b > a), k))
        self.moved = len(moved)
        self.kept = self.roots = 0  # roots kept instead of refreshed, and roots computed, by `step`
        recv_at, result_at = self._plan_moves(moved) if moved else ([], [])
        groups: dict[tuple[bool, int, int], TileGroup] = {}
        self.owned: dict[int, tuple[TileGroup, int]] = {}
        position = {k: j for j, k in enumerate(moved)}
        for k, t in enumerate(tiles):
            if owners[k] != me:
                continue
            remote = k in position
            g = groups.setdefault((remote, t.h, t.w), TileGroup(t.h, t.w, self.like))
            self.owned[k] = (g, len(g.tiles))
            g.tiles.append(k)
            if remote:
                g.at.append((recv_at[3 * position[k]], result_at[position[k]]))
        for g in groups.values():
            g.allocate()
        self.local = [g for (remote, _, _), g in groups.items() if not remote]
        self.remote = [g for (remote, _, _), g in groups.items() if remote]

    def _rows(self, flat: torch.Tensor, t: Tile, a: int, b: int) -> torch.Tensor:
        """Rows `[a, b)` of tile `t` in a local flat tensor of the seg, as a `[b - a, w]`
        view (this rank holds them)."""
        lo, hi, first, n = self.where[t.param]
        return flat[lo:hi].view(-1, n)[t.r0 + a - first : t.r0 + b - first, t.c0 : t.c1]

    def _plan_moves(self, moved: list[int]):
        """Gather plan: moved tile j is three tensors `3j + c` (c: gradient, mhat, grafting
        update) that each holder in the owner's replica sends its rows of; scatter plan:
        tensor j, the update, back to every holder of every replica."""
        topo, me, tiles, held = self.topology, self.me, self.tiles, self.held
        world = topo.world_size
        numels = [tiles[k].h * tiles[k].w for k in moved]
        owners1 = [self.owners[k] for k in moved]
        from_replica = [topo.coords(o)[0] for o in owners1]
        gather, back, send_numel, back_numel = [], [], [], []
        self.pack, self.unpack = [], []  # (tile, rows a, b, offset in send / back buffer)
        for w in range(world):
            replica, r = topo.coords(w)
            off3 = off1 = 0
            for j in sorted(range(len(moved)), key=lambda j: (owners1[j], j)):  # send order
                a, b = held[moved[j]][r]
                if b <= a:
                    continue
                t, n = tiles[moved[j]], (b - a) * tiles[moved[j]].w
                if from_replica[j] == replica:
                    gather += [Piece(w, 3 * j + c, off3 + c * n, a * t.w, b * t.w) for c in range(3)]
                    if w == me:
                        self.pack.append((t, a, b, off3))
                    off3 += 3 * n
                back.append(Piece(w, j, off1, a * t.w, b * t.w))
                if w == me:
                    self.unpack.append((t, a, b, off1))
                off1 += n
            send_numel.append(off3)
            back_numel.append(off1)
        owners3, numels3 = [o for o in owners1 for _ in "gma"], [n for n in numels for _ in "gma"]
        recv_at, recv_numel = owner_offsets(numels3, owners3, world)
        result_at, result_numel = owner_offsets(numels, owners1, world)
        self.gather = plan_gather_to_owner(gather, numels3, owners3, world, send_numel)
        self.scatter = plan_scatter_from_owner(back, numels, owners1, world, back_numel)
        self.programs = (self.gather.program(me), self.scatter.program(me))
        self.numels = (send_numel[me], recv_numel[me], result_numel[me], back_numel[me])
        return recv_at, result_at

    def step(self, group: dict, steps: list[int], grads: torch.Tensor, mhat: torch.Tensor,
             update: torch.Tensor, finish) -> Move | None:  # fmt: skip
        """Factor updates, roots and preconditioned, grafted updates of the tiles whose
        parameter steps (`steps[k]`: its step count, 0 for none), from the local flat
        `grads`, bias-corrected momentum `mhat` and grafting `update`; the tiles' updates
        overwrite theirs in `update`, then `finish()` applies it. Tiles that travel make this
        a `Move` (returned); otherwise it all happens now. Roots kept instead of refreshed,
        and roots computed, are added to `self.kept` and `self.roots`."""
        apply = any(schedule(group, st)[0] for st in steps if st)
        flats = (grads, mhat, update)

        def run(g: TileGroup, grad, mhat_, graft):
            out, kept, roots = g.step(group, [steps[k] for k in g.tiles], grad, mhat_, graft)
            self.kept += kept
            self.roots += roots
            return out

        def local() -> None:
            for g in self.local:
                views = [[self._rows(f, self.tiles[k], 0, g.h) for k in g.tiles] for f in flats]
                out = run(g, *(torch.stack(v) for v in views))
                for view, u in zip(views[2], out if out is not None else ()):
                    view.copy_(u)

        if not self.moved:
            local()
            finish()
            return None
        send_numel, _, result_numel, back_numel = self.numels
        send = self.like.new_empty(send_numel)
        for t, a, b, off in self.pack:
            out = send[off : off + 3 * (b - a) * t.w].view(3, b - a, t.w)
            for c, flat in enumerate(flats):
                out[c].copy_(self._rows(flat, t, a, b))
        back = self.like.new_empty(back_numel)

        def compute(recv: torch.Tensor) -> torch.Tensor:
            result = self.like.new_empty(result_numel if apply else 0)
            for g in self.remote:
                n, shape = g.h * g.w, (len(g.tiles), g.h, g.w)
                channels = [torch.stack([recv[a + c * n : a + (c + 1) * n] for a, _ in g.at])
                            for c in range(3)]  # fmt: skip
                out = run(g, *(x.view(shape) for x in channels))
                if apply:  # every tile's update goes back (the grafting update where none started)
                    for (_, r), u in zip(g.at, out if out is not None else channels[2]):
                        result[r : r + n].view(g.h, g.w).copy_(u.view(g.h, g.w))
            return result

        def done() -> None:
            if apply:
                for t, a, b, off in self.unpack:
                    self._rows(update, t, a, b).copy_(back[off : off + (b - a) * t.w].view(b - a, t.w))
            finish()

        return Move(
            gather=self.gather, src=send, compute=compute, finish=done, local=local, label="shampoo",
            scatter=self.scatter if apply else None, dst=back, programs=self.programs,
        )  # fmt: skip

    def factors(self, k: int) -> dict[str, torch.Tensor]:
        g, i = self.owned[k]
        return {name: t[i] for name, t in g.state.items()}
