"""The sharded-optimizer base: a `torch.optim.Optimizer` that holds a sharding runtime.

A subclass declares each parameter's layout granule (`_granule`), its flat state per segment
(`_state_specs`, stored by the tier's codec: `state_tiers`), how to update a segment (`_update`:
pure math on its flat tensors, or a `Move` for whole matrices or tiles), optionally work that
spans a step's segments (`_step_phase`), state kept whole on one rank (`_owned_state`) and
the step statistics it counts (`step_stat_names`). The runtime (`units.Runtime`) does the
rest: units, hooks, gradient reduction, which parameters step, clipping, memory; the state
dicts go through `StateIO` (the sharded one for DCP, keyed by parameter name: `sharded_state`).

A parameter takes a step iff some rank has a gradient for it, as in torch; the ranks
agree on that with one small all-reduce per step.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.profiler import record_function

from ..owners.moves import run_moves
from ..shard.comm import Comm
from ..units.config import ShardingConfig
from ..units.runtime import Declaration, Runtime
from ..units.segment import FROZEN, Segment
from ..units.tensor_parallel import is_dtensor, local
from ..units.unit import Unit
from . import _step_stats, state_tiers
from ._checks import changed_structure, check_params, check_same_on_every_rank, replaced_params
from ._guards import caller_stacklevel, check_amp_scaler, label_params
from ._memory import MemoryAccounting
from .declarations import Declarations
from .sharded_state import ShardedStateDict
from .state_dict import Gather, StateIO
from .torch_state import LocalState, StateAttribute, through_torch_load, through_torch_state_dict


def refuse_dtensors(owner: str, params: list[torch.Tensor], takes_dtensors: bool) -> None:
    """An optimizer whose math is not element-wise (`takes_dtensors=False`) refuses DTensor
    parameters by name: it would need each whole matrix or tile across the TP shards, and
    orthogonalizing the local shards alone would depend on the TP size."""
    if takes_dtensors or not any(is_dtensor(p) for p in params):
        return
    raise NotImplementedError(
        f"{owner} does not support DTensor (tensor-parallel) parameters yet: its math needs whole "
        "matrices or tiles across the TP shards; use vo.AdamW for them, or give this optimizer "
        "plain (non-DTensor) parameters only"
    )


class ShardedOptimizer(Declarations, ShardedStateDict, MemoryAccounting, torch.optim.Optimizer):
    """A `torch.optim.Optimizer` whose parameters, gradients and state are ragged-sharded.

    With `shard_modules`, each listed module is a unit whose parameters are gathered before its
    forward and backward and freed after (ZeRO-3); without, parameters stay whole on every rank
    (ZeRO-2). Either way gradients are reduce-scattered during backward into each rank's shard.
    Without an initialised process group it is an ordinary single-process optimizer. The
    sharding keywords are `ShardingConfig`'s. `opt.state[p]` is this rank's piece of `p`'s state
    under `state_dict()`'s names: the whole tensor where the rank holds all of it (always in one
    process), else a 1-D view of its elements of the flattened tensor; fp32 state as views, bf16
    and 8-bit state decoded into copies at each read (see `LocalState`)."""

    state = StateAttribute()  # torch's `defaultdict(dict)` until the `LocalState` is built

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _step_stats.register(cls.step_stat_names)

    def __init__(self, params, defaults: dict, sharding: ShardingConfig | dict[str, Any] | None = None):
        if not isinstance(sharding, ShardingConfig):
            sharding = ShardingConfig.of(type(self).__name__, dict(sharding or {}))
        self.runtime: Runtime | None = None
        super().__init__(params, defaults)
        self.skip_nonfinite = sharding.skip_nonfinite
        self.skipped_steps = 0
        self.step_stats = _step_stats.fresh()
        self._sharding = sharding
        self._used = False  # stepped or loaded state: its parameters are fixed from then on
        self._build()

    def _build(self) -> None:
        """Lay out the param groups' parameters (the runtime: units, hooks, state), then the
        subclass's plan (`_plan_work`). Runs at construction, and again if the parameters are swapped
        before the first step (`_follow_swapped`)."""
        all_params = [p for g in self.param_groups for p in g["params"]]
        try:  # a problem only this rank has is raised on every rank, once they have agreed
            self._check_params(all_params)
            local = None
        except ValueError as e:
            local = str(e)
        self._labels = label_params(self.param_groups)
        local = local or state_tiers.precision_problem(all_params, self.state_bits, self._labels)

        def agree(world, problem: str | None, structure: list) -> None:
            check_same_on_every_rank(self.param_groups, world, local or problem, structure)

        runtime = Runtime(
            self.param_groups, self._sharding, self._declare, self._labels, self._step_problem, agree
        )
        self.runtime = runtime
        self._sent_until = runtime.collective_bytes()  # at the end of the last step
        for seg in runtime.segments:
            specs = [] if seg.tier == FROZEN else self._state_specs(seg)
            seg.set_state(specs, state_tiers.codec_of(seg.tier))
        self._structure = [{k: g.get(k) for k in self.structural_keys} for g in self.param_groups]
        self._built_over = [list(g["params"]) for g in self.param_groups]  # `_follow_swapped`
        self._io = StateIO(
            runtime.segments,
            self.param_groups,
            self.structural_keys,
            comm=runtime.comm,
            world=runtime.dp,
            replicas=runtime.topology.replicas,
            stepless=self._stepless,
            owned=self._owned_state,
            publish=lambda: runtime.publish(),
        )
        self.state = LocalState(runtime.segments, self._owned_state)
        self._plan_work()

    def _swapped(self) -> bool:
        """Whether the param groups hold other parameters than the optimizer was built over."""
        return replaced_params(self.param_groups, self._built_over, type(self).__name__) is not None

    def _follow_swapped(self) -> None:
        """accelerate's `prepare(model, opt)` under FSDP2 builds the optimizer over the plain model,
        then swaps its param groups' parameters for FSDP2's DTensors in place, on every rank alike.
        Before the first step (and before any state was loaded) nothing of the old layout matters:
        it is dropped and the optimizer is laid out anew over the parameters it now holds, on every
        rank at the same collective call (step, clipping, the state dicts). Afterwards the state
        belongs to the old parameters: the step refuses by name (`_step_problem`)."""
        if self._used or not self._swapped() or any(u.sharded for u in self.runtime.units):
            return
        self.runtime.release()
        StateAttribute.forget(self)
        self._build()

    def _declare(self, p: torch.Tensor, group: int) -> Declaration:
        """A parameter's granule, state tier and alignment, for the runtime's layout: its tier's codec
        may refine the granule (8-bit blocks stay whole); frozen parameters need none."""
        if not p.requires_grad:
            return Declaration(1, FROZEN)
        p = local(p)  # a DTensor parameter is laid out by its local shard
        codec = state_tiers.codec_for(p, self.state_bits)
        granule = codec.granule(p, self._granule(p, self.param_groups[group]))
        return Declaration(granule, codec.tier, align=codec.align)

    def _check_params(self, params: list[torch.Tensor]) -> None:
        """Refuse what cannot be sharded (subclasses add their own conditions); a ValueError
        is raised on every rank, whichever rank found it."""
        check_params(params)
        refuse_dtensors(type(self).__name__, params, self.takes_dtensors)  # alike on every rank

    # --- the step ---------------------------------------------------------------------------

    @property
    def process_group(self):
        return self.runtime.comm.group

    @property
    def world_size(self) -> int:
        return self.runtime.comm.world_size

    @property
    def rank(self) -> int:
        return self.runtime.comm.rank

    @property
    def units(self) -> list[Unit]:
        """The communication units, in model order (read-only use: memory, tests)."""
        return list(self.runtime.units)

    @property
    def segments(self) -> list[Segment]:
        """The segments (param group x state tier ranges of each unit), in model order."""
        return list(self.runtime.segments)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # read by torch.amp.GradScaler.step; refuses a scaler whose skip decision is per rank
        check_amp_scaler(self.runtime.comm.active)
        return False

    def _step_problem(self) -> str | None:
        """The optimizer's reason not to step: its parameters replaced, a state-shaping key or a
        hyperparameter changed."""
        problem = replaced_params(self.param_groups, self._built_over, type(self).__name__)
        problem = problem or changed_structure(self.param_groups, self._structure)
        for gi, g in enumerate(self.param_groups):
            problem = problem or self._check_group(gi, g)
        return problem

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Finish averaging gradients over ranks into each rank's shards and agree which
        parameters step (collective; once per step, `step()` calls it)."""
        self._follow_swapped()
        if self.runtime.gradients_reduced:
            return
        self.step_stats = _step_stats.fresh()
        self._traffic(self.runtime.reduce_gradients())

    def _traffic(self, sent: int, received: int | None = None) -> None:
        self.step_stats["bytes_sent"] += sent
        self.step_stats["bytes_received"] += sent if received is None else received

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step; every rank calls it (it runs collectives).

        `closure`, as in torch, re-evaluates the model (with grad enabled) and returns the
        loss. The gradients backward has not reduced yet are reduced first; then every
        parameter that some rank has a gradient for is updated from its shard, and the new
        values reach the parameters. With `skip_nonfinite`, a step whose gradients hold inf
        or NaN changes nothing on any rank (counted in `skipped_steps`, with a warning).
        Refreshes `step_stats`. Returns the closure's loss, or None."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.reduce_gradients()
        self._used = True
        self.runtime.step_taken()
        if self.skip_nonfinite and self.runtime.any_nonfinite():
            self.skipped_steps += 1
            warnings.warn(
                f"skipped step: non-finite gradients ({self.skipped_steps} so far)",
                stacklevel=caller_stacklevel(),
            )
            self._count_collectives()
            return loss
        for seg in self.runtime.segments:
            seg.advance()
        self.state.changed()
        changed = self.runtime.stepping()
        self.runtime.refresh(changed)
        with record_function("vescale_optim.update"):
            self._before_update()
            moves, stepping = [], [seg for seg in self.runtime.segments if seg.any_active]
            for seg in stepping:
                move = self._update(seg, seg.local_grads())
                if move is not None:
                    moves.append(move)
            moves += self._step_phase(stepping)
            self._traffic(*run_moves(moves, self.runtime.dp))
            self._after_update()
        self._traffic(self.runtime.publish(changed))
        self._count_collectives()
        return loss

    def _count_collectives(self) -> None:
        """`gather_bytes` and `reduce_bytes`: what this rank sent in the units' all-gathers
        and gradient reductions since the previous step (its forward and backward too)."""
        now = self.runtime.collective_bytes()
        self.step_stats["gather_bytes"] = now[0] - self._sent_until[0]
        self.step_stats["reduce_bytes"] = now[1] - self._sent_until[1]
        self._sent_until = now

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every gradient, as torch: `set_to_none=True` sets every `.grad` to None (a
        parameter that then gets no gradient takes no step); `set_to_none=False` keeps the
        gradients that exist, zeroed (those parameters step with a zero gradient).

        Gradients live in the units' shards once reduce-scattered, where a parameter's
        `.grad` is a `ReducedGrad` placeholder; zeroing zeroes the shards."""
        if self._swapped():  # not laid out over them (yet: `_follow_swapped`): their `.grad` as torch
            torch.optim.Optimizer.zero_grad(self, set_to_none)
            return
        self.runtime.zero_grad(set_to_none)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside keep their gradients unreduced (summed in full buffers); the first
        backward after it, or the step, reduce-scatters everything at once. Faster accumulation for
        more memory; the result is the same."""
        with self.runtime.no_sync():
            yield

    @contextlib.contextmanager
    def no_all_reduce(self) -> Iterator[None]:
        """With a `replicate` mesh dimension: backward passes inside reduce-scatter their gradients
        within each shard group as usual but keep them unsynced across replicas; the first backward
        after it, or the step, all-reduces it across replicas once (fewer bytes, one more shard)."""
        with self.runtime.no_all_reduce():
            yield

    @torch.no_grad()
    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        pp_mesh: DeviceMesh | ProcessGroup | None = None,
    ) -> torch.Tensor:
        """Clip the averaged gradient to `max_norm` in `norm_type` norm over all shards.

        Returns the total norm before clipping (the same on every rank, and what
        `torch.nn.utils.clip_grad_norm_` gives on one process with the mean gradient).
        Finishes the gradient reduction here; `step()` does not repeat it.

        `pp_mesh` (a 1-D `DeviceMesh`, e.g. `world["pp"]`, or its process group): the
        pipeline stages this optimizer's model part is one of, each with an optimizer over its
        own part; the norm is then the whole model's (every stage's rank of the mesh calls
        this, as torchtitan's `clip_grad_norm_` with its `pp_mesh`). One optimizer per rank:
        a rank holding several stages (interleaved schedules) clips through torch's
        `clip_grad_norm_` instead (docs/guide.md, "Pipeline parallelism")."""
        self.reduce_gradients()
        across = None
        if pp_mesh is not None:
            across = Comm(pp_mesh.get_group() if isinstance(pp_mesh, DeviceMesh) else pp_mesh)
        return self.runtime.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, across)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "runtime", None) is not None:
            raise NotImplementedError(
                f"{type(self).__name__} plans its buffers at construction; pass every param group then"
            )
        super().add_param_group(param_group)

    # --- the model's own state ----------------------------------------------------------

    def gathered(self, modules=None, writeback: bool = True) -> contextlib.AbstractContextManager:
        """Whole parameters of all units (or `modules`') inside; in-place writes, the same on every rank,
        reach shards and masters on exit (see `units.gathered`). Collective; costs the units' full size."""
        return self.runtime.gathered(modules, writeback)

    def full_model_state_dict(self, model: nn.Module | None = None, *, to_rank: int | None = None) -> dict:
        """`model.state_dict()` with full tensors on the CPU (the outermost of
        `shard_modules` by default): each unit's parameters are gathered and moved to the
        CPU in turn, so no more than one unit's full parameters are on the device at a
        time; with `to_rank=r` the sharded units' parameters go to shard-group rank `r`
        only (the others' dicts lack them). Collective. Plain `model.state_dict()` gives
        the same on every rank."""
        return self.runtime.full_model_state_dict(model, to_rank)

    def sharded_model_state_dict(self, model: nn.Module | None = None) -> dict:
        """The model's parameters as this rank's pieces of them, `{name: DcpPiece}` (views
        of the shards in full precision: fp32 for bf16/fp16 models), for
        `torch.distributed.checkpoint`: each rank writes only its pieces and a load at any
        world size reads into them in place. Finish a load with
        `load_sharded_model_state_dict`. Names are `model.named_parameters()`'s (the
        outermost of `shard_modules` by default). Not collective."""
        return self.runtime.sharded_model_state_dict(model)

    def load_sharded_model_state_dict(self, state_dict: dict) -> None:
        """Finish `dcp.load` into `sharded_model_state_dict()`'s pieces: the shards hold the
        loaded parameters; units that keep whole parameters gather them (collective)."""
        self.runtime.load_sharded_model_state_dict(state_dict)

    # --- the optimizer's state ----------------------------------------------------------------

    def state_dict(self, *, to_rank: int | None = None, cpu_offload: bool = False) -> dict:
        """torch.optim format with full tensors and torch's state names.

        Collective: every rank of the optimizer's group must call it. By default every
        rank receives everything; with `to_rank=r` the state is gathered to group rank
        `r` only and the other ranks get `{"state": {}, "param_groups": [...]}`;
        `cpu_offload=True` puts the full tensors in CPU memory. Runs inside
        `torch.optim.Optimizer.state_dict`, so state-dict hooks fire as in torch.

        A parameter that never stepped has no entry, as in torch. bf16/fp16 parameters
        also carry their fp32 master under `"master"`, a key torch.optim ignores."""
        self._follow_swapped()
        gather = Gather(self.runtime.comm, to_rank, cpu_offload)
        return through_torch_state_dict(self, lambda sd: self._io.fill(sd, gather), super().state_dict)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch-format state (ours or torch's, any world size); refuses anything that
        does not fit before modifying anything.

        Runs inside `torch.optim.Optimizer.load_state_dict` (so its hooks fire and a load
        pre-hook may return a new dict): the loading is a pre-hook appended last, which
        sees the final dict and hands torch an empty `state` to install."""
        self._follow_swapped()
        self._used = self._used or bool(state_dict.get("state"))  # accelerate loads an empty one
        through_torch_load(self, self._io.load, super().load_state_dict, state_dict)

    def validate_param_groups(self, saved: list[dict]) -> None:
        """Raise ValueError unless `saved` (a state dict's param groups) matches this
        optimizer's groups in number, sizes and state-shaping keys; changes nothing."""
        self._io.validate_groups(saved)

    def __setstate__(self, state: dict) -> None:
        """torch's `load_state_dict` installs the loaded param groups through here: update
        ours in place, since the segments hold references to them."""
        groups = state.get("param_groups")
        if groups is not None and getattr(self, "runtime", None) is not None:
            for g, new in zip(self.param_groups, groups):
                g.update(new)
            state = {k: v for k, v in state.items() if k not in ("param_groups", "state")}  # ours stays
        super().__setstate__(state)


__all__ = ["Segment", "ShardedOptimizer"]
