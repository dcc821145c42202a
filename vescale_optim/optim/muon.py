"""Distributed Muon: momentum on local pieces, each matrix orthogonalized once by its owner."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from numbers import Real
from typing import Any

import torch

from ..kernels import newton_schulz
from ..shard.mesh import Topology
from ..shard.redistribution import (
    Piece,
    in_arrival_order,
    owner_offsets,
    plan_gather_to_owner,
    plan_scatter_from_owner,
)
from ..units.moves import Move
from ..units.owners import assign_owners, ns_flops
from ..units.segment import FROZEN, Segment
from . import lowbit
from ._checks import check_adamw_group, check_at_least, check_betas, check_lr, check_params_arg
from .adamw import adamw_segment_step
from .base import ShardedOptimizer

_ADJUST = (None, "original", "match_rms_adamw")
_ADAMW_EPS = 1e-8


def adjusted_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """torch.optim.Muon's per-matrix learning-rate scaling."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"unknown adjust_lr_fn {adjust_lr_fn!r}; expected one of {_ADJUST}")


def matrix_view(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(count, rows, cols): a 2-D weight is one matrix, a 3-D stack `count` of them, and a
    4-D convolution weight one `[out, in*kh*kw]` matrix."""
    if len(shape) == 2:
        return 1, shape[0], shape[1]
    if len(shape) == 3:
        return shape[0], shape[1], shape[2]
    return 1, shape[0], math.prod(shape[1:])


@dataclass(frozen=True)
class _Matrix:
    param: int  # index in the seg
    start: int  # offset of the matrix in the seg's global buffer
    rows: int
    cols: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols


class _MuonPlan:
    """Per-segment matrices, their owners, gather/scatter plans and this rank's batches.

    Built in two steps: the matrices, where they lie and what they cost; then, once
    owners are chosen over every segment of the step, the plans. Positions are the
    unit's; each rank's buffers hold its part of the segment, from `seg.rank_start(r)`.
    """

    def __init__(self, seg: Segment, topology: Topology, ns_steps: int):
        layout = seg.layout
        self.topology, self.shard = topology, layout.shard_size
        shards = topology.shards
        self.starts = [seg.rank_start(r) for r in range(shards)]
        self.sizes = seg.counts
        self.matrices: list[_Matrix] = []
        for i, p in enumerate(seg.params):
            count, rows, cols = matrix_view(tuple(p.shape))
            for s in range(count):
                self.matrices.append(_Matrix(i, layout.offsets[i] + s * rows * cols, rows, cols))
        self.homes: list[int | None] = []  # the only shard rank holding a matrix, if one does
        self.pieces: list[Piece] = []  # by shard rank
        for t, m in enumerate(self.matrices):
            first, last = m.start // self.shard, (m.start + m.numel - 1) // self.shard  # ranks it spans
            for r in range(first, last + 1):
                lo, hi = max(m.start, r * self.shard), min(m.start + m.numel, (r + 1) * self.shard)
                at = lo - r * self.shard - self.starts[r]
                self.pieces.append(Piece(r, t, at, lo - m.start, hi - m.start))
            self.homes.append(first if first == last else None)
        self.costs = [ns_flops(m.rows, m.cols, ns_steps) for m in self.matrices]

    def world_homes(self) -> list[int | None]:
        """Homes as world ranks: with replicas, the home shard rank of one replica (matrix t
        in replica t mod R, spreading them), since every replica holds the matrix there."""
        topo = self.topology
        return [None if h is None else topo.world_rank(t % topo.replicas, h)
                for t, h in enumerate(self.homes)]  # fmt: skip

    def assign(self, owners: list[int], rank: int) -> None:
        """Plan the moves to `owners` (world ranks) and this rank's (world rank) batched work.

        The owner gathers a matrix from its own replica's pieces; with replicas, the result
        goes back to the pieces of every replica, so each matrix is orthogonalized once in
        the world. A matrix its owner holds whole already stays in place (one replica)."""
        topo = self.topology
        world, replicas = topo.world_size, topo.replicas
        self.owners = owners
        if replicas == 1:
            moved = {t for t, (h, o) in enumerate(zip(self.homes, owners)) if h != o}
        else:
            moved = set(range(len(self.matrices)))
        mine = [p for p in self.pieces if p.tensor in moved]
        owner_replica = [topo.coords(o)[0] for o in owners]
        gather = [replace(p, rank=topo.world_rank(owner_replica[p.tensor], p.rank)) for p in mine]
        scatter = [replace(p, rank=topo.world_rank(r, p.rank)) for r in range(replicas) for p in mine]
        numels = [m.numel if t in moved else 0 for t, m in enumerate(self.matrices)]
        sizes = [self.sizes[topo.shard_of(w)] for w in range(world)]
        self.gather = plan_gather_to_owner(gather, numels, owners, world, sizes)
        # results come back in arrival order (received in place) and are read from there
        self.scatter, where = in_arrival_order(plan_scatter_from_owner(scatter, numels, owners, world, sizes))
        self.returned = where[rank]
        self.gather_program = self.gather.program(rank)
        self.scatter_program = self.scatter.program(rank)
        offsets, _ = owner_offsets(numels, owners, world)
        # This rank's work, batched by shape: (rows, cols) -> [(in_gather_buffer, offset)];
        # a matrix whose owner already holds all of it is orthogonalized in place.
        me = topo.shard_of(rank)
        self.batches: dict[tuple[int, int], list[tuple[bool, int]]] = {}
        for t, m in enumerate(self.matrices):
            if owners[t] == rank:
                here = m.start - me * self.shard - self.starts[me]
                entry = (True, offsets[t]) if t in moved else (False, here)
                self.batches.setdefault((m.rows, m.cols), []).append(entry)


_CHUNK = 1 << 20  # elements per element-wise call: bounds the temporaries of a step


def _pieces(lo: int, hi: int, update: torch.Tensor, back: torch.Tensor, returned):
    """`(a, z, values)` covering `[lo, hi)` of the local slice: from `back` where a piece
    returned there (`returned`: `(offset, in_back, length)`, sorted), else from `update`."""
    pos = lo
    for offset, at, n in returned:
        a, z = max(lo, offset), min(hi, offset + n)
        if a >= z:
            continue
        if pos < a:
            yield pos, a, update[pos:a]
        yield a, z, back[at + a - offset : at + z - offset]
        pos = z
    if pos < hi:
        yield pos, hi, update[pos:hi]


def _chunks(runs, keep: bool = False):
    """`(lo, hi)` pieces of at most `_CHUNK` elements of each run `(lo, hi, key)` (with
    the key when `keep`)."""
    for lo, hi, key in runs:
        for a in range(lo, hi, _CHUNK):
            yield (a, min(hi, a + _CHUNK), key) if keep else (a, min(hi, a + _CHUNK))


def check_muon_group(group: dict) -> None:
    """Raise ValueError for a hyperparameter out of range in a Muon param group (or the
    defaults); a group with `use_muon=False` is checked as AdamW's."""
    if not isinstance(group.get("use_muon", True), bool):
        raise ValueError(f"use_muon must be True or False; got {group['use_muon']!r}")
    if not group.get("use_muon", True):
        check_adamw_group(group)
        return
    check_lr(group["lr"], "Learning rate should be >= 0 but is: {}")
    if not 0.0 <= group["momentum"] < 1.0:
        raise ValueError(f"momentum should be >= 0 and < 1 but is: {group['momentum']}")
    check_at_least(group["weight_decay"], 0.0, "weight decay should be >= 0 but is: {}")
    check_at_least(group["eps"], 0.0, "Invalid epsilon value: {}")
    fn, steps, coefficients = group["adjust_lr_fn"], group["ns_steps"], group["ns_coefficients"]
    if fn not in _ADJUST:
        raise ValueError(f"Adjust learning rate function {fn} is not supported; expected one of {_ADJUST}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"ns_steps must be an integer >= 1; got {steps!r}")
    if not (isinstance(coefficients, tuple | list) and len(coefficients) == 3
            and all(isinstance(c, Real) for c in coefficients)):  # fmt: skip
        raise ValueError(f"Coefficients must be a tuple of exactly 3 values; got {coefficients!r}")


class Muon(ShardedOptimizer):
    """Muon with ragged-sharded parameters, gradients and momentum.

    Same arguments, defaults and math as `torch.optim.Muon`, per matrix:
    `B <- mu*B + (1-mu)*g`; `U = g + mu*(B - g)` if nesterov else `B`;
    `O = NS(U)` (bf16 Newton–Schulz); `p <- p*(1 - lr*wd) - adjusted_lr*O`.
    3-D parameters are stacks of matrices, 4-D ones `[out, in*kh*kw]` matrices.

    Each step, momentum runs on the local slice; every matrix is sent (in bf16,
    as torch's iteration starts by casting to bf16) to one owner chosen by balancing
    Newton–Schulz FLOPs, orthogonalized there once — batched over equal shapes — and
    sent back; matrices that already lie whole on their owner are not moved. A matrix
    whose parameter takes no step (no gradient on any rank) keeps its momentum and
    value; it still travels to its owner with the static plan, as zeros. Groups with
    `use_muon=False` take AdamW steps with their `lr`, `betas` (the constructor's
    `betas`, (0.9, 0.95)), `eps` (1e-8) and `weight_decay`. `betas` lives in those groups
    only, not in `defaults`, so schedulers that cycle momentum (`OneCycleLR`, `CyclicLR`)
    cycle `momentum` as they do for `torch.optim.Muon`. Every group is checked at
    construction (`momentum` in [0, 1), betas in [0, 1), ...). `state_bits` (32, 16 or 8)
    stores momentum and moments as in `AdamW`. Hyperparameters, `adjust_lr_fn` included,
    are read from `param_groups` at every step.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        betas: tuple[float, float] = (0.9, 0.95),
        ns_backend: str = "auto",
        state_bits: int = 32,
        **sharding: Any,
    ):
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
            use_muon=True,
        )  # fmt: skip
        check_muon_group(defaults)
        check_betas(betas)
        check_params_arg(params)
        lowbit.check_state_bits(state_bits)
        self.state_bits = state_bits
        self.ns_backend = ns_backend
        self.orthogonalized = 0  # matrices this rank orthogonalized in the last step
        params = list(params)
        if params and isinstance(params[0], dict):
            # AdamW groups take `betas` (kept out of the defaults, so that schedulers cycle
            # `momentum` as for torch.optim.Muon) and AdamW's eps of 1e-8, not Newton–Schulz's.
            adamw = {"eps": _ADAMW_EPS, "betas": betas}
            params = [g if g.get("use_muon", True) else {**adamw, **g} for g in params]
        super().__init__(params, defaults, sharding)
        runtime = self.runtime
        self._plans: dict[int, _MuonPlan] = {}  # by id of the segment
        for seg in runtime.segments:
            if seg.group["use_muon"] and seg.tier != FROZEN:
                self._plans[id(seg)] = _MuonPlan(seg, runtime.topology, seg.group["ns_steps"])
        # One assignment over every matrix of the step and every rank of the world (replicas
        # too), so the step's total is balanced and each matrix is orthogonalized once.
        plans, world = list(self._plans.values()), runtime.world.world_size
        costs, homes = [c for p in plans for c in p.costs], [h for p in plans for h in p.world_homes()]
        owners = assign_owners(costs, world, homes)
        self.ns_load = [0.0] * world  # Newton–Schulz FLOPs per world rank per step
        start = 0
        for plan in plans:
            plan.assign(owners[start : start + len(plan.costs)], runtime.world.rank)
            start += len(plan.costs)
            for o, c in zip(plan.owners, plan.costs):
                self.ns_load[o] += c

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        check_muon_group(self.param_groups[-1])

    def _check_params(self, params):
        super()._check_params(params)
        for gi, g in enumerate(self.param_groups):
            if not g.get("use_muon", True):
                continue
            names = g.get("param_names")
            for j, p in enumerate(g["params"]):
                if p.ndim not in (2, 3, 4):
                    name = f"'{names[j]}' " if names else ""
                    raise ValueError(
                        f"Muon orthogonalizes matrices, but parameter {name}#{j} of param group {gi} has "
                        f"shape {tuple(p.shape)}; put it in a group with use_muon=False (AdamW)"
                    )

    structural_keys = ("use_muon",)

    def _granule(self, p: torch.Tensor, group: dict) -> int:
        return p.shape[-1] if group["use_muon"] else 1

    def _state_names(self, seg: Segment) -> list[str]:
        return ["momentum_buffer"] if seg.group["use_muon"] else ["exp_avg", "exp_avg_sq"]

    def _stepless(self, seg: Segment) -> bool:
        return seg.group["use_muon"]

    def _check_group(self, gi: int, group: dict) -> str | None:
        try:
            check_muon_group(group)
        except ValueError as e:
            return f"param group {gi}: {e}"
        return None

    def _before_update(self) -> None:
        self.orthogonalized = 0

    def _update(self, seg: Segment, grads: torch.Tensor) -> Move | None:
        plan = self._plans.get(id(seg))
        if plan is None:
            adamw_segment_step(seg, lowbit.kind(seg.tier), grads)
            return None
        update = self._momentum(seg)
        group = seg.group
        back = update.new_empty(plan.scatter.dst_numel[self.runtime.world.rank])
        return Move(
            gather=plan.gather, src=update, scatter=plan.scatter, dst=back,
            programs=(plan.gather_program, plan.scatter_program), label="newton_schulz",
            local=lambda: self._orthogonalize(plan, group, update, moved=False),
            compute=lambda received: self._orthogonalize(plan, group, received, moved=True),
            finish=lambda: self._apply(seg, update, back, plan.returned),
        )  # fmt: skip

    def _momentum(self, seg: Segment) -> torch.Tensor:
        """Momentum on the active runs of the local slice; returns the (nesterov) update
        in bf16, zero where parameters do not step. Temporaries stay chunk-sized."""
        g = seg.group
        mu, grad, kind = g["momentum"], seg.local_grads(), lowbit.kind(seg.tier)
        buf = lowbit.decode(seg.state, "momentum_buffer", kind)
        runs = list(seg.runs(key=lambda i: True))
        whole = [(lo, hi) for lo, hi, _ in runs] == [(0, buf.numel())]
        update = buf.new_empty(buf.numel(), dtype=torch.bfloat16)
        if not whole:
            update.zero_()
        for lo, hi in _chunks(runs):
            m, gr = buf[lo:hi], grad[lo:hi]
            m.lerp_(gr, 1 - mu)
            update[lo:hi].copy_(gr.lerp(m, mu) if g["nesterov"] else m)
        lowbit.encode_(seg.state, "momentum_buffer", kind, buf)
        return update

    def _apply(self, seg: Segment, update: torch.Tensor, back: torch.Tensor,
               returned: Sequence[tuple[int, int, int]]) -> None:  # fmt: skip
        """`p <- p*(1 - lr*wd) - adjusted_lr*O` on the active runs, with one adjusted
        learning rate per run of parameters that share it (a scalar, as in torch). `O` is
        in `back` where it came back from an owner (`returned`), in `update` elsewhere."""
        g, params = seg.group, seg.local_params
        lr, decay = float(g["lr"]), 1 - float(g["lr"]) * g["weight_decay"]
        shapes = [matrix_view(tuple(p.shape))[1:] for p in seg.params]
        runs = seg.runs(key=lambda i: adjusted_lr(lr, g["adjust_lr_fn"], *shapes[i]))
        for lo, hi, alr in _chunks(runs, keep=True):
            for a, z, values in _pieces(lo, hi, update, back, returned):
                params[a:z].mul_(decay).add_(values, alpha=-alr)

    def _orthogonalize(self, plan: _MuonPlan, group: dict, buf: torch.Tensor, moved: bool) -> torch.Tensor:
        """Newton–Schulz, in place in `buf`, on every matrix this rank owns that lies there:
        those it received (`moved`) or those it held whole already; batched by shape."""
        for (rows, cols), everything in plan.batches.items():
            entries = [e for e in everything if e[0] == moved]
            if not entries:
                continue
            n = rows * cols
            views = [buf[o : o + n].view(rows, cols) for _, o in entries]
            x = views[0] if len(views) == 1 else torch.stack(views)  # one matrix: torch's exact path
            out = newton_schulz(x, group["ns_steps"], group["ns_coefficients"], group["eps"], self.ns_backend)
            for view, o in zip(views, out.view(len(views), rows, cols)):
                view.copy_(o)
            self.orthogonalized += len(views)
            self.step_stats["ns_matrices"] += len(views)
            self.step_stats["ns_flops"] += len(views) * ns_flops(rows, cols, group["ns_steps"])
        return buf
