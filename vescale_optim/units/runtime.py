"""The sharding runtime an optimizer holds: its units, their schedule and everything that
follows the units and not the math.

`Runtime` plans the parameters into units (one per listed module with `shard_modules`,
else size-capped buckets), each with one flat buffer per role laid out so that no rank
boundary cuts a tensor's granule (`unit_plan`); it builds the segments through which the
optimizer sees the shards, materialises meta-device models, installs the module hooks (the
schedule), the model's state-dict hooks and gradient tracking, and runs the gradient
reduction, the agreement of which parameters step, clipping, memory accounting and the
sharded model state dict. It knows nothing of any optimizer's math: the optimizer
declares each parameter's granule, state tier and alignment (`Declaration`), reads and
writes the shards only through the segments, and reads tensor parallelism only through the
runtime's `TensorParallel` (`tensor_parallel`: each parameter's cut, the TP group, the dp x
tp world; `tp_view`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.profiler import record_function

from ..shard.collectives import Comm, all_reduce_
from ..shard.mesh import resolve as resolve_mesh
from .config import ShardingConfig
from .fsdp_shards import FsdpGrads, over_dtensors, shard_groups, shards_problem
from .gathered import gathered
from .grad_buffers import ring
from .hyper import hyper_digest, hyper_mismatch
from .materialize import materialize, needs_materializing
from .model_state import ModelState, sharded_model_state
from .ownership import claim, owned_elsewhere
from .schedule import Schedule
from .step_agreement import GradTracker
from .streams import reduction_comm
from .tensor_parallel import dtensor_problem, tp_groups, tp_norm_parts
from .tp_plan import checks_world, tp_plan_problem
from .tp_view import TensorParallel
from .unit import LOW_PRECISION, Unit, UnitComms
from .unit_plan import Declaration, UnitPlan, build_units, device_problem, plan_units
from .wrappers import DDPGrads, first_step, unwatch, watch


class Runtime:
    """The units of `param_groups` under `config`; `declare(p, group_index)` is the
    optimizer's `Declaration` of each parameter, `labels` names each parameter (by id) in
    errors, and `check()` returns the optimizer's reason not to step, if any (checked
    before the gradients are reduced, on every rank together). `agree(world, problem,
    structure)` runs once the groups are known and before any collective: the ranks agree
    that they hold the same parameters in the same units (`structure`: each unit's module
    and parameter indices) and that none found a `problem` (this rank's, or None: a
    parameter on the wrong device, one that another live optimizer already shards, a
    `shard_modules` entry that holds none of them), and raise together otherwise.

    A parameter of a sharded unit belongs to one runtime: between uses its `.data` is a
    stand-in, so a second optimizer over it would shard that instead of its values."""

    def __init__(
        self,
        param_groups: list[dict],
        config: ShardingConfig,
        declare: Callable[[torch.Tensor, int], Declaration],
        labels: dict[int, str],
        check: Callable[[], str | None] = lambda: None,
        agree: Callable[[object, str | None, list], None] | None = None,
    ):
        self.config, self.labels, self._check, self._groups = config, labels, check, param_groups
        params = [p for g in param_groups for p in g["params"]]
        # raised after the agreement below, so a rank left out of the plan (no DTensors, or no
        # mesh= either) raises with its peers instead of waiting for them
        over = over_dtensors(params, config)  # FSDP2's shards: units of this rank alone (`fsdp_shards`)
        refused = (shards_problem if over else dtensor_problem)(params, config, labels)
        groups = shard_groups() if over else resolve_mesh(config.mesh, config.process_group)
        self.comm, self.replicate, self.dp = groups.shard, groups.replicate, groups.dp
        self.topology, self.all_ranks = groups.topology, groups.all_ranks
        # tensor parallelism, as the optimizers see it (`tp_view`): each parameter's cut, the group
        # a parameter is sharded over (norms sum over it), the dp x tp world
        tp_comms = [] if over else [Comm(g) for g in tp_groups(params)]
        self.tensor_parallel = TensorParallel(params, self.dp, self.topology, tp_comms)
        problem = refused or device_problem(params, self.comm, labels) or owned_elsewhere(params, labels)
        try:
            plan = plan_units(params, param_groups, config, labels, over)
        except ValueError as e:  # raised on every rank, once they have agreed
            problem, plan = problem or str(e), UnitPlan()
        self.root, self._listed = plan.root, plan.listed
        # the ranks building this optimizer: beyond the dp mesh only with tensor parallelism
        self.world = None if over else checks_world(self.tensor_parallel, self.dp, self.all_ranks)
        if not over:  # every rank: see tp_plan
            problem = tp_plan_problem(params, self.world, labels) or problem
        if agree is not None:
            agree(self.dp, problem, plan.structure)
        elif problem is not None:
            raise ValueError(problem)
        reduce_comm = self.comm if over else reduction_comm(self.comm)  # on NCCL a communicator of its own
        comms = UnitComms(self.comm, self.replicate, self.dp, reduce_comm)
        self.units, self.segments = build_units(
            plan, params, param_groups, declare, comms, config, labels, over
        )
        listed = [m for m in plan.modules if m is not None]
        if needs_materializing(self.units, listed):
            materialize(self.units, listed, config.param_init_fn, self.world or self.dp)
        self._install(plan.modules, params, over)

    def _install(self, modules: list[nn.Module | None], params: list[torch.Tensor], over: bool) -> None:
        """The schedule's hooks, gradient tracking, the model's state-dict hooks, and who averages
        the gradients instead of us: DDP (`wrappers`) or FSDP2 (`fsdp_shards`)."""
        config = self.config
        self.schedule = Schedule(
            self.units,
            modules,
            reshard_after_forward=config.reshard_after_forward,
            backward_prefetch=config.backward_prefetch,
            on_grad=self._on_grad,
            enclosing=self._listed,
            microbatches=config.microbatches,
        )
        self.tracker = GradTracker(self.units, self.segments, self.schedule, self.dp, self.labels)
        self.model_state = ModelState(self.units, modules)
        self._reduced = False  # the gradients of this step are reduced (until step() or zero_grad)
        claim([p for u in self.units if u.sharded for p in u.params], self)
        self.wrapper: DDPGrads | FsdpGrads | None = None
        if over:
            self.schedule.remove()
            self.wrapper = FsdpGrads.of(self.units, self.tracker, params, self.dp, self.labels)
        watch(self)

    def under_ddp(self, ddp: nn.Module) -> None:
        """DistributedDataParallel `ddp` runs its forward: if it holds these parameters, it averages
        their gradients from now on and this runtime takes ZeRO-1's part (`wrappers.DDPGrads`)."""
        if self.wrapper is None and (taken := DDPGrads.of(self, ddp)) is not None:
            self.schedule.remove()  # before any gradient: nothing of ours ever reaches `.grad`
            self.wrapper = taken

    def release(self) -> None:
        """Let go of the parameters (units keeping them whole) for a new layout: hooks off, DDP unwatched."""
        self.schedule.remove()
        unwatch(self)

    def _on_grad(self, p: torch.Tensor) -> None:
        self.tracker.mark(p)

    # --- gradients ------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """Where this rank's units live (small control tensors go there too, for NCCL)."""
        return self.tracker.device

    @torch.no_grad()
    def reduce_gradients(self) -> int:
        """Finish averaging gradients over ranks into each rank's shards and agree which
        parameters step (collective; once per step). Returns the bytes this rank sent."""
        if self._reduced:
            return 0
        first_step(self)
        sent_before = sum(u.grads.sent_bytes for u in self.units)
        with record_function("vescale_optim.sync_grads"):
            if self.wrapper is not None:
                self.wrapper.take()
            else:
                self.schedule.finish()
                self.tracker.reattach()
            pending = self.tracker.agree(
                self._check(),
                hyper_digest(self._groups),
                lambda: hyper_mismatch(self._groups, self.dp),
                nonfinite=self.config.skip_nonfinite,
                tp=self.tensor_parallel.groups,
            )
            self.schedule.drain(pending)
        self._reduced = True
        return sum(u.grads.sent_bytes for u in self.units) - sent_before

    @property
    def gradients_reduced(self) -> bool:
        """Whether this round's gradients are reduced and agreed (until the step takes them)."""
        return self._reduced

    def step_taken(self) -> None:
        """The step consumed this round's reduced gradients: the next round reduces anew."""
        self._reduced = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.tracker.zero_grad(set_to_none, own_grads=self.wrapper is None)
        self._reduced = False

    def any_nonfinite(self) -> bool:
        """Whether the reduced gradients hold inf or NaN on some rank (under TP: on every TP
        rank alike); with `skip_nonfinite` the step's agreement carried it (no read of its own)."""
        return self.tracker.any_nonfinite(self.tensor_parallel.groups)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside keep their gradients unreduced (see the optimizers' `no_sync`)."""
        with self.schedule.no_sync():
            yield

    @contextlib.contextmanager
    def no_all_reduce(self) -> Iterator[None]:
        """Backward passes inside keep their gradients unsynced across replicas."""
        for u in self.units:
            u.grads.keep_unsynced(True)
        try:
            yield
        finally:
            for u in self.units:
                u.grads.keep_unsynced(False)

    @torch.no_grad()
    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        across: Comm | None = None,
    ) -> torch.Tensor:
        """Clip the averaged gradient to `max_norm` in `norm_type` norm over all shards (see
        the optimizers' `clip_grad_norm_`); returns the total norm before clipping. `across`:
        a group of ranks that hold other parts of the model (pipeline stages), whose norms
        combine with this one's into the whole model's."""
        self.reduce_gradients()
        norm_type = float(norm_type)
        grads = [u.grads.shard for u in self.units if u.grads.shard_bytes and not u.grads.borrowed]
        inf, op = math.isinf(norm_type), "max" if math.isinf(norm_type) else "sum"
        tp = self.tensor_parallel.group
        # summed in float64, so that how parameters are grouped into units does not round it;
        # under TP [replicated, TP-sharded] parts: the second summed over TP too, the first once
        if isinstance(self.wrapper, FsdpGrads):  # over the world, each element counted once
            all_reduce_(total := self.wrapper.norm_parts(norm_type, self.device), self.dp, op)
        else:
            total = tp_norm_parts(self.units, norm_type, self.device, tp is not None)
            all_reduce_(total, self.comm, op, what="clip_grad_norm_'s total norm")
        if tp is not None:
            all_reduce_(total[1:], tp, op, what="clip_grad_norm_'s norm over tensor parallelism")
        total = total.max() if inf else total.sum()
        if across is not None:  # the other stages' parts: disjoint parameters, combined once
            all_reduce_(total := total.reshape(1), across, op, what="clip_grad_norm_'s norm over the stages")
            total = total[0]
        total = (total if inf else total ** (1.0 / norm_type)).float()
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                "so it cannot be clipped. To disable this error and scale the gradients by the "
                "non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in [*grads, *(self.wrapper.grads() if self.wrapper is not None else ())]:
            g.mul_(coef.to(g.dtype))
        return total

    def unfinished_forward(self) -> str | None:
        return self.schedule.unfinished_forward()

    # --- parameters after the update ---------------------------------------------------------

    def stepping(self) -> list[Unit]:
        """The units with a parameter that takes this step."""
        return [u for u in self.units if any(s.any_active for s in self.segments if s.unit is u)]

    def refresh(self, units: Sequence[Unit]) -> None:
        """Before the update: take parameters written from outside into the shards."""
        for u in units:
            u.refresh_shard()

    def publish(self, units: Sequence[Unit] | None = None) -> int:
        """Unsharded units: gather the updated shards into the parameters every rank keeps
        (sharded units gather before their next forward instead). Returns bytes sent."""
        sent = 0
        units = self.units if units is None else units
        for u in units:  # a graph saved before this step refuses its backward (torch's in-place check)
            u.bump_versions()
        with record_function("vescale_optim.gather_params"):
            units = [u for u in units if not u.sharded]
            handles = [u.gather_after_step(async_op=True) for u in units]
            for u, h in zip(units, handles):
                h.wait()
                sent += ring(u.comm.world_size, u.shard.numel() * u.full.data.element_size())
        return sent

    def gathered(self, modules=None, writeback: bool = True) -> contextlib.AbstractContextManager:
        """Whole parameters inside (see the optimizers' `gathered`)."""
        return gathered(self.units, self.schedule, modules, writeback)

    def collective_bytes(self) -> tuple[int, int]:
        """Bytes this rank sent so far in the units' parameter all-gathers and in their
        gradient reductions (as many received)."""
        return sum(u.gathered_bytes for u in self.units), sum(u.grads.sent_bytes for u in self.units)

    # --- memory -----------------------------------------------------------------------------

    def masters(self) -> Iterator[torch.Tensor]:
        """The fp32 master shards of bf16/fp16 parameters (optimizer state, not parameters)."""
        for u in self.units:
            if u.orig_dtype in LOW_PRECISION:
                yield u.shard

    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds now in `parameters`, `gradients` and `unsharded` (see the
        optimizers' `memory_stats`)."""
        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        params = grads = unsharded = 0
        for u in self.units:
            if u.sharded or u.external:  # external: a copy of FSDP2's shards, none where they are borrowed
                params += 0 if u.orig_dtype in LOW_PRECISION or u.borrowed else nbytes(u.shard)
            else:
                params += u.full.nbytes
            grads += 0 if u.grads.borrowed else u.grads.shard_bytes
            grads += nbytes(u.grads.unsynced) if u.grads.unsynced is not None else 0
            unsharded += u.transient_bytes()
        return {"parameters": params, "gradients": grads, "unsharded": unsharded}

    # --- the model's own state ----------------------------------------------------------------

    def param_names(self, model: nn.Module | None) -> dict[int, str]:
        root = model if model is not None else self.root
        if root is None:
            raise ValueError("pass the model: without shard_modules the optimizer does not know its names")
        names = {}
        for name, p in root.named_parameters():
            names.setdefault(id(p), name)
        missing = [self.labels[id(p)] for u in self.units for p in u.params if id(p) not in names]
        if missing:
            raise ValueError(f"the model does not hold parameters {missing} of this optimizer")
        return names

    def full_model_state_dict(self, model: nn.Module | None = None, to_rank: int | None = None) -> dict:
        """`model.state_dict()` (the outermost of `shard_modules` by default) with full CPU
        tensors, the sharded units' parameters gathered to every rank or to `to_rank` only
        (collective)."""
        root = model if model is not None else self.root
        if root is None:
            raise ValueError("pass the model: without shard_modules the optimizer does not know it")
        if to_rank is not None and not (isinstance(to_rank, int) and 0 <= to_rank < self.comm.world_size):
            raise ValueError(
                f"to_rank must be a rank of the shard group, 0..{self.comm.world_size - 1}; got {to_rank!r}"
            )
        with self.model_state.to_rank(to_rank):
            return root.state_dict()

    def sharded_model_state_dict(self, model: nn.Module | None = None) -> dict:
        if isinstance(self.wrapper, FsdpGrads):
            raise ValueError(FsdpGrads.MODEL_STATE)
        return sharded_model_state(self.units, self.param_names(model))

    @torch.no_grad()
    def load_sharded_model_state_dict(self, state_dict: dict) -> None:
        from ..shard.dcp import DcpPiece

        bad = [k for k, v in state_dict.items() if not isinstance(v, DcpPiece)]
        if bad:
            raise TypeError(f"{bad[:3]} are not pieces from sharded_model_state_dict(); pass its dict")
        self.publish()
