"""SOAP's parameters as owner work: the items `vo.SOAP` declares, the state an owner keeps for each
parameter it owns, and what each rank does with a segment in a step (`SegmentSoap`).

Every trainable parameter is one item: its whole gradient is needed where its factors, bases and
rotated Adam moments live, on one owner rank, balanced over the world by the cost of a refresh
(`_soap_math.Plan.cost`). A parameter held whole by its owner stays where it is; one whose pieces
lie on several ranks (or any, under HSDP's replicas) travels there as the owner layer planned it
(`owners.plan`), and its update comes back. The math is `_soap_math`'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..owners.moves import Move
from ..owners.plan import SegmentMoves, WorkItem, mostly_on
from ..shard.redistribution import Piece
from ..units.segment import Segment, StateSpec
from . import state_tiers
from ._soap_math import (
    Plan,
    accumulate_,
    adam_direction_,
    initial_bases_,
    normalized,
    refresh_bases_,
    refreshes,
    rotate,
    shampoo_beta,
)
from .state_dict import Owned

EXP_AVG = StateSpec("exp_avg")
EXP_AVG_SQ = StateSpec("exp_avg_sq", stored_as_sqrt=True)


def param_items(seg: Segment, plans: list[Plan]) -> list[WorkItem]:
    """Each parameter of `seg` as a work item: its pieces in each shard rank's part of the segment
    (from `seg.rank_start(r)`), its cost a refresh's, its home the shard rank holding most of it."""
    layout, shard = seg.layout, seg.layout.shard_size
    items = []
    for i, plan in enumerate(plans):
        start, numel = layout.offsets[i], layout.sizes[i]
        pieces = []
        for r in range(start // shard, (start + numel - 1) // shard + 1) if numel else ():
            lo, hi = max(start, r * shard), min(start + numel, (r + 1) * shard)
            pieces.append(Piece(r, i, lo - r * shard - seg.rank_start(r), lo - start, hi - start))
        items.append(WorkItem(tuple(pieces), plan.cost, mostly_on(pieces) if pieces else None))
    return items


class ParamState:
    """What the owner of one parameter keeps: its factors `GG_k` and bases `Q_k` (per rotated
    dimension of the plan's view, in `factor_dtype`) and Adam's moments in the rotated space, laid out
    in the parameter's shape (stored in `codec`'s tier: fp32, bf16 or 8-bit blocks)."""

    def __init__(self, plan: Plan, codec, factor_dtype: torch.dtype, device: torch.device):
        self.plan = plan
        kw = dict(dtype=factor_dtype, device=device)
        self.factors = [None if d is None else torch.zeros(d, d, **kw) for d in plan.sides]
        self.bases = [None if d is None else torch.eye(d, **kw) for d in plan.sides]  # kept if eigh fails
        numel = math.prod(plan.shape)
        self.moments = {s.name: state_tiers.Kept(codec, s, numel, device) for s in (EXP_AVG, EXP_AVG_SQ)}

    def step(
        self, grad: torch.Tensor, calls: int, group: dict
    ) -> tuple[torch.Tensor | None, torch.Tensor, int]:
        """One step of this parameter from its whole averaged gradient (flat), its `calls`-th: the
        first builds the factors and their eigenbases and nothing else; later ones return the
        update direction (flat, the parameter's layout; before the step size), then take the
        gradient into the factors and, every `precondition_frequency` Adam steps, refresh the bases
        and carry the moments into them. Also returns how many bases were kept instead of computed
        (a device count) and how many were computed."""
        plan, bases = self.plan, self.bases
        # A copy of its own: a slice of a larger buffer may be aligned otherwise on another layout,
        # and BLAS kernels may round differently then; SOAP amplifies that where a factor has equal
        # eigenvalues (its basis there is anyone's), so the same bits need the same alignment.
        g = plan.to_view(grad.clone())
        computed = sum(d is not None for d in plan.sides)
        kept = torch.zeros((), dtype=torch.long, device=g.device)
        if calls == 1:
            accumulate_(self.factors, g, shampoo_beta(group))
            return None, initial_bases_(bases, self.factors) if computed else kept, computed
        work = [None if q is None else q.float() for q in bases]
        first, second = self.moments[EXP_AVG.name], self.moments[EXP_AVG_SQ.name]
        exp_avg, exp_avg_sq = plan.to_view(first.decode()), plan.to_view(second.decode())
        direction = adam_direction_(rotate(g, work), exp_avg, exp_avg_sq, group)
        update = plan.from_view(rotate(direction, work, back=True))
        if group["normalize_grads"]:
            update = normalized(update)
        accumulate_(self.factors, g, shampoo_beta(group))
        if refreshes(group, calls - 1) and computed:
            unrotated = rotate(exp_avg, work, back=True)
            exp_avg_sq, kept = refresh_bases_(bases, self.factors, exp_avg_sq)
            exp_avg = rotate(unrotated, [None if q is None else q.float() for q in bases])
        else:
            computed = 0
        first.encode_(plan.from_view(exp_avg))
        second.encode_(plan.from_view(exp_avg_sq))
        return update.reshape(-1), kept, computed


class SegmentSoap:
    """One segment's parameters seen from this rank: the states of those it owns (`states`, by
    parameter) and the moves that bring a parameter its owner does not hold whole to the owner and
    its update back. `kept` and `bases` count a step's bases kept instead of computed (a device
    count) and bases computed."""

    def __init__(self, seg: Segment, plans: list[Plan], moves: SegmentMoves, factor_dtype: torch.dtype):
        self.seg, self.plans, self.moves = seg, plans, moves
        codec, device = state_tiers.codec_of(seg.tier), seg.local_params.device
        self.states = {
            i: ParamState(plans[i], codec, factor_dtype, device) for i in [*moves.local, *moves.arriving]
        }
        self.kept: torch.Tensor | int = 0
        self.bases = 0

    def owned(self) -> list[list[Owned]]:
        """Per parameter, its state under the state-dict keys, with its owner (a world rank); the
        tensors on the owner only."""
        out: list[list[Owned]] = []
        for i, plan in enumerate(self.plans):
            out.append(owned_state(plan, self.moves.owners[i], self.states.get(i)))
        return out

    def _run(self, i: int, grad: torch.Tensor, calls: int) -> torch.Tensor | None:
        update, kept, computed = self.states[i].step(grad, calls, self.seg.group)
        self.kept = self.kept + kept
        self.bases += computed
        return update

    def step(self, grads: torch.Tensor, apply: Callable[[torch.Tensor], None]) -> Move | None:
        """This step's work on the segment's flat local `grads`: each owned parameter's step (where
        it lies, or once its gradient has arrived), the updates back to the ranks holding the pieces,
        and `apply(update)` with the segment's flat local update (zero where none)."""
        seg, moves = self.seg, self.moves
        calls = [seg.steps[i] if seg.active[i] else 0 for i in range(len(seg.params))]
        returns = any(c > 1 for c in calls)
        update = torch.zeros_like(grads)

        def local() -> None:
            for i in moves.local:
                if calls[i]:
                    lo, hi = seg.local_range(i)
                    u = self._run(i, grads[lo:hi], calls[i])
                    if u is not None:
                        update[lo:hi].copy_(u)

        def compute(received: torch.Tensor) -> torch.Tensor:
            for i in moves.arriving:
                if calls[i]:
                    at, n = moves.received_at[i], seg.layout.sizes[i]
                    u = self._run(i, received[at : at + n], calls[i])
                    received[at : at + n].copy_(
                        u if u is not None else torch.zeros_like(received[at : at + n])
                    )
            return received

        def finish(back: torch.Tensor) -> None:
            if returns:
                for _, p, at in moves.returned:
                    n = p.stop - p.start
                    update[p.offset : p.offset + n].copy_(back[at : at + n])
            apply(update)

        return moves.move(grads, compute=compute, finish=finish, local=local, label="soap", returns=returns)


def owned_state(plan: Plan, owner: int, state: ParamState | None) -> list[Owned]:
    """A parameter's state under its state-dict keys, `exp_avg`, `exp_avg_sq` (the parameter's
    shape), then `GG_k` and `Q_k` for each rotated dimension k of its view, with its owner (a world
    rank); the tensors where `state` is given (on the owner), else None."""
    out = []
    for spec in (EXP_AVG, EXP_AVG_SQ):
        kept = None if state is None else state.moments[spec.name]
        coded = None if kept is None or kept.codec.exact else kept
        tensor = None if kept is None else kept.buffer if coded else kept.buffer.view(plan.shape)
        out.append(Owned(spec.name, plan.shape, owner, tensor, coded))
    for k, d in enumerate(plan.sides):
        if d is not None:
            for key, tensors in ((f"GG_{k}", "factors"), (f"Q_{k}", "bases")):
                tensor = None if state is None else getattr(state, tensors)[k]
                out.append(Owned(key, (d, d), owner, tensor))
    return out
