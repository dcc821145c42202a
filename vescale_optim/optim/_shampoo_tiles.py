"""Shampoo's tiles on a rank: the ones it owns, stacked by shape with their factors and roots,
and the step that brings a tile whose rows its owner does not hold to the owner and its
update back, as the owner layer planned it (`owners.plan`). The math is
`_shampoo_math`'s; the optimizer is `shampoo.Shampoo`."""

from __future__ import annotations

import torch

from ..owners.moves import Move
from ..owners.plan import SegmentMoves, WorkItem
from ..shard.comm import host_to_device
from ..shard.redistribution import Piece
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
        for step, idx in _by_step(steps, grad.device):
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


def _by_step(steps: list[int], device: torch.device):
    """`(step, indices)` for each step count among the tiles that step (indices None when
    every tile steps at one count: no indexing, the common case); the indices on `device`,
    copied there without stalling it."""
    if steps and steps[0] and all(st == steps[0] for st in steps):
        return [(steps[0], None)]
    found: dict[int, list[int]] = {}
    for j, st in enumerate(steps):
        if st:
            found.setdefault(st, []).append(j)
    return [(st, host_to_device(idx, torch.int64, device)) for st, idx in found.items()]


CHANNELS = 3  # what travels to a tile's owner: gradient, mhat, grafting update


def rows_held(seg: Segment, t: Tile, rank: int, shapes: list[tuple[int, ...]]) -> tuple[int, int]:
    """Rows `[a, b)` of tile `t`, counted from its first row, that `rank` holds (`shapes`: the
    segment's parameters' local shapes)."""
    n = matrix_shape(shapes[t.param])[1]
    start, stop = seg.layout.rank_range(t.param, rank)
    first, last = (start - seg.layout.offsets[t.param]) // n, (stop - seg.layout.offsets[t.param]) // n
    a, z = max(first, t.r0) - t.r0, min(last, t.r1) - t.r0
    return (a, z) if z > a else (0, 0)


def tile_work(tiles: list[Tile], held: list[list[tuple[int, int]]]) -> list[WorkItem]:
    """The tiles as work items: `held[k][s]`, the rows `[a, b)` of tile k that shard rank s
    holds, are its pieces (staged: their offsets are the plan's); its cost its root work; its
    home the rank holding most of its rows (ties: the lowest)."""
    items = []
    for k, t in enumerate(tiles):
        pieces = tuple(Piece(s, k, 0, a * t.w, b * t.w) for s, (a, b) in enumerate(held[k]) if b > a)
        home = min(range(len(held[k])), key=lambda s, h=held[k]: (h[s][0] - h[s][1], s))
        items.append(WorkItem(pieces, t.cost, home))
    return items


class SegmentTiles:
    """One segment's tiles seen from this rank (`shapes`: its parameters' local shapes, which the
    tiles cut): the tiles it owns (grouped by shape), and the
    moves that bring a tile whose rows its owner does not hold to the owner (gradient, mhat
    and grafting update) and the tile's update back. Between steps it holds only factors and
    roots: tiles are read from the step's flat tensors and staging buffers live for one step."""

    def __init__(self, seg: Segment, tiles: list[Tile], moves: SegmentMoves, shapes: list[tuple[int, ...]]):
        self.tiles, self.moves, self.owners = tiles, moves, moves.owners
        self.seg, self.like = seg, seg.local_params
        self.where = {}  # param -> (local range, first local row, columns)
        for t in tiles:
            n = matrix_shape(shapes[t.param])[1]
            lo, hi = seg.local_range(t.param)
            self.where[t.param] = (lo, hi, seg.tensor_range(t.param)[0] // n, n)
        self.moved = len(moves.moved)
        self.kept = self.roots = 0  # roots kept instead of refreshed, and roots computed, by `step`
        groups: dict[tuple[bool, int, int], TileGroup] = {}
        self.owned: dict[int, tuple[TileGroup, int]] = {}
        arriving = set(moves.arriving)
        for k in sorted([*moves.local, *moves.arriving]):
            t, remote = tiles[k], k in arriving
            g = groups.setdefault((remote, t.h, t.w), TileGroup(t.h, t.w, self.like))
            self.owned[k] = (g, len(g.tiles))
            g.tiles.append(k)
            if remote:
                g.at.append((moves.received_at[k], moves.result_at[k]))
        for g in groups.values():
            g.allocate()
        self.local = [g for (remote, _, _), g in groups.items() if not remote]
        self.remote = [g for (remote, _, _), g in groups.items() if remote]

    def _rows(self, flat: torch.Tensor, t: Tile, a: int, b: int) -> torch.Tensor:
        """Rows `[a, b)` of tile `t` in a local flat tensor of the seg, as a `[b - a, w]`
        view (this rank holds them)."""
        lo, hi, first, n = self.where[t.param]
        return flat[lo:hi].view(-1, n)[t.r0 + a - first : t.r0 + b - first, t.c0 : t.c1]

    def _pack(self, flats: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """What this rank sends of the tiles that travel: their rows of each flat (gradient, mhat,
        grafting update), one channel after the other, at the plan's offsets."""
        send = self.like.new_empty(self.moves.send_numel)
        for k, p, off in self.moves.pack:
            t = self.tiles[k]
            a, b = p.start // t.w, p.stop // t.w
            out = send[off : off + CHANNELS * (b - a) * t.w].view(CHANNELS, b - a, t.w)
            for c, flat in enumerate(flats):
                out[c].copy_(self._rows(flat, t, a, b))
        return send

    def step(
        self,
        group: dict,
        steps: list[int],
        grads: torch.Tensor,
        mhat: torch.Tensor,
        update: torch.Tensor,
        finish,
    ) -> Move | None:
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

        moves, send = self.moves, self._pack(flats)

        def compute(recv: torch.Tensor) -> torch.Tensor:
            result = self.like.new_empty(moves.result_numel if apply else 0)
            for g in self.remote:
                n, shape = g.h * g.w, (len(g.tiles), g.h, g.w)
                channels = [
                    torch.stack([recv[a + c * n : a + (c + 1) * n] for a, _ in g.at]) for c in range(CHANNELS)
                ]
                out = run(g, *(x.view(shape) for x in channels))
                if apply:  # every tile's update goes back (the grafting update where none started)
                    for (_, r), u in zip(g.at, out if out is not None else channels[2]):
                        result[r : r + n].view(g.h, g.w).copy_(u.view(g.h, g.w))
            return result

        def done(back: torch.Tensor) -> None:
            if apply:
                for k, p, at in moves.returned:
                    t = self.tiles[k]
                    a, b = p.start // t.w, p.stop // t.w
                    self._rows(update, t, a, b).copy_(back[at : at + (b - a) * t.w].view(b - a, t.w))
            finish()

        return moves.move(send, compute=compute, finish=done, local=local, label="shampoo", returns=apply)

    def factors(self, k: int) -> dict[str, torch.Tensor]:
        g, i = self.owned[k]
        return {name: t[i] for name, t in g.state.items()}
