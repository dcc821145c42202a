"""Sharded Shampoo: each tile's Kronecker factors and inverse roots live on one rank."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..owners.moves import Move, run_moves
from ..shard.collectives import all_reduce_
from ..units.config import ShardingConfig
from ..units.fsdp_shards import over_dtensors
from ..units.segment import Segment, StateSpec
from ..units.tp_view import param_cut
from ._checks import check_params_arg
from ._guards import caller_stacklevel, label_params
from ._shampoo_fsdp import FsdpShampoo
from ._shampoo_math import (
    bias_correction,
    check_hyperparameters,
    grafting_step_,
    schedule,
    stripe_granule,
)
from ._shampoo_setup import plan_setup
from ._shampoo_tiles import FACTORS, SegmentTiles
from ._shampoo_tp import tp_tile_offset
from .base import ShardedOptimizer
from .state_dict import Owned

_SECOND = {"adam": StateSpec("exp_avg_sq"), "adagrad": StateSpec("sum")}  # the grafting's second moment
_EXP_AVG = StateSpec("exp_avg")


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
    - at steps `t = start + k*precondition_frequency` (`start = start_preconditioning_step`,
      by default `precondition_frequency` and never less, so that no root is built from fewer
      steps than it is applied for): `L_inv_root = (L/(1-b2^t))^(-1/4)` by `torch.linalg.eigh`
      in `root_dtype` (float64 if that fails) with eigenvalues `max(lam, 0) + epsilon`, the
      same for R; a factor that is not finite keeps its previous root, counted in
      `kept_roots` (over all ranks) with a warning;
    - update U: from `start` on, per tile `D = L_inv_root @ Mhat @ R_inv_root`, rescaled to
      `D * |A|_F / |D|_F` over the tile (no rescaling with `grafting=None`); before `start`,
      and always for 1-D parameters, `U = A`;
    - `p <- p * (1 - lr*weight_decay) - lr * U`.

    The layout's granule for a matrix with `m` rows is a stripe of `max_preconditioner_dim`
    rows (the whole matrix when `m <= max_preconditioner_dim`); when stripes do not divide
    `m`, it is `gcd(m, max_preconditioner_dim)` rows, and a stripe cut by a rank boundary
    is gathered to one rank. Each tile's factors and roots are computed only on its owner,
    from the reduced gradient the owner holds. Owners come from one balance of root work (sum
    of `h^3 + w^3`) over the world: tiles stay at the rank holding most of their rows unless
    the busiest rank would exceed 1.2x the mean; then, largest tiles first, a tile stays while
    its rank's work is within 1.1x the mean and goes to the least-loaded rank otherwise. With
    a `replicate` mesh dimension the replicas split the tiles, each computed once. The tiling
    is fixed at construction. `root_work` / `native_root_work` give that work per rank after /
    before balancing (each tile at the rank holding most of its rows, in the replica it was
    dealt to), `moved_tiles` how many tiles travel each step, `num_tiles` how many there are.
    Results are the same bits at every world size. Between steps a rank keeps only its state
    (`exp_avg`, the grafting state, masters, factors and roots: what `local_state_bytes()`
    counts); the update and the staging buffers of moved tiles live for one step.

    Tensor parallelism: a DTensor parameter cut over TP (`Shard(0)` row blocks,
    `Shard(1)` column blocks) is tiled on its TP rank's local shard, which must lie on the
    tile grid of the full tensor (every shard's rows or columns starting a tile, its last
    ending one or the matrix): then its tiles are the full tensor's (their keys the full
    tensor's indices), each computed once in the world by an owner over the data-parallel
    group, with no TP traffic. A cut off the grid is refused at construction by name. A matrix
    replicated over TP (a plain parameter or a Replicate DTensor) next to cut ones has the same
    tiles on every TP rank: each is computed once in the dp x tp world (an owner over all its
    ranks, balanced after the cut tiles) and its update reaches every TP rank's copy
    (`_shampoo_tp`). Under TP `root_work`, `native_root_work`, `num_tiles` and `moved_tiles`
    are the dp x tp world's (per rank of it, all its tiles). Checkpoints work in every format
    under TP: DCP's sharded state dicts, `vo.CheckpointManager`, and torch's full format, whose
    `state_dict()` holds, on every rank, each parameter's full state and every tile of the full
    tensor keyed as in one process (gathered from its owner in the dp x tp world), and loads at
    any layout whose TP cuts lie on the same tile grid.

    Over FSDP2's shards (its `fully_shard` DTensors, given no `mesh=` or `process_group=`; HSDP and
    FSDP2 over TP too, whatever the cuts): the element-wise part runs on FSDP2's local pieces; each
    matrix's gradient (with mhat and the grafting update on steps that precondition) travels whole
    to one owner, balanced over the world by its tiles' root work, which keeps every tile's factors
    and roots and sends each rank its piece of the update (`_shampoo_fsdp`): each tile computed
    once, the one-process numbers. `moved_tiles` counts the tiles of matrices their owner does not
    hold whole; `native_root_work` puts a matrix at the rank holding most of it. torch's full
    `state_dict()` is the one-process format on every rank, as under TP.

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
        start_preconditioning_step: int | None = None,
        grafting: str | None = "adam",
        *,
        grafting_epsilon: float = 1e-8,
        root_dtype: torch.dtype = torch.float32,
        **sharding: Any,
    ):
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            epsilon=epsilon,
            weight_decay=weight_decay,
            max_preconditioner_dim=max_preconditioner_dim,
            precondition_frequency=precondition_frequency,
            start_preconditioning_step=start_preconditioning_step,
            grafting=grafting,
            grafting_epsilon=grafting_epsilon,
            root_dtype=root_dtype,
        )
        check_hyperparameters(defaults)
        check_params_arg(params)
        self.kept_roots = 0  # roots left as they were (non-finite factor, eigh failure), all ranks
        self._refreshed = False
        self._config = ShardingConfig.of(type(self).__name__, sharding)  # read by `_check_params`
        super().__init__(params, defaults, self._config)  # plans the tiles (`_plan_work`)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["start_preconditioning_step"] is None:
            group["start_preconditioning_step"] = group["precondition_frequency"]
        check_hyperparameters(group)

    # --- hooks ----------------------------------------------------------------------

    takes_dtensors = True  # each TP shard's tiles are the full tensor's (refused where they are not)
    structural_keys = ("max_preconditioner_dim", "grafting")
    step_stat_names = ("roots",)  # inverse roots this rank computed in the step

    def _check_group(self, gi: int, group: dict) -> str | None:
        try:
            if group["start_preconditioning_step"] is None:  # None is a default's, not a group's
                raise ValueError("start_preconditioning_step is None (need an integer)")
            check_hyperparameters(group)
        except ValueError as e:
            return f"param group {gi}: {e}"
        return None

    def _check_params(self, params: list[torch.Tensor]) -> None:
        """Under tensor parallelism every tile of the full tensor must lie inside one TP
        shard: refused by name on every rank (the answer comes from global shapes and
        placements), before anything is laid out. Over FSDP2's shards no cut needs to be on the
        grid: whole matrices go to their owners."""
        super()._check_params(params)
        if over_dtensors(params, self._config):  # over FSDP2's shards: whole matrices (`_shampoo_fsdp`)
            return
        labels = label_params(self.param_groups)
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    tp_tile_offset(param_cut(p), group["max_preconditioner_dim"], labels[id(p)])

    def _granule(self, p: torch.Tensor, group: dict) -> int:
        return stripe_granule(tuple(p.shape), group["max_preconditioner_dim"])

    def _state_specs(self, seg: Segment) -> list[StateSpec]:
        second = _SECOND.get(seg.group["grafting"])
        return [_EXP_AVG, second] if second else [_EXP_AVG]

    def _update(self, seg: Segment, grads: torch.Tensor) -> Move | None:
        g = seg.group
        second_spec = _SECOND.get(g["grafting"])
        exp_avg = seg.read(_EXP_AVG.name)
        second = seg.read(second_spec.name) if second_spec else None
        update, mhat = torch.empty_like(exp_avg), torch.empty_like(exp_avg)
        runs = list(seg.runs())
        for lo, hi, step in runs:
            grafting_step_(
                grads[lo:hi],
                exp_avg[lo:hi],
                None if second is None else second[lo:hi],
                update[lo:hi],
                step=step,
                beta1=g["betas"][0],
                beta2=g["betas"][1],
                eps=g["grafting_epsilon"],
                grafting=g["grafting"],
            )
            torch.div(exp_avg[lo:hi], bias_correction(g["betas"][0], step), out=mhat[lo:hi])
        seg.store(_EXP_AVG.name, exp_avg)  # nothing to write back while the state is exact (fp32)
        if second_spec:
            seg.store(second_spec.name, second)

        def apply() -> None:
            lr, p = float(g["lr"]), seg.local_params
            for lo, hi, _ in runs:
                if g["weight_decay"] != 0:
                    p[lo:hi].mul_(1 - lr * g["weight_decay"])
                p[lo:hi].add_(update[lo:hi], alpha=-lr)

        setup = self._setup
        if setup.fsdp is not None:  # the matrices whole at their owners, every segment's at once
            self._refreshed |= setup.fsdp.stage(seg, grads, mhat, update, apply)
            return None
        seg_tiles = setup.tiles[id(seg)]
        parts = [x for x in (seg_tiles, setup.shared.get(id(seg))) if x is not None and x.tiles]
        left = [len(parts)]  # the update is applied once every part has written its tiles'

        def finish() -> None:
            left[0] -= 1
            if not left[0]:
                apply()

        if not parts:
            apply()
        move = None
        for part in parts:
            steps = [seg.steps[t.param] if seg.active[t.param] else 0 for t in part.tiles]
            self._refreshed |= any(schedule(g, st)[1] for st in steps if st)
            out = part.step(g, steps, grads, mhat, update, finish)
            if part is seg_tiles:
                move = out
            elif out is not None:  # tiles replicated over TP travel over the dp x tp world
                self._shared_moves.append(out)
        return move

    def _step_phase(self, segments: list[Segment]) -> list[Move]:
        """The moves of tiles replicated over TP, over the dp x tp world (those over the
        data-parallel group run after, in the base's step); over FSDP2's shards, every matrix's
        exchange with its owner and the updates applied."""
        fsdp = self._setup.fsdp
        if fsdp is not None:
            before = fsdp.traffic()
            fsdp.run()
            self._traffic(*(now - was for now, was in zip(fsdp.traffic(), before)))
            return []
        moves, self._shared_moves = self._shared_moves, []
        if moves:
            self._traffic(*run_moves(moves, self._setup.tp.world.comm))
        return []

    def _parts(self) -> list[SegmentTiles | FsdpShampoo]:
        """Who holds tiles on this rank: per segment its tiles (and under TP those replicated over
        it), or over FSDP2's shards the owner of whole matrices."""
        setup = self._setup
        return [*setup.tiles.values(), *setup.shared.values(), *([setup.fsdp] if setup.fsdp else [])]

    def _before_update(self) -> None:
        self._refreshed, self._shared_moves = False, []
        for seg_tiles in self._parts():
            seg_tiles.kept = seg_tiles.roots = 0

    def _after_update(self) -> None:
        kept = sum(seg_tiles.kept for seg_tiles in self._parts())
        self.step_stats["roots"] += sum(seg_tiles.roots for seg_tiles in self._parts())
        for seg_tiles in self._parts():
            seg_tiles.kept = 0  # a device count until read: not kept between steps
        if self._refreshed:
            self._count_kept_roots(kept)

    def _count_kept_roots(self, local: torch.Tensor | int) -> None:
        """Sum over ranks the roots kept this step (`local`: this rank's, a device count from
        `inverse_roots_`, or 0); one small all-reduce and one read on steps that refresh
        roots; count them in `kept_roots` and warn."""
        world = self.runtime.dp if self._setup.tp is None else self._setup.tp.world.comm
        kept = torch.zeros(1, device=world.device)
        if isinstance(local, torch.Tensor):
            kept += local.to(world.device)
        all_reduce_(kept, world, "sum")
        n = int(kept.item())  # the one read of a refresh: every rank agrees on the count
        if n:
            self.kept_roots += n
            warnings.warn(
                f"Shampoo kept the previous inverse root of {n} factor(s) this step: the factor or its root "
                f"was not finite (inf/nan gradients?) or eigh failed in root_dtype and float64 "
                f"({self.kept_roots} kept so far, see kept_roots)",
                stacklevel=caller_stacklevel(),
            )

    # --- tile placement -------------------------------------------------------------

    def _plan_work(self) -> None:
        """Every tile declared as owner work and placed (`_shampoo_setup`): planned once the
        layout is known, read by every step."""
        self._setup = plan_setup(self.runtime, self._labels)
        self._shared_moves: list[Move] = []  # a step's moves of tiles replicated over TP
        if self._setup.tp is not None:  # every tile's owner is a rank of the dp x tp world
            self._io.owned_world = self._setup.tp.world.comm

    @property
    def root_work(self) -> tuple[float, ...]:
        """Root work (sum of `h^3 + w^3` over the tiles owned) per world rank, after balancing."""
        return self._setup.root_work

    @property
    def native_root_work(self) -> tuple[float, ...]:
        """Root work per world rank with each tile at the rank holding most of its rows."""
        return self._setup.native_root_work

    @property
    def num_tiles(self) -> int:
        return self._setup.num_tiles

    @property
    def moved_tiles(self) -> int:
        """How many tiles travel to their owner each step."""
        return self._setup.moved_tiles

    def _preconditioners(self):
        for seg_tiles in self._parts():
            for g in seg_tiles.local + seg_tiles.remote:
                yield from g.state.values()

    def local_preconditioner_numel(self) -> int:
        """Elements of factors and roots held by this rank."""
        return sum(x.numel() for x in self._preconditioners())

    # --- checkpoints ------------------------------------------------------------------

    def _owned_state(self, seg: Segment) -> list[list[Owned]]:
        """Each tile's factors and roots, `L_i_j`, `R_i_j`, `L_inv_root_i_j` and
        `R_inv_root_i_j`, kept whole by the tile's owner; under tensor parallelism every tile
        of the full tensor, from every TP rank, with its owner in the dp x tp world."""
        out: list[list[Owned]] = [[] for _ in seg.params]
        setup = getattr(self, "_setup", None)
        if setup is None:  # during construction, before the tiles are planned
            return out
        if setup.fsdp is not None:
            return setup.fsdp.owned(seg)
        parts = [x for x in (setup.tiles.get(id(seg)), setup.shared.get(id(seg))) if x is not None]
        if setup.tp is None:
            listed = [(t.param, t.key, t.h, t.w, parts[0].owners[k]) for k, t in enumerate(parts[0].tiles)]
            me = self.runtime.dp.rank
        else:
            listed, me = setup.tp.owned[setup.position[id(seg)]], setup.tp.world.comm.rank
        mine = {(x.tiles[k].param, x.tiles[k].key): x.factors(k) for x in parts for k in x.owned}
        for param, key, h, w, owner in listed:
            factors = mine[param, key] if owner == me else None
            for name, side in zip(FACTORS, (h, w, h, w)):
                tensor = factors[name] if factors is not None else None
                out[param].append(Owned(f"{name}_{key}", (side, side), owner, tensor))
        return out


__all__ = ["Shampoo"]
