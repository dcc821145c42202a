"""Sharded Shampoo: each tile's Kronecker factors and inverse roots live on one rank."""

from __future__ import annotations

import torch

from ..shard import (
    Comm,
    Piece,
    plan_gather_to_owner,
    plan_scatter_from_owner,
    run_plan,
)
from ..shard.plan import owner_offsets
from ._shampoo_math import (
    Tile,
    balance,
    check_hyperparameters,
    grafting_step_,
    inverse_roots_,
    matrix_shape,
    precondition,
    rank_loads,
    stripe_unit,
    tiles_of,
    update_factors_,
)
from .base import ShardedOptimizer
from .bucket import Bucket

_FACTORS = ("L", "R", "L_inv_root", "R_inv_root")
_SECOND = {"adam": "exp_avg_sq", "adagrad": "sum"}


class _Group:
    """Tiles of one shape owned by this rank: views of their inputs `[3, h, w]` (gradient,
    bias-corrected momentum, grafting update), of their outputs `[h, w]`, and stacked state."""

    def __init__(self, h: int, w: int, like: torch.Tensor):
        self.tiles: list[int] = []
        self.src: list[torch.Tensor] = []
        self.dst: list[torch.Tensor] = []
        self.h, self.w, self.like = h, w, like

    def allocate(self) -> None:
        k, h, w = len(self.tiles), self.h, self.w
        new = lambda d: self.like.new_zeros(k, d, d)  # noqa: E731
        self.state = dict(zip(_FACTORS, (new(h), new(w), new(h), new(w))))

    def step(self, group: dict, step: int, refresh: bool, apply: bool) -> None:
        x = torch.stack(self.src)
        grad, mhat, graft = x.unbind(1)
        s, beta2 = self.state, group["betas"][1]
        update_factors_(s["L"], s["R"], grad, beta2)
        if refresh:
            kw = dict(step=step, beta2=beta2, epsilon=group["epsilon"], dtype=group["root_dtype"])
            inverse_roots_(s["L_inv_root"], s["L"], **kw)
            inverse_roots_(s["R_inv_root"], s["R"], **kw)
        if apply:
            use = graft if group["grafting"] is not None else None
            for out, u in zip(self.dst, precondition(s["L_inv_root"], mhat, s["R_inv_root"], use)):
                out.copy_(u)


class _BucketTiles:
    """One bucket's tiles seen from this rank: the tiles it owns (grouped by shape), and
    the plans and staging buffers that bring a tile whose rows its owner does not hold to
    the owner (gradient, mhat and grafting update) and the tile's update back."""

    def __init__(self, bucket: Bucket, tiles: list[Tile], owners: list[int], held, comm: Comm):
        self.tiles, self.owners, self.held, self.comm = tiles, owners, held, comm
        self.bucket, self.like = bucket, bucket.local_params
        self.work = self.like.new_zeros(3, bucket.layout.shard_size)  # gradient, mhat, update
        moved = [k for k, t in enumerate(tiles) if held[k][owners[k]] != (0, t.h)]
        # by first holder, so that runs from one rank arrive in order (received in place)
        moved.sort(key=lambda k: (min(r for r, (a, b) in enumerate(held[k]) if b > a), k))
        self.moved = len(moved)
        recv_at, result_at = self._plan_moves(moved) if moved else ([], [])
        groups: dict[tuple[bool, int, int], _Group] = {}
        self.owned: dict[int, tuple[_Group, int]] = {}
        position = {k: j for j, k in enumerate(moved)}
        for k, t in enumerate(tiles):
            if owners[k] != comm.rank:
                continue
            remote, hw = k in position, t.h * t.w
            g = groups.setdefault((remote, t.h, t.w), _Group(t.h, t.w, self.like))
            self.owned[k] = (g, len(g.tiles))
            g.tiles.append(k)
            if remote:
                at, out = recv_at[3 * position[k]], result_at[position[k]]
                g.src.append(self.recv[at : at + 3 * hw].view(3, t.h, t.w))
                g.dst.append(self.result[out : out + hw].view(t.h, t.w))
            else:
                g.src.append(self._rows(t, 0, t.h))
                g.dst.append(g.src[-1][2])
        for g in groups.values():
            g.allocate()
        self.local = [g for (remote, _, _), g in groups.items() if not remote]
        self.remote = [g for (remote, _, _), g in groups.items() if remote]

    def _rows(self, t: Tile, a: int, b: int) -> torch.Tensor:
        """Rows `[a, b)` of tile `t` in `work`, as a `[3, b - a, w]` view (this rank holds them)."""
        n = matrix_shape(self.bucket.params[t.param].shape)[1]
        lo, hi = self.bucket.pbuf.local_range(t.param)
        first = self.bucket.pbuf.tensor_range(t.param)[0] // n
        return self.work[:, lo:hi].view(3, -1, n)[:, t.r0 + a - first : t.r0 + b - first, t.c0 : t.c1]

    def _plan_moves(self, moved: list[int]):
        """Gather plan: moved tile j is three tensors `3j + c` (c: gradient, mhat, grafting
        update) that each holder sends its rows of; scatter plan: tensor j, the update, back."""
        me, world, tiles, held = self.comm.rank, self.comm.world_size, self.tiles, self.held
        numels = [tiles[k].h * tiles[k].w for k in moved]
        owners1 = [self.owners[k] for k in moved]
        gather, back, send_numel, back_numel, mine = [], [], [], [], []
        for r in range(world):
            off3 = off1 = 0
            for j in sorted(range(len(moved)), key=lambda j: (owners1[j], j)):  # send order
                a, b = held[moved[j]][r]
                if b <= a:
                    continue
                w = tiles[moved[j]].w
                gather += [Piece(r, 3 * j + c, off3 + c * (b - a) * w, a * w, b * w) for c in range(3)]
                back.append(Piece(r, j, off1, a * w, b * w))
                if r == me:
                    mine.append((tiles[moved[j]], a, b, off3, off1))
                off3, off1 = off3 + 3 * (b - a) * w, off1 + (b - a) * w
            send_numel.append(off3)
            back_numel.append(off1)
        owners3, numels3 = [o for o in owners1 for _ in "gma"], [n for n in numels for _ in "gma"]
        recv_at, recv_numel = owner_offsets(numels3, owners3, world)
        result_at, result_numel = owner_offsets(numels, owners1, world)
        self.gather = plan_gather_to_owner(gather, numels3, owners3, world, send_numel)
        self.scatter = plan_scatter_from_owner(back, numels, owners1, world, back_numel)
        self.programs = (self.gather.program(me), self.scatter.program(me))
        new = self.like.new_zeros
        self.send, self.back = new(send_numel[me]), new(back_numel[me])
        self.recv, self.result = new(recv_numel[me]), new(result_numel[me])
        self.pack, self.unpack = [], []
        for t, a, b, off3, off1 in mine:
            n = (b - a) * t.w
            self.pack.append((self._rows(t, a, b), self.send[off3 : off3 + 3 * n].view(3, b - a, t.w)))
            self.unpack.append((self.back[off1 : off1 + n].view(b - a, t.w), self._rows(t, a, b)[2]))
        return recv_at, result_at

    def step(self, group: dict, step: int) -> None:
        """Factor updates, roots and preconditioned, grafted updates of every tile; the
        updates land in `work[2]` (which holds the grafting update elsewhere)."""
        start, freq = group["start_preconditioning_step"], group["precondition_frequency"]
        apply = step >= start
        refresh = apply and (step - start) % freq == 0
        handle = None
        if self.moved:
            for src, dst in self.pack:
                dst.copy_(src)
            handle = run_plan(self.gather, self.send, self.recv, self.comm, self.programs[0], async_op=True)
        for g in self.local:
            g.step(group, step, refresh, apply)
        if handle is None:
            return
        handle.wait()
        for g in self.remote:
            g.step(group, step, refresh, apply)
        if apply:
            run_plan(self.scatter, self.result, self.back, self.comm, self.programs[1])
            for src, dst in self.unpack:
                dst.copy_(src)

    def factors(self, k: int) -> dict[str, torch.Tensor]:
        g, i = self.owned[k]
        return {name: t[i] for name, t in g.state.items()}


class Shampoo(ShardedOptimizer):
    r"""Shampoo with grafting, ragged-sharded so that every tile lives on one rank.

    A parameter with 2+ dims is viewed as `[shape[0], prod(shape[1:])]` and cut into tiles
    of at most `max_preconditioner_dim` per side (blocks of that size, the last shorter),
    on the global tensor. With the averaged gradient g, step t (from 1), per parameter:

    - momentum: `m <- b1*m + (1-b1)*g`, `mhat = m / (1 - b1^t)`;
    - grafting update A (element-wise): adam `v <- b2*v + (1-b2)*g^2`,
      `A = mhat / (sqrt(v)/sqrt(1-b2^t) + grafting_epsilon)`; adagrad `v <- v + g^2`,
      `A = mhat / (sqrt(v) + grafting_epsilon)`; sgd and None `A = mhat`;
    - per tile G of g: `L <- b2*L + (1-b2)*G@G.T`, `R <- b2*R + (1-b2)*G.T@G` (plain sums
      when `b2 == 1`, and then no bias corrections for v, L, R);
    - at steps `t = start + k*precondition_frequency` (`start = start_preconditioning_step`):
      `L_inv_root = (L/(1-b2^t))^(-1/4)` by `torch.linalg.eigh` in `root_dtype` (float64
      if that fails) with eigenvalues `max(lam, 0) + epsilon`, the same for R; a factor
      that is not finite keeps its previous root;
    - update U: from `start` on, per tile `D = L_inv_root @ Mhat @ R_inv_root`, rescaled to
      `D * |A|_F / |D|_F` over the tile (no rescaling with `grafting=None`); before `start`,
      and always for 1-D parameters, `U = A`;
    - `p <- p * (1 - lr*weight_decay) - lr * U`.

    The layout's unit for a matrix with `m` rows is a stripe of `max_preconditioner_dim`
    rows (the whole matrix when `m <= max_preconditioner_dim`); when stripes do not divide
    `m`, it is `gcd(m, max_preconditioner_dim)` rows, and a stripe cut by a rank boundary
    is gathered to one rank. Each tile's factors and roots are computed only on its owner,
    from the reduced gradient the owner holds; tiles move to other owners only when the root
    work (sum of `h^3 + w^3`) of the busiest rank exceeds 1.2x the mean. The tiling is fixed
    at construction. `root_work` / `native_root_work` give that work per rank after / before
    balancing, `moved_tiles` how many tiles travel each step, `num_tiles` how many there are.

    `state_dict()` per parameter: `step`, `exp_avg` (full shape), `exp_avg_sq` (adam) or
    `sum` (adagrad), and per tile `(i, j)`: `L_i_j`, `R_i_j`, `L_inv_root_i_j`, `R_inv_root_i_j`.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 0.999),
        epsilon: float = 1e-12,
        weight_decay: float = 0.0,
        max_preconditioner_dim: int = 1024,
        precondition_frequency: int = 1,
        start_preconditioning_step: int = 1,
        grafting: str | None = "adam",
        *,
        grafting_epsilon: float = 1e-8,
        root_dtype: torch.dtype = torch.float32,
        process_group=None,
        skip_nonfinite: bool = False,
        bucket_cap_numel: int = 64 * 1024 * 1024,
        sync_params: bool = True,
    ):
        defaults = dict(
            lr=lr, betas=tuple(betas), epsilon=epsilon, weight_decay=weight_decay,
            max_preconditioner_dim=max_preconditioner_dim, precondition_frequency=precondition_frequency,
            start_preconditioning_step=start_preconditioning_step, grafting=grafting,
            grafting_epsilon=grafting_epsilon, root_dtype=root_dtype,
        )  # fmt: skip
        check_hyperparameters(defaults)
        super().__init__(
            params, defaults, process_group=process_group, skip_nonfinite=skip_nonfinite,
            bucket_cap_numel=bucket_cap_numel, sync_params=sync_params,
        )  # fmt: skip
        self._plan_tiles()

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        check_hyperparameters(self.param_groups[-1])

    # --- hooks ----------------------------------------------------------------------

    _whole_buckets = True  # a bucket's tiles step together, with one step count
    _structural = ("max_preconditioner_dim", "grafting")

    def _unit(self, p: torch.Tensor, group: dict) -> int:
        return stripe_unit(tuple(p.shape), group["max_preconditioner_dim"])

    def _state_names(self, bucket: Bucket) -> list[str]:
        second = _SECOND.get(bucket.group["grafting"])
        return ["exp_avg", second] if second else ["exp_avg"]

    def _init_state(self, bucket: Bucket) -> dict[str, torch.Tensor]:
        return {name: torch.zeros_like(bucket.local_params) for name in self._state_names(bucket)}

    def _update(self, bucket: Bucket, grads: torch.Tensor) -> None:
        g, step, bt = bucket.group, bucket.step, self._tiles[id(bucket)]
        work = bt.work
        work[0].copy_(grads)
        grafting_step_(
            work[0], bucket.state["exp_avg"], bucket.state.get(_SECOND.get(g["grafting"], "")),
            work[1], work[2], step=step, beta1=g["betas"][0], beta2=g["betas"][1],
            eps=g["grafting_epsilon"], grafting=g["grafting"],
        )  # fmt: skip
        if bt.tiles:
            bt.step(g, step)
        lr, p = float(g["lr"]), bucket.local_params
        if g["weight_decay"] != 0:
            p.mul_(1 - lr * g["weight_decay"])
        p.add_(work[2], alpha=-lr)

    # --- tile placement -------------------------------------------------------------

    def _plan_tiles(self) -> None:
        world = self.world_size
        found = []
        for b in self._buckets:
            d = b.group["max_preconditioner_dim"]
            tiles = [t for i, p in enumerate(b.params) for t in tiles_of(tuple(p.shape), d, i)]
            held = [[self._rows_held(b, t, r) for r in range(world)] for t in tiles]
            native = [max(range(world), key=lambda r, h=h: (h[r][1] - h[r][0], -r)) for h in held]
            found.append((b, tiles, held, native))
        costs = [t.cost for _, tiles, _, _ in found for t in tiles]
        native = [o for *_, owners in found for o in owners]
        owners = balance(costs, native, world)
        self.native_root_work = rank_loads(costs, native, world)
        self.root_work = rank_loads(costs, owners, world)
        self._tiles: dict[int, _BucketTiles] = {}
        pos = 0
        for b, tiles, held, _ in found:
            self._tiles[id(b)] = _BucketTiles(b, tiles, owners[pos : pos + len(tiles)], held, self._comm)
            pos += len(tiles)
        self.num_tiles = len(costs)
        self.moved_tiles = sum(bt.moved for bt in self._tiles.values())

    @staticmethod
    def _rows_held(b: Bucket, t: Tile, rank: int) -> tuple[int, int]:
        """Rows `[a, b)` of tile `t`, counted from its first row, that `rank` holds."""
        n = matrix_shape(tuple(b.params[t.param].shape))[1]
        start, stop = b.layout.rank_range(t.param, rank)
        first, last = (start - b.layout.offsets[t.param]) // n, (stop - b.layout.offsets[t.param]) // n
        a, z = max(first, t.r0) - t.r0, min(last, t.r1) - t.r0
        return (a, z) if z > a else (0, 0)

    def local_preconditioner_numel(self) -> int:
        """Elements of factors and roots held by this rank."""
        return sum(
            x.numel() for bt in self._tiles.values() for g in bt.local + bt.remote for x in g.state.values()
        )

    def local_state_numel(self) -> int:
        return super().local_state_numel() + self.local_preconditioner_numel()

    # --- checkpoints ------------------------------------------------------------------

    def _tile_names(self, bucket: Bucket, i: int):
        bt = self._tiles[id(bucket)]
        for k, t in enumerate(bt.tiles):
            if t.param == i:
                shapes = ((t.h, t.h), (t.w, t.w)) * 2
                yield k, {f"{name}_{t.key}": (name, s) for name, s in zip(_FACTORS, shapes)}

    def _gather_factors(self, gather) -> dict[tuple[int, int], torch.Tensor]:
        """Every tile's factors and roots, gathered from their owners where `gather` puts them."""
        out = {}
        for b in self._buckets:
            bt = self._tiles[id(b)]
            numels = [2 * (t.h**2 + t.w**2) for t in bt.tiles]
            if not numels:
                continue
            offsets, totals = owner_offsets(numels, bt.owners, self.world_size)
            mine = [x.reshape(-1) for k in sorted(bt.owned) for x in bt.factors(k).values()]
            local = torch.cat(mine) if mine else bt.work.new_zeros(0)
            full = gather(local, totals)
            if full is None:
                continue
            starts = [sum(totals[:r]) for r in range(self.world_size)]
            for k, (o, n) in enumerate(zip(bt.owners, numels)):
                out[id(b), k] = full[starts[o] + offsets[k] : starts[o] + offsets[k] + n]
        return out

    def _fill_state(self, state_dict: dict, gather) -> None:
        self._gathered = self._gather_factors(gather)
        try:
            super()._fill_state(state_dict, gather)
        finally:
            self._gathered = None

    def _param_state(self, bucket, i: int, flat: dict) -> dict:
        out = super()._param_state(bucket, i, flat)
        for k, names in self._tile_names(bucket, i):
            pos, full = 0, self._gathered[id(bucket), k]
            for key, (_, shape) in names.items():
                n = shape[0] * shape[1]
                out[key] = full[pos : pos + n].view(shape).clone()
                pos += n
        return out

    def _expected_state(self, bucket, i: int) -> dict:
        out = super()._expected_state(bucket, i)
        for _, names in self._tile_names(bucket, i):
            out.update({key: shape for key, (_, shape) in names.items()})
        return out

    def _load_param_state(self, bucket, i: int, state: dict, local: dict) -> None:
        super()._load_param_state(bucket, i, state, local)
        bt = self._tiles[id(bucket)]
        for k, names in self._tile_names(bucket, i):
            if k in bt.owned:
                mine = bt.factors(k)
                for key, (name, _) in names.items():
                    mine[name].copy_(torch.as_tensor(state[key]))

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for b in self._buckets:
            if b.step == 0:
                for g in self._tiles[id(b)].local + self._tiles[id(b)].remote:
                    for x in g.state.values():
                        x.zero_()

    def sharded_state_dict(self) -> dict:
        """As the base's, plus each tile's factors and roots as plain tensors, only in the
        entry of the rank that owns the tile (DCP writes them from there and reads them
        into whichever rank owns the tile when loading)."""
        sd = super().sharded_state_dict()
        for b in self._buckets:
            bt = self._tiles[id(b)]
            for i, index in enumerate(b.indices):
                for k, names in self._tile_names(b, i):
                    if k in bt.owned:
                        mine = bt.factors(k)
                        sd["state"][str(index)].update({key: mine[n] for key, (n, _) in names.items()})
        return sd


__all__ = ["Shampoo"]
