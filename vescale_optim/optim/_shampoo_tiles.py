"""Shampoo's tiles on a rank: the ones it owns, stacked by shape with their factors and roots,
and the moves that bring a tile whose rows its owner does not hold to the owner and its
update back. The math is `_shampoo_math`'s; the optimizer is `shampoo.Shampoo`."""

from __future__ import annotations

import torch

from ..shard import Comm, Piece, plan_gather_to_owner, plan_scatter_from_owner
from ..shard.plan import owner_offsets
from ._shampoo_math import (
    Tile,
    bias_correction,
    inverse_roots_,
    matrix_shape,
    precondition,
    schedule,
    update_factors_,
)
from .moves import Move
from .segment import Segment

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
        self, group: dict, step: int, grad: torch.Tensor, mhat: torch.Tensor, graft: torch.Tensor
    ) -> tuple[torch.Tensor | None, int]:
        """Update the factors from `grad` `[K, h, w]`, refresh the roots when due; return the
        grafted, preconditioned `mhat` (None before preconditioning starts) and how many roots
        were kept instead of refreshed."""
        apply, refresh = schedule(group, step)
        s, beta2 = self.state, group["betas"][1]
        update_factors_(s["L"], s["R"], grad, beta2)
        kept = 0
        if refresh:
            kw = dict(step=step, beta2=beta2, epsilon=group["epsilon"], dtype=group["root_dtype"])
            kept = sum(inverse_roots_(s[f"{f}_inv_root"], s[f], **kw) for f in "LR")
        if not apply:
            return None, kept
        use = graft if group["grafting"] is not None else None
        return precondition(s["L_inv_root"], mhat, s["R_inv_root"], use), kept


class BucketTiles:
    """One seg's tiles seen from this rank: the tiles it owns (grouped by shape), and the
    plans that bring a tile whose rows its owner does not hold to the owner (gradient, mhat
    and grafting update) and the tile's update back. Between steps it holds only factors and
    roots: tiles are read from the step's flat tensors and staging buffers live for one step."""

    def __init__(self, seg: Segment, tiles: list[Tile], owners: list[int], held, comm: Comm):
        self.tiles, self.owners, self.held, self.comm = tiles, owners, held, comm
        self.seg, self.like = seg, seg.local_params
        self.where = {}  # param -> (local range, first local row, columns)
        for t in tiles:
            n = matrix_shape(seg.params[t.param].shape)[1]
            lo, hi = seg.local_range(t.param)
            self.where[t.param] = (lo, hi, seg.tensor_range(t.param)[0] // n, n)
        moved = [k for k, t in enumerate(tiles) if held[k][owners[k]] != (0, t.h)]
        # by first holder, so that runs from one rank arrive in order (received in place)
        moved.sort(key=lambda k: (min(r for r, (a, b) in enumerate(held[k]) if b > a), k))
        self.moved = len(moved)
        self.kept = 0  # roots kept instead of refreshed, counted by `step`
        recv_at, result_at = self._plan_moves(moved) if moved else ([], [])
        groups: dict[tuple[bool, int, int], TileGroup] = {}
        self.owned: dict[int, tuple[TileGroup, int]] = {}
        position = {k: j for j, k in enumerate(moved)}
        for k, t in enumerate(tiles):
            if owners[k] != comm.rank:
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
        update) that each holder sends its rows of; scatter plan: tensor j, the update, back."""
        me, world, tiles, held = self.comm.rank, self.comm.world_size, self.tiles, self.held
        numels = [tiles[k].h * tiles[k].w for k in moved]
        owners1 = [self.owners[k] for k in moved]
        gather, back, send_numel, back_numel = [], [], [], []
        self.pack, self.unpack = [], []  # (tile, rows a, b, offset in send / back buffer)
        for r in range(world):
            off3 = off1 = 0
            for j in sorted(range(len(moved)), key=lambda j: (owners1[j], j)):  # send order
                a, b = held[moved[j]][r]
                if b <= a:
                    continue
                t = tiles[moved[j]]
                gather += [Piece(r, 3 * j + c, off3 + c * (b - a) * t.w, a * t.w, b * t.w) for c in range(3)]
                back.append(Piece(r, j, off1, a * t.w, b * t.w))
                if r == me:
                    self.pack.append((t, a, b, off3))
                    self.unpack.append((t, a, b, off1))
                off3, off1 = off3 + 3 * (b - a) * t.w, off1 + (b - a) * t.w
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

    def step(self, group: dict, step: int, grads: torch.Tensor, exp_avg: torch.Tensor,
             update: torch.Tensor, finish) -> Move | None:  # fmt: skip
        """Factor updates, roots and preconditioned, grafted updates of every tile, from the
        local flat `grads`, `exp_avg` (mhat is `exp_avg / (1 - b1^t)`) and grafting `update`;
        the tiles' updates overwrite theirs in `update`, then `finish()` applies it. Tiles
        that travel make this a `Move` (returned); otherwise it all happens now. Roots kept
        instead of refreshed are added to `self.kept`."""
        bc1, (apply, _) = bias_correction(group["betas"][0], step), schedule(group, step)
        flats = (grads, exp_avg, update)

        def local() -> None:
            for g in self.local:
                views = [[self._rows(f, self.tiles[k], 0, g.h) for k in g.tiles] for f in flats]
                grad, mhat, graft = (torch.stack(v) for v in views)
                out, n = g.step(group, step, grad, mhat.div_(bc1), graft)
                self.kept += n
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
            out[1].div_(bc1)
        back = self.like.new_empty(back_numel)

        def compute(recv: torch.Tensor) -> torch.Tensor:
            result = self.like.new_empty(result_numel if apply else 0)
            for g in self.remote:
                n, shape = g.h * g.w, (len(g.tiles), g.h, g.w)
                channels = [torch.stack([recv[a + c * n : a + (c + 1) * n] for a, _ in g.at])
                            for c in range(3)]  # fmt: skip
                grad, mhat, graft = (x.view(shape) for x in channels)
                out, k = g.step(group, step, grad, mhat, graft)
                self.kept += k
                for (_, r), u in zip(g.at, out if out is not None else ()):
                    result[r : r + n].view(g.h, g.w).copy_(u)
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
