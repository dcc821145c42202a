"""Distributed Muon: momentum on local pieces, each matrix orthogonalized once, by its owner
or, when it is large, split over a group of ranks. The math is `_muon_math`'s (`_split_ns`'s
for a split matrix); who orthogonalizes what, `vo.muon_plan`'s; how a whole matrix gets to its
owner and back, the owner layer's (`owners.plan`): Muon declares each matrix a work item (its
pieces, its Newton–Schulz FLOPs, the rank holding it whole if one does); a split matrix's row
blocks travel to its group's members the same way (`_muon_split`). Under tensor parallelism a
matrix cut over TP is its full matrix, with pieces from every TP shard, orthogonalized once in
the dp x tp world by an owner of the same plan (whole, never split: `_muon_tp`), read from the
runtime's `TensorParallel`. What each rank does is planned once, at construction (`_muon_setup`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.profiler import record_function

from ..owners.moves import Move, run_moves
from ..units.segment import Segment, StateSpec
from ..units.tp_view import param_cut
from . import state_tiers
from ._checks import check_betas, check_params_arg
from ._muon_math import (
    adjusted_lr,
    apply_,
    group_blocks,
    matrix_view,
    momentum_,
    normuon_,
    ns_flops,
    ns_steps_of,
    orthogonalize_,
)
from ._muon_plan import H200, CostModel, MuonPlan
from ._muon_setup import plan_setup
from ._muon_tp import TPMatrix, assemble, local_blocks, refuse_tp_blocks
from ._muon_work import SegmentWork
from .muon_groups import check_blocks, check_muon_group
from .state_dict import Owned

__all__ = ["CostModel", "Muon", "MuonPlan", "adjusted_lr", "matrix_view", "ns_flops"]  # benchmarks read them
from .adamw import AdamW, adamw_segment_step
from .base import ShardedOptimizer

_ADAMW_EPS = 1e-8
_CHUNK = 1 << 20  # elements per element-wise call: bounds the temporaries of a step


class Muon(ShardedOptimizer):
    """Muon with ragged-sharded parameters, gradients and momentum.

    Same arguments, defaults and math as `torch.optim.Muon`, per matrix:
    `B <- mu*B + (1-mu)*g`; `U = g + mu*(B - g)` if nesterov else `B`;
    `O = NS(U)` (bf16 Newton–Schulz); `p <- p*(1 - lr*wd) - adjusted_lr*O`.
    3-D parameters are stacks of matrices, 4-D ones `[out, in*kh*kw]` matrices.

    Each step, momentum runs on the local slice; every matrix is sent (in bf16,
    as torch's iteration starts by casting to bf16) to one owner chosen by balancing
    Newton–Schulz FLOPs (`vo.muon_plan`, weighed against the bytes of a split by
    `cost_model`, H200 constants by default), orthogonalized there once — batched over
    equal shapes — and sent back; matrices that already lie whole on their owner are not
    moved. A matrix too large for one rank's share is split by rows over a group of ranks
    of one node, which run Newton–Schulz together (`opt.plan` says which). A matrix
    whose parameter takes no step (no gradient on any rank) keeps its momentum and
    value; it still travels to its owner with the static plan, as zeros. Groups with
    `use_muon=False` take AdamW steps with their `lr`, `betas` (the constructor's
    `betas`, (0.9, 0.95)), `eps` (1e-8) and `weight_decay`. `betas` lives in those groups
    only, not in `defaults`, so schedulers that cycle momentum (`OneCycleLR`, `CyclicLR`)
    cycle `momentum` as they do for `torch.optim.Muon`. Every group is checked at
    construction (`momentum` in [0, 1), betas in [0, 1), ...). `state_bits` (32, 16 or 8)
    stores momentum, moments and NorMuon's `v` as in `AdamW`. Hyperparameters, `adjust_lr_fn` included,
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
        cost_model: CostModel = H200,
        normuon: bool = False,
        normuon_beta2: float = 0.95,
        **sharding: Any,
    ):
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            use_muon=True,
            normuon=normuon,
            normuon_beta2=normuon_beta2,
        )
        check_muon_group(defaults)
        check_betas(betas)
        check_params_arg(params)
        state_tiers.check_state_bits(state_bits)
        self.state_bits = state_bits
        self.ns_backend = ns_backend
        self.orthogonalized = 0  # matrices this rank orthogonalized in the last step
        params = list(params)
        if params and isinstance(params[0], dict):
            # AdamW groups take `betas` (kept out of the defaults, so that schedulers cycle
            # `momentum` as for torch.optim.Muon) and AdamW's eps of 1e-8, not Newton–Schulz's.
            adamw = {"eps": _ADAMW_EPS, "betas": betas, "normuon": False}  # NorMuon is Muon's alone
            params = [g if g.get("use_muon", True) else {**adamw, **g} for g in params]
        self._cost_model = cost_model
        super().__init__(params, defaults, sharding)  # plans the matrices (`_plan_work`)

    def _plan_work(self) -> None:
        """Who orthogonalizes which matrix, and how each gets there (`_muon_setup`): planned once
        the layout is known, read by every step."""
        self._setup = plan_setup(self.runtime, self._cost_model, self.VARIANCE)
        self._updates: dict[int, torch.Tensor] = {}  # this step's update of each Muon segment (position)
        if self._setup.world is not None:  # NorMuon's v is kept by owners anywhere in the dp x tp world
            self._io.owned_world = self._setup.world.comm

    @property
    def plan(self) -> MuonPlan:
        """Who orthogonalizes which matrix (`vo.MuonPlan`), over every rank of the world."""
        return self._setup.plan

    @property
    def homes(self) -> list[int | None]:
        """Per matrix, the world rank holding it whole (or None)."""
        return self._setup.homes

    @property
    def ns_load(self) -> list[float]:
        """Newton–Schulz FLOPs per world rank per step."""
        return self._setup.ns_load

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        try:
            check_muon_group(self.param_groups[-1])
        except ValueError as e:
            raise ValueError(f"param group {len(self.param_groups) - 1}: {e}") from None

    def _check_params(self, params):
        refuse_tp_blocks(self.param_groups, param_cut)  # before anything is laid out, on every rank alike
        super()._check_params(params)
        for gi, g in enumerate(self.param_groups):
            if not g.get("use_muon", True):
                continue
            check_blocks(gi, g)
            names = g.get("param_names")
            for j, p in enumerate(g["params"]):
                if p.ndim not in (2, 3, 4):
                    name = f"'{names[j]}' " if names else ""
                    raise ValueError(
                        f"Muon orthogonalizes matrices, but parameter {name}#{j} of param group {gi} has "
                        f"shape {tuple(p.shape)}; put it in a group with use_muon=False (AdamW)"
                    )

    takes_dtensors = True  # matrices cut over TP are orthogonalized whole, over the dp x tp world
    structural_keys = ("use_muon", "split_sizes", "num_heads", "normuon")  # they shape plan and state
    step_stat_names = ("ns_matrices", "ns_flops")  # this rank's Newton–Schulz work in the step

    def _granule(self, p: torch.Tensor, group: dict) -> int:
        return p.shape[-1] if group["use_muon"] else 1  # (`p`: a DTensor's local tensor, as laid out)

    MOMENTUM = StateSpec("momentum_buffer")
    VARIANCE = StateSpec("variance_neuron", stored_as_sqrt=True)  # NorMuon's v, kept by the owner

    def _state_specs(self, seg: Segment) -> list[StateSpec]:
        return [self.MOMENTUM] if seg.group["use_muon"] else list(AdamW.STATE)

    def _stepless(self, seg: Segment) -> bool:
        return seg.group["use_muon"]

    def _check_group(self, gi: int, group: dict) -> str | None:
        try:
            check_muon_group(group)
            check_blocks(gi, group)
        except ValueError as e:
            if str(e).startswith(f"param group {gi}"):
                return str(e)
            return f"param group {gi}: {e}"
        return None

    def _before_update(self) -> None:
        self.orthogonalized = 0
        self._updates, self._later = {}, []  # (`_later`: AdamW's segments, over FSDP2)

    def _update(self, seg: Segment, grads: torch.Tensor) -> None:
        """Momentum on the local slice; the update waits for `_step_phase` (AdamW groups step now)."""
        if id(seg) not in self._setup.parts:  # over FSDP2: later, while Muon's updates travel (`_step_phase`)
            if self._setup.over_fsdp is not None:
                return self._later.append((seg, grads))
            return adamw_segment_step(seg, grads)
        g, buf = seg.group, seg.read("momentum_buffer")
        runs = [(lo, hi) for lo, hi, _ in seg.runs(key=lambda i: True)]
        update = momentum_(buf, grads, runs, g["momentum"], g["nesterov"], _CHUNK)
        seg.store("momentum_buffer", buf)
        self._updates[self._setup.position[id(seg)]] = update
        return None

    def _step_phase(self, segments: list[Segment]) -> list[Move]:
        """Every Muon segment has its momentum: the split matrices first (all of the step's, by
        their groups, in place in the segments' updates), then each segment's move of its whole
        matrices to their owners (those held whole are orthogonalized and applied now)."""
        updates, self._updates, setup = self._updates, {}, self._setup
        if setup.over_fsdp is not None:
            later, self._later = self._later, []
            adamw = lambda: [adamw_segment_step(seg, grads) for seg, grads in later]  # noqa: E731
            if updates:
                before = list(setup.over_fsdp.moves.traffic)
                setup.over_fsdp.run(updates, self, adamw)
                self._traffic(*(now - was for now, was in zip(setup.over_fsdp.moves.traffic, before)))
            else:
                adamw()
            return []
        if setup.split is not None and updates:
            self._run_split(updates)
        moves = [m for position, update in updates.items() for m in self._move(setup.segs[position], update)]
        if setup.world is None:
            return moves
        self._traffic(*run_moves(moves, setup.world.comm))  # over the dp x tp world
        return []

    def _move(self, seg: Segment, update: torch.Tensor) -> list[Move]:
        """The segment's whole matrices to their owners and back, one move per part (a view of
        the dp x tp world), applied with the split ones once the last part is back: the parts
        before it copy their results into `update` (a part with nothing to move finishes now)."""
        parts = self._setup.parts[id(seg)]
        left = [len(parts)]

        def finish(work: SegmentWork, back: torch.Tensor) -> None:
            left[0] -= 1
            if left[0]:
                for offset, at, n in work.returned:
                    update[offset : offset + n].copy_(back[at : at + n])
            else:
                self._apply(seg, update, back, work.returned)

        moves = [
            work.moves.move(
                update,
                label="newton_schulz",
                local=lambda work=work: self._orthogonalize(work.held, seg, update, work.held_ids),
                compute=lambda received, work=work: self._full(work, seg, received),
                finish=lambda back, work=work: finish(work, back),
            )
            for work in parts
        ]
        return [m for m in moves if m is not None]

    def _full(self, work: SegmentWork, seg: Segment, received: torch.Tensor) -> torch.Tensor:
        """The arriving matrices orthogonalized; those cut over TP by columns made full first."""
        position = self._setup.position[id(seg)]
        blocks, kinds = self._setup.blocks[position], self._setup.kinds[position]
        of = [kinds[blocks[i][0]] for i in work.ids]  # per item, how its parameter lies over TP
        rowwise = [
            (work.moves.received_at[k], *work.shapes[k], of[k])
            for k in work.moves.arriving
            if isinstance(of[k], TPMatrix) and of[k].dim == 1
        ]
        assemble(received, rowwise, back=False)
        self._orthogonalize(work.arriving, seg, received, work.arriving_ids)
        assemble(received, rowwise, back=True)
        return received

    def _run_split(self, updates: dict[int, torch.Tensor]) -> None:
        """Every split matrix of the step, in place in `updates` (segment position -> update)."""
        setup = self._setup
        with record_function("vescale_optim.newton_schulz_split"):
            sent, received, done = setup.split.run(updates)
        self._traffic(sent, received)
        for i, j in done:
            split, steps = self.plan.splits[i], ns_steps_of(setup.segs[setup.split.seg_of_matrix[i]].group)
            self.step_stats["ns_flops"] += split.member_flops(j, steps)
            if j == 0:  # a split matrix counts once, at its first member
                self.orthogonalized += 1
                self.step_stats["ns_matrices"] += 1

    def _apply(
        self, seg: Segment, update: torch.Tensor, back: torch.Tensor, returned: list[tuple[int, int, int]]
    ) -> None:
        """The update on the active runs, with one adjusted learning rate per run of
        parameters that share it (a scalar, as in torch)."""
        g, lr = seg.group, float(seg.group["lr"])
        if g.get("split_sizes") is None and g.get("num_heads") is None:
            shapes = [matrix_view(tuple(p.shape))[1:] for p in seg.params]
            runs = seg.runs(key=lambda i: adjusted_lr(lr, g["adjust_lr_fn"], *shapes[i]))
        else:
            position = self._setup.position[id(seg)]
            runs = self._block_runs(seg, lr, self._setup.cuts[position], self._setup.kinds[position])
        apply_(seg.local_params, runs, lr, g["weight_decay"], update, back, returned, _CHUNK)

    @staticmethod
    def _block_runs(seg: Segment, lr: float, cuts: list, kinds: list) -> list[tuple[int, int, float]]:
        """`(lo, hi, adjusted_lr)` over the local pieces of the active parameters, cut where their
        blocks meet: each block scaled by its own (full) shape, as a parameter of that shape would be."""
        runs = []
        for i in range(len(seg.params)):
            (lo, hi), (start, stop) = seg.local_range(i), seg.tensor_range(i)
            if not seg.active[i] or hi <= lo:
                continue
            for at, rows, cols, full_rows, full_cols in local_blocks(cuts[i], seg.group, kinds[i]):
                a, z = max(start, at), min(stop, at + rows * cols)
                if a < z:
                    alr = adjusted_lr(lr, seg.group["adjust_lr_fn"], full_rows, full_cols)
                    runs.append((lo + a - start, lo + z - start, alr))
        return runs

    def _orthogonalize(
        self,
        batches: dict[tuple[int, int], list[int]],
        seg: Segment,
        buf: torch.Tensor,
        ids: dict[tuple[int, int], list[int]],
    ) -> torch.Tensor:
        """Newton–Schulz, in place in `buf`, on the matrices at `batches`' offsets, one batch
        per shape; then NorMuon on each matrix of a stepping parameter (`ids`: their indices)."""
        group = seg.group
        steps, coefficients, eps = ns_steps_of(group), group["ns_coefficients"], group["eps"]
        position = self._setup.position[id(seg)]
        blocks = self._setup.blocks[position]
        for (rows, cols), offsets in batches.items():
            n = rows * cols
            views = [buf[o : o + n].view(rows, cols) for o in offsets]
            orthogonalize_(views, steps, coefficients, eps, self.ns_backend)
            for view, k in zip(views, ids[rows, cols]) if group["normuon"] else ():
                if seg.active[blocks[k][0]]:  # a parameter not stepping keeps its v
                    kept = self._setup.variance[position, k]
                    v = kept.decode()
                    normuon_(view, v, float(group["normuon_beta2"]))
                    kept.encode_(v)
            self.orthogonalized += len(offsets)
            self.step_stats["ns_matrices"] += len(offsets)
            self.step_stats["ns_flops"] += len(offsets) * ns_flops(rows, cols, steps)
        return buf

    def _owned_state(self, seg: Segment) -> list[list[Owned]]:
        """NorMuon's per-row second moment of each matrix, kept by the matrix's owner:
        `variance_neuron` (rows,) for a parameter of one matrix, `variance_neuron_{b}` for block `b`
        of one cut into several (a stack's matrices, `split_sizes`, `num_heads`); stored in the
        tier of the matrix's momentum (8-bit: int8 codes of `sqrt(v)` and a scale per block). A
        DTensor's blocks are the whole tensor's (every TP shard's, every expert), under the
        one-process keys, with owners in the dp x tp world (`StateIO.owned_world`)."""
        out: list[list[Owned]] = [[] for _ in seg.params]
        setup = getattr(self, "_setup", None)  # (None during construction, before the plan)
        position = None if setup is None else setup.position.get(id(seg))
        if position is None or not seg.group["normuon"]:
            return out
        blocks, owners = setup.blocks[position], setup.owners[position]
        for k, (i, b) in enumerate(blocks):
            whole = group_blocks(tuple(seg.params[i].shape), seg.group)  # a DTensor's: the whole tensor's
            key = "variance_neuron" if len(whole) == 1 else f"variance_neuron_{b}"
            rows = whole[b][1]
            kept = setup.variance.get((position, k))
            tensor = None if kept is None else kept.buffer
            coded = None if kept is None or kept.codec.exact else kept
            out[i].append(Owned(key, (rows,), owners[k], tensor, coded))
        return out
