"""Sharded SOAP: Adam in the eigenbasis of Shampoo's factors, every parameter's factors, bases and
rotated moments on one owner rank."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from ..owners.moves import Move
from ..owners.plan import plan_owners
from ..shard.collectives import all_reduce_
from ..units.segment import FROZEN, Segment, StateSpec
from . import state_tiers
from ._checks import check_params_arg
from ._guards import caller_stacklevel
from ._soap_math import FACTOR_DTYPES, Plan, check_hyperparameters, refreshes, step_size
from ._soap_reference_format import from_reference, to_reference
from ._soap_work import SegmentSoap, param_items
from .base import ShardedOptimizer
from .state_dict import Owned

# A parameter stays at the rank holding it while no rank's refresh work exceeds 1.1x the mean;
# when some must move, they stay while their rank's work is within 1.05x the mean.
_TOLERATE, _SLACK = 0.1, 0.05


class SOAP(ShardedOptimizer):
    r"""SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam"): Adam run in
    the eigenbasis of Shampoo's factors, with the arguments, defaults and math of the authors'
    reference implementation; every parameter's factors, bases and moments on one owner rank.

    A parameter is seen in its own dimensions (with `merge_dims`, neighbouring ones multiplied
    together while their product stays at most `max_precond_dim`; a 4-D tensor in `channels_last`
    is merged from its channels-first order). Each dimension k of at most `max_precond_dim` has a
    factor `GG_k` and a basis `Q_k`; longer ones are not rotated, nor are 1-D parameters unless
    `precondition_1d`. Rotating `X` means `X ×_k Q_kᵀ` for every rotated k. With the averaged
    gradient G, `b = shampoo_beta` (`betas[1]` when negative), per parameter:

    - its first step only builds the preconditioner: `GG_k = lerp(0, G_(k) G_(k)ᵀ, 1 - b)` and
      `Q_k` its eigenvectors by descending eigenvalue (`torch.linalg.eigh`); the parameter is not
      touched (no update, no decay) and its Adam step count `t` stays 0;
    - later steps (`t` from 1): `g = rotate(G)`; `m <- b1 m + (1 - b1) g`, `v <- b2 v + (1 - b2) g^2`;
      `u = rotate_back(m / (sqrt(v) + eps))` (`u / RMS(u)` with `normalize_grads`);
      `p <- p - lr * sqrt(1 - b2^t) / (1 - b1^t) * u` (plain `lr` without `correct_bias`), then
      `p <- p - lr * weight_decay * p`; then `GG_k <- lerp(GG_k, G_(k) G_(k)ᵀ, 1 - b)`, and every
      `precondition_frequency` Adam steps each basis is refreshed: its columns sorted by
      `diag(Q_kᵀ GG_k Q_k)` (descending, `v` permuted alike), then `Q_k` = the Q of `qr(GG_k Q_k)`,
      and `m` is carried into the new basis. A factor or basis that is not finite keeps the last
      good basis (the identity before the first), counted in `kept_bases` and in
      `step_stats["kept_bases"]` (all ranks) with a warning.

    Sharding: each parameter is one item of owner work, its cost a refresh's (`Plan.cost`, about
    `13/3 d^3` per factor of side d plus carrying the moments), balanced over the world by the
    owner layer: a parameter stays at the rank holding most of it unless the busiest rank's work
    would exceed 1.1x the mean; then, largest first, one stays while its rank's work is within
    1.05x the mean. Its owner keeps its factors, bases and moments whole and receives its whole
    gradient (when it does not hold it); its update goes back to the ranks holding its pieces,
    which apply it and the decay. So the numbers are the same bits at any world size, under ZeRO-2,
    ZeRO-3 (`shard_modules`) and HSDP (`mesh` with replicas, which split the work). `refresh_work`
    and `native_refresh_work` give that cost per world rank after and before balancing,
    `moved_params` how many parameters travel each step. The layout's granule is one row (the
    whole of a 1-D parameter). DTensor parameters (tensor parallelism, FSDP2) are refused by name.

    `state_bits` (32, 16 or 8) stores the moments of parameters of 4096 elements or more in fp32,
    bf16 or 8-bit blocks (their grid from each parameter's element 0: the same bits at any world
    size); `factor_dtype` (fp32 or bf16) stores the factors and bases (the math runs in fp32).

    `state_dict()` is the reference's format: per parameter `step` (Adam steps, 0 after the first),
    `exp_avg` and `exp_avg_sq` (in the rotated space, the parameter's shape), `GG` and `Q` (lists,
    one entry per dimension of the view, `[]` where not rotated), `precondition_frequency` and
    `shampoo_beta` (as the reference keeps them); `load_state_dict` takes it (ours or the
    reference's) at any world size. `opt.state`, `sharded_state_dict()` (DCP) and
    `vo.CheckpointManager` keep `GG_k` and `Q_k` as keys of their own and `step` as steps taken.
    """

    def __init__(
        self,
        params,
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        shampoo_beta: float = -1,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = 10,
        max_precond_dim: int = 10000,
        merge_dims: bool = False,
        precondition_1d: bool = False,
        normalize_grads: bool = False,
        data_format: str = "channels_first",
        correct_bias: bool = True,
        *,
        state_bits: int = 32,
        factor_dtype: torch.dtype = torch.float32,
        **sharding: Any,
    ):
        defaults = dict(
            lr=lr,
            betas=tuple(betas) if isinstance(betas, list) else betas,
            shampoo_beta=shampoo_beta,
            eps=eps,
            weight_decay=weight_decay,
            precondition_frequency=precondition_frequency,
            max_precond_dim=max_precond_dim,
            merge_dims=merge_dims,
            precondition_1d=precondition_1d,
            normalize_grads=normalize_grads,
            data_format=data_format,
            correct_bias=correct_bias,
        )
        check_hyperparameters(defaults)
        check_params_arg(params)
        state_tiers.check_state_bits(state_bits)
        if factor_dtype not in FACTOR_DTYPES:
            raise ValueError(f"Invalid factor_dtype: {factor_dtype!r} (torch.float32 or torch.bfloat16)")
        self.state_bits, self.factor_dtype = state_bits, factor_dtype
        self.kept_bases = 0  # bases left as they were (non-finite factor or basis), all ranks, all steps
        self._due = False
        super().__init__(params, defaults, sharding)  # plans the owners (`_plan_work`)
        self.register_state_dict_post_hook(lambda opt, sd: to_reference(sd, self._plans_by_index()))
        self.register_load_state_dict_pre_hook(lambda opt, sd: from_reference(sd, self._plans_by_index()))

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        try:
            check_hyperparameters(self.param_groups[-1])
        except ValueError as e:
            raise ValueError(f"param group {len(self.param_groups) - 1}: {e}") from None

    # --- hooks ----------------------------------------------------------------------------

    structural_keys = ("max_precond_dim", "merge_dims", "precondition_1d", "data_format")
    step_stat_names = ("bases", "kept_bases")  # bases this rank computed; bases kept, all ranks

    def _check_group(self, gi: int, group: dict) -> str | None:
        try:
            check_hyperparameters(group)
        except ValueError as e:
            return f"param group {gi}: {e}"
        return None

    def _granule(self, p: torch.Tensor, group: dict) -> int:
        return p.numel() if p.dim() < 2 else math.prod(p.shape[1:])

    def _state_specs(self, seg: Segment) -> list[StateSpec]:
        return []  # every state tensor is kept whole by the parameter's owner (`_owned_state`)

    def _plan_work(self) -> None:
        """Every parameter as owner work, balanced over the world by its refresh cost."""
        runtime = self.runtime
        segs = [seg for seg in runtime.segments if seg.tier != FROZEN]
        plans = [[Plan.of(tuple(p.shape), seg.group) for p in seg.params] for seg in segs]
        work = [param_items(seg, ps) for seg, ps in zip(segs, plans)]
        plan = plan_owners(
            work,
            runtime.topology,
            runtime.dp.rank,
            slack=_SLACK,
            tolerate=_TOLERATE,
            sources=[seg.counts for seg in segs],
        )
        self._work = {
            id(seg): SegmentSoap(seg, ps, moves, self.factor_dtype)
            for seg, ps, moves in zip(segs, plans, plan.segments)
        }
        self.refresh_work, self.native_refresh_work = tuple(plan.loads), tuple(plan.home_loads)
        self.moved_params = plan.moved

    def owned_plans(self) -> list[Plan]:
        """The view of each parameter this rank owns (keeps the factors, bases and moments of):
        `shape`, `view`, `sides` (a factor's side per dimension of the view, None where not rotated)."""
        return [work.plans[i] for work in self._work.values() for i in work.states]

    def _plans_by_index(self) -> dict[int, Plan]:
        """Each parameter's plan by its index in the state dicts."""
        return {
            index: work.plans[i] for work in self._work.values() for i, index in enumerate(work.seg.indices)
        }

    def _before_update(self) -> None:
        self._due = False
        for work in self._work.values():
            work.kept, work.bases = 0, 0

    def _update(self, seg: Segment, grads: torch.Tensor) -> Move | None:
        group, work = seg.group, self._work[id(seg)]
        rotated = [count for count, a, plan in zip(seg.steps, seg.active, work.plans) if a and plan.rotated]
        self._due |= any(c == 1 or refreshes(group, c - 1) for c in rotated)  # the same on every rank

        def apply(update: torch.Tensor) -> None:
            p, decay = seg.local_params, float(group["lr"]) * group["weight_decay"]
            for i, count in enumerate(seg.steps):
                lo, hi = seg.local_range(i)
                if seg.active[i] and count > 1 and hi > lo:
                    p[lo:hi].add_(update[lo:hi], alpha=-step_size(group, count - 1))
                    if decay > 0:
                        p[lo:hi].add_(p[lo:hi], alpha=-decay)

        return work.step(grads, apply)

    def _after_update(self) -> None:
        self.step_stats["bases"] += sum(work.bases for work in self._work.values())
        kept = sum((work.kept for work in self._work.values()), 0)
        for work in self._work.values():
            work.kept = 0
        if self._due:
            self._count_kept(kept)

    def _count_kept(self, local: torch.Tensor | int) -> None:
        """Sum over ranks the bases kept this step (one small all-reduce and one read, on steps that
        build or refresh bases); count them in `kept_bases` and `step_stats`, and warn."""
        world = self.runtime.dp
        kept = torch.zeros(1, device=world.device)
        if isinstance(local, torch.Tensor):
            kept += local.to(world.device)
        all_reduce_(kept, world, "sum")
        n = int(kept.item())  # the one read of a refresh: every rank agrees on the count
        self.step_stats["kept_bases"] = n
        if n:
            self.kept_bases += n
            warnings.warn(
                f"SOAP kept the previous eigenbasis of {n} factor(s) this step: the factor or its new basis "
                f"was not finite (inf/nan gradients?) ({self.kept_bases} kept so far, see kept_bases)",
                stacklevel=caller_stacklevel(),
            )

    def _owned_state(self, seg: Segment) -> list[list[Owned]]:
        """Per parameter, `exp_avg`, `exp_avg_sq`, and `GG_k`, `Q_k` per rotated dimension k, kept whole
        by the parameter's owner."""
        work = getattr(self, "_work", {}).get(id(seg))  # none during construction, nor for frozen ones
        return work.owned() if work is not None else [[] for _ in seg.params]


__all__ = ["SOAP"]
