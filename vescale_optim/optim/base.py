"""The sharded-optimizer base: units, segments, the step pipeline and clipping.

A subclass says how big a layout granule of each parameter is (`_granule`), which flat state
it keeps per segment (`_state_names`) and how to update a segment (`_update`), or it
overrides `_step_segments` for math that needs whole matrices. Everything else lives
here: planning the parameters into communication units (one per listed module with
`shard_modules`, else size-capped buckets), their gather/free/reduce life cycle (see
`units`), agreeing which parameters step, clipping, and checkpoints.

A parameter takes a step iff some rank has a gradient for it, as in torch; the ranks
agree on that with one small all-reduce per step.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
from torch import nn
from torch.profiler import record_function

from ..shard.layout import bucket_indices, plan_layout
from ..shard.mesh import resolve as resolve_mesh
from ..units import Unit
from ..units.assign import assign_units, outermost
from ..units.materialize import materialize
from ..units.model_state import ModelState, sharded_model_state
from ..units.schedule import Schedule
from ..units.unit import LOW_PRECISION, ring
from . import lowbit
from ._checks import check_params, check_same_on_every_rank
from ._guards import caller_stacklevel, check_amp_scaler, label_params
from .gradients import GradTrackingMixin
from .moves import Move, run_moves
from .segment import FROZEN, Segment
from .state_dict import CheckpointMixin

STEP_STATS = ("ns_matrices", "ns_flops", "roots", "bytes_sent", "bytes_received")


class ShardedOptimizer(CheckpointMixin, GradTrackingMixin, torch.optim.Optimizer):
    """A `torch.optim.Optimizer` whose parameters, gradients and state are ragged-sharded.

    With `shard_modules`, each listed module is a unit whose parameters are gathered
    before its forward and backward and freed after (ZeRO-3); without, parameters stay
    whole on every rank (ZeRO-2). Either way gradients are reduce-scattered during
    backward into each rank's shard. Without an initialised process group it is an
    ordinary single-process optimizer.
    """

    state_bits = 32  # storage of element-wise state; subclasses may take it as an argument
    _structural: tuple[str, ...] = ()  # param-group keys that shape the state: fixed after construction

    def __init__(
        self,
        params,
        defaults: dict,
        *,
        process_group=None,
        mesh=None,
        shard_modules: Sequence[nn.Module] | None = None,
        reshard_after_forward: bool = True,
        backward_prefetch: bool = True,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        bucket_cap_numel: int = 64 * 1024 * 1024,
        align: int = 16,
        skip_nonfinite: bool = False,
        sync_params: bool = True,
    ):
        self._segments = None
        super().__init__(params, defaults)
        groups = resolve_mesh(mesh, process_group)
        self._comm, self._replicate, self._world = groups.shard, groups.replicate, groups.world
        self._topology = groups.topology
        self.skip_nonfinite = skip_nonfinite
        self.skipped_steps = 0
        self.step_stats = dict.fromkeys(STEP_STATS, 0)
        self._grads_reduced = False
        all_params = [p for g in self.param_groups for p in g["params"]]
        self._check_params(all_params)
        check_same_on_every_rank(self.param_groups, self._world)
        self._labels = label_params(self.param_groups)
        for p in all_params:
            if p.requires_grad and p.dtype == torch.float64 and lowbit.tier(p, self.state_bits) != "fp32":
                raise ValueError(
                    f"parameter {self._labels[id(p)]} is float64, but state_bits={self.state_bits} would "
                    "keep its state below fp32; use state_bits=32"
                )
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        index = {id(p): i for i, p in enumerate(all_params)}
        members, modules, names = self._plan_units(all_params, shard_modules, bucket_cap_numel)
        self._units: list[Unit] = []
        self._segments: list[Segment] = []
        for k, (idx, module) in enumerate(zip(members, modules)):
            ps = [all_params[i] for i in idx]
            keys = [(group_of[id(p)], self._tier(p)) for p in ps]
            quantized = [tier == "q8" for _, tier in keys]
            granules = [self._layout_granule(p, g, tier) for p, (g, tier) in zip(ps, keys)]
            aligns = [math.lcm(align, lowbit.BLOCK) if q8 else align for q8 in quantized]
            layout = plan_layout([p.numel() for p in ps], granules, self._comm.world_size, align,
                                 aligns=aligns, segments=keys)  # fmt: skip
            unit = Unit(
                ps, [names[i] for i in idx], layout, self._comm, index=k, name=self._unit_name(k, module),
                sharded=shard_modules is not None, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                device=device, sync_params=sync_params, replicate=self._replicate, world=self._world,
            )  # fmt: skip
            self._units.append(unit)
            for key in dict.fromkeys(keys):
                mine = [j for j, kk in enumerate(keys) if kk == key]
                seg = Segment(unit, mine, [index[id(ps[j])] for j in mine], self.param_groups[key[0]], key[1])
                self._segments.append(seg)
        self._where = {id(p): (s, i) for s in self._segments for i, p in enumerate(s.params)}
        if any(u.meta for u in self._units):
            materialize(self._units, [m for m in modules if m is not None])
        for seg in self._segments:
            seg.state_names = [] if seg.tier == FROZEN else self._state_names(seg)
            seg.state = self._init_state(seg)
        self._structure = [{k: g.get(k) for k in self._structural} for g in self.param_groups]
        self._schedule = Schedule(self._units, modules, reshard_after_forward=reshard_after_forward,
                                  backward_prefetch=backward_prefetch, on_grad=self._mark)  # fmt: skip
        self._model_state = ModelState(self._units, modules)

    def _plan_units(self, params, shard_modules, cap: int):
        """Which parameters (by index) form each unit, and each unit's module (or None)."""
        if shard_modules is not None:
            unit_of, listed, names = assign_units(params, shard_modules)
            order = sorted(set(unit_of), key=unit_of.index)  # by first parameter: model order
            self._root = outermost(listed)
            members = [[i for i, u in enumerate(unit_of) if u == k] for k in order]
            return members, [listed[k] for k in order], names
        for p in params:
            if p.is_meta:
                raise ValueError(
                    f"parameter {self._labels[id(p)]} is on the meta device; building a model there needs "
                    "shard_modules, whose modules' reset_parameters() initialise it"
                )
        self._root = None
        keys = [(p.dtype, p.device) for p in params]
        members = bucket_indices([p.numel() for p in params], keys, cap)
        return members, [None] * len(members), {i: self._labels[id(p)] for i, p in enumerate(params)}

    def _unit_name(self, k: int, module: nn.Module | None) -> str:
        if module is None:
            return f"bucket{k}"
        if self._root is not None and module is not self._root:
            for name, m in self._root.named_modules():
                if m is module:
                    return name
        return f"{type(module).__name__}[{k}]"

    def _layout_granule(self, p: torch.Tensor, group: int, tier: str) -> int:
        """The granule the layout keeps whole: 8-bit blocks, the optimizer's own, or 1 (frozen)."""
        if tier == "q8":
            return lowbit.q8_granule(p)
        return 1 if tier == FROZEN else self._granule(p, self.param_groups[group])

    def _tier(self, p: torch.Tensor) -> str:
        return lowbit.tier(p, self.state_bits) if p.requires_grad else FROZEN

    # --- subclass hooks -----------------------------------------------------------

    def _granule(self, p: torch.Tensor, group: dict) -> int:
        """Elements per layout granule: rank boundaries inside `p` fall on multiples of this."""
        return 1

    def _state_names(self, seg: Segment) -> list[str]:
        """Names of the element-wise state tensors kept for a segment."""
        return []

    def _kind(self, seg: Segment) -> str:
        """Storage tier of the segment's element-wise state (see `lowbit`)."""
        return "fp32" if seg.tier == FROZEN else seg.tier

    def _init_state(self, seg: Segment) -> dict[str, torch.Tensor]:
        """The segment's state: each of its `state_names` over the segment, zero."""
        params = seg.local_params
        return lowbit.new_state(seg.state_names, self._kind(seg), seg.numel, params.device, params.dtype)

    def _update(self, seg: Segment, grads: torch.Tensor) -> Move | None:
        """Update the active ranges (`seg.runs()`) of `seg.local_params` (and state) from the
        averaged local `grads`; math that needs whole matrices or tiles returns a `Move`
        that the base runs with every other segment's (see `moves`)."""
        raise NotImplementedError

    def _check_group(self, gi: int, group: dict) -> str | None:
        """A problem with a param group's current hyperparameters, checked at every step."""
        return None

    # --- construction checks --------------------------------------------------------

    def _check_params(self, params: list[torch.Tensor]) -> None:
        """Refuse what cannot be sharded (subclasses add their own conditions)."""
        check_params(params)

    # --- the step pipeline --------------------------------------------------------

    @property
    def process_group(self):
        return self._comm.group

    @property
    def world_size(self) -> int:
        return self._comm.world_size

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def units(self) -> list[Unit]:
        """The communication units, in model order (read-only use: memory, tests)."""
        return list(self._units)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # read by torch.amp.GradScaler.step; refuses a scaler whose skip decision is per rank
        check_amp_scaler(self._comm.active)
        return False

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Finish averaging gradients over ranks into each rank's shards and agree which
        parameters step (collective; once per step, `step()` calls it)."""
        if self._grads_reduced:
            return
        self.step_stats = dict.fromkeys(STEP_STATS, 0)
        sent_before = sum(u.sent_bytes for u in self._units)
        with record_function("vescale_optim.sync_grads"):
            self._schedule.finish()
            self._reattach()
            pending = self._agree()
            for u in pending:
                u.reduce_grad(async_op=True)
            for u in pending:
                u.advance_grad()
            for u in self._units:
                u.sync_replicas()
                u.advance_grad()
            for u in self._units:
                u.wait_grad()
        self._traffic(sum(u.sent_bytes for u in self._units) - sent_before)
        self._grads_reduced = True

    def _traffic(self, volume: int) -> None:
        """Count `volume` bytes sent and as many received by this step's collectives."""
        self.step_stats["bytes_sent"] += volume
        self.step_stats["bytes_received"] += volume

    @property
    def _device(self) -> torch.device:
        """Where this rank's units live (small control tensors go there too, for NCCL)."""
        return self._units[0].device if self._units else torch.device("cpu")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.reduce_gradients()
        self._grads_reduced = False
        if self.skip_nonfinite and self._any_nonfinite():
            self.skipped_steps += 1
            warnings.warn(
                f"skipped step: non-finite gradients ({self.skipped_steps} so far)",
                stacklevel=caller_stacklevel(),
            )
            return loss
        for seg in self._segments:
            seg.advance()
        changed = [u for u in self._units if any(s.any_active for s in self._segments if s.unit is u)]
        for u in changed:
            u.refresh_shard()
        with record_function("vescale_optim.update"):
            self._step_segments()
        self._publish(changed)
        return loss

    def _step_segments(self) -> None:
        """Update every segment that steps: element-wise math at once, then the moves of
        the segments that need them, overlapped."""
        moves = []
        for seg in self._segments:
            if seg.any_active:
                move = self._update(seg, seg.local_grads())
                if move is not None:
                    moves.append(move)
        sent, received = run_moves(moves, self._world)
        self.step_stats["bytes_sent"] += sent
        self.step_stats["bytes_received"] += received

    def _publish(self, units: Sequence[Unit] | None = None) -> None:
        """Unsharded units: gather the updated shards into the parameters every rank keeps
        (sharded units gather before their next forward instead)."""
        with record_function("vescale_optim.gather_params"):
            units = [u for u in (self._units if units is None else units) if not u.sharded]
            handles = [u.gather_after_step(async_op=True) for u in units]
            for u, h in zip(units, handles):
                h.wait()
                self._traffic(ring(u.comm.world_size, u.shard.numel() * u.full.data.element_size()))

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_segments", None) is not None:
            raise NotImplementedError(
                f"{type(self).__name__} plans its buffers at construction; pass every param group then"
            )
        super().add_param_group(param_group)

    # --- the model's own state ----------------------------------------------------------

    def _param_names(self, model: nn.Module | None) -> dict[int, str]:
        root = model if model is not None else self._root
        if root is None:
            raise ValueError("pass the model: without shard_modules the optimizer does not know its names")
        names = {}
        for name, p in root.named_parameters():
            names.setdefault(id(p), name)
        missing = [self._labels[id(p)] for u in self._units for p in u.params if id(p) not in names]
        if missing:
            raise ValueError(f"the model does not hold parameters {missing} of this optimizer")
        return names

    def sharded_model_state_dict(self, model: nn.Module | None = None) -> dict:
        """The model's parameters as this rank's pieces of them, `{name: DcpPiece}` (views
        of the shards in full precision: fp32 for bf16/fp16 models), for
        `torch.distributed.checkpoint`: each rank writes only its pieces and a load at any
        world size reads into them in place. Finish a load with
        `load_sharded_model_state_dict`. Names are `model.named_parameters()`'s (the
        outermost of `shard_modules` by default). Not collective."""
        return sharded_model_state(self._units, self._param_names(model))

    @torch.no_grad()
    def load_sharded_model_state_dict(self, state_dict: dict) -> None:
        """Finish `dcp.load` into `sharded_model_state_dict()`'s pieces: the shards hold the
        loaded parameters; units that keep whole parameters gather them (collective)."""
        from ..shard.dcp import DcpPiece

        bad = [k for k, v in state_dict.items() if not isinstance(v, DcpPiece)]
        if bad:
            raise TypeError(f"{bad[:3]} are not pieces from sharded_model_state_dict(); pass its dict")
        self._publish()

    # --- memory -------------------------------------------------------------------------

    def local_state_numel(self) -> int:
        """Elements of optimizer state (masters included) held by this rank."""
        return sum(t.numel() for t in self._local_state_tensors())

    def local_state_bytes(self) -> int:
        """Bytes of every persistent tensor the optimizer holds on this rank besides the
        parameters and gradients: state, fp32 masters of bf16/fp16 parameters and
        preconditioners."""
        return sum(t.numel() * t.element_size() for t in self._local_state_tensors())

    def _local_state_tensors(self):
        for seg in self._segments:
            yield from seg.state.values()
        for u in self._units:
            if u.orig_dtype in LOW_PRECISION:
                yield u.shard

    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds now: `parameters` (shards, or whole parameters kept by
        unsharded units, in their dtypes), `gradients` (averaged-gradient shards, and
        those kept unsynced across replicas inside `no_all_reduce()`),
        `state` (`local_state_bytes()`, masters included), `unsharded` (gathered
        parameters and unreduced gradients of units between gather and free)."""
        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        params = grads = unsharded = 0
        for u in self._units:
            if u.sharded:
                params += 0 if u.orig_dtype in LOW_PRECISION else nbytes(u.shard)
            else:
                params += u.full.nbytes
            grads += u.grad_bytes + (nbytes(u.grad_unsynced) if u.grad_unsynced is not None else 0)
            unsharded += u.transient_bytes()
        return {"parameters": params, "gradients": grads, "state": self.local_state_bytes(),
                "unsharded": unsharded}  # fmt: skip


__all__ = ["Segment", "ShardedOptimizer"]
