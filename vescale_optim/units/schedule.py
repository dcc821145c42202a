"""When units gather, free and reduce: module and autograd hooks over three policies.

Every rank must issue the same collectives in the same order, and on a GPU the host
runs ahead of the device, so each collective is issued at a fixed point of the hook
order, tied to the model's structure — never to which parameters happened to receive
gradients, and never to whether an earlier collective looks finished (nothing here
polls completion; a wait is an order, on CUDA a stream waiting for another):

- forward: a unit gathers in its module's forward pre-hook (having been prefetched by
  the unit before it, `prefetch.Prefetcher`) and frees in the post-hook;
- backward: a unit gathers when the first gradient reaches its module's outputs (the unit
  before it is prefetched once it is half done), and frees and reduce-scatters its
  gradients when the gradients of its module's inputs are done; units without such a
  trigger reduce-scatter as soon as their own gradients are complete, in the fixed order
  `static_order.StaticOrder` learns in the first backward;
- reductions: one reduce-scatter in flight at a time (`reduction.ReductionPipeline`):
  before the next reduce-scatter is issued, the one in flight is waited for (its buffer
  freed) and its all-reduce across replicas (HSDP) issued. That wait is the only one the
  memory needs; backward's prefetch gather does not wait for it (`_prefetch`), so on a GPU
  the gather runs beside the reduce-scatter (on its own stream and, on NCCL, communicator:
  `streams`). So at most four unit-sized buffers are alive in backward: the parameters and
  gradient buffer of the unit computing, the parameters prefetched and the gradient buffer
  being reduced (FSDP2's count). Without backward prefetch a unit gathers when its
  backward starts, and allocates its gradient buffer only once the reduce-scatter in
  flight has freed its own: two unit-sized buffers at most.

Each backward frees and reduces a unit once (its *visit*, `visits.Record`): a module's unit
when the backward of every call of one forward is done, a watched unit when its gradients are
complete. Several forwards before their backwards, backwards in any order, a graph backwarded
twice (`retain_graph=True`): each backward gathers what it needs again and adds its reduced
gradients to the shard, so `.grad` is torch's gradient over the backwards, averaged over ranks.

The schedule's state is a `Round`, roughly one backward: `IDLE` from one step to the first
forward or backward event after it, `RUNNING` while a round's forwards and backwards run,
`ENDED` once every unit expected to reduce (the trainable units without a module, and those
whose module ran forward towards a loss or backward in it) has, and every reduction was
waited for, so that `step()` finds the gradients complete. The next event after `ENDED` opens
a new round, as does a watched unit complete again (a backward the last round did not
finish); `finish()` (before the step) reduces what the round did not, in a fixed order, and
returns to `IDLE`. The schedule changes a unit only through the unit's methods.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from .hooks import Arrivals, PostBackward, map_tensors, tensors_in
from .prefetch import Prefetcher
from .reduced_grad import ReducedGrad
from .reduction import ReductionPipeline
from .static_order import StaticOrder
from .unit import Unit
from .visits import Record


class Round(enum.Enum):
    """Where the schedule is between two steps (see the module's docstring)."""

    IDLE = "idle"
    RUNNING = "running"
    ENDED = "ended"


class Schedule:
    """Drives `units` through forward and backward; `modules[k]` is unit k's module, or
    None for units without one (then nothing is ever freed, only gradients reduced);
    `enclosing`: every module listed in `shard_modules`, those left without a unit too.

    `on_grad` is called with each parameter whose gradient was accumulated.
    """

    def __init__(
        self,
        units: Sequence[Unit],
        modules: Sequence[nn.Module | None],
        *,
        reshard_after_forward: bool = True,
        backward_prefetch: bool = True,
        on_grad: Callable[[torch.nn.Parameter], None] | None = None,
        enclosing: Sequence[nn.Module] = (),
        microbatches: int = 1,
    ):
        self.units = list(units)
        self.reshard_after_forward = reshard_after_forward
        self.on_grad = on_grad
        self.round = Round.IDLE
        self.prefetch = Prefetcher(backward_prefetch)
        self.reductions = ReductionPipeline(self.units, microbatches)
        self._handles: list = []
        inner = {id(m): {id(c) for c in m.modules() if c is not m} for m in modules if m is not None}
        # a unit is outermost (kept gathered from forward to backward) only if no listed module
        # holds it, one without parameters of its own (a root holding only blocks) included
        around = {id(m): {id(c) for c in m.modules() if c is not m} for m in enclosing}
        self._outermost = set(inner) - set().union(*inner.values(), *around.values())
        # a forward of a top listed module is a pass: its units' calls are backwarded together
        self._tops = (set(inner) | set(around)) - set().union(*inner.values(), *around.values())
        self._pass = 0
        for m in {id(m): m for m in enclosing if id(m) in self._tops and id(m) not in inner}.values():
            self._handles.append(m.register_forward_pre_hook(torch.compiler.disable(self._new_pass)))
        self._records: dict[int, Record] = {}
        for unit, module in zip(self.units, modules):
            trainable = [(i, p) for i, p in enumerate(unit.params) if p.requires_grad]
            # its backward wraps other units': its gradients arrive before and after theirs
            encloses = module is not None and bool(inner[id(module)] & inner.keys())
            self._records[unit.index] = Record(module, encloses, bool(trainable))
            for i, p in trainable:
                self._handles.append(p.register_hook(self._on_grad(unit, i)))
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_accumulated(unit)))
            if module is not None:
                # the hooks run eagerly, outside any compiled graph of the module (a graph
                # breaks at them: at the unit's boundaries, nowhere else)
                pre = torch.compiler.disable(self._on_pre_forward(unit))
                post = torch.compiler.disable(self._on_post_forward(unit, module))
                self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
                self._handles.append(module.register_forward_hook(post))
        self.static = StaticOrder([u for u in self.units if self._rec(u).module is None])
        for unit in list(self.static.units):
            if self._rec(unit).trainable:
                self._watch(unit)

    def _new_pass(self, *_) -> None:
        self._pass += 1

    @property
    def backward_prefetch(self) -> bool:
        return self.prefetch.backward_prefetch

    def _rec(self, unit: Unit) -> Record:
        return self._records[unit.index]

    # --- the round ------------------------------------------------------------------

    def _open(self) -> None:
        """Any forward or backward event: a round runs (an ended one is forgotten first)."""
        if self.round is Round.ENDED:
            self.reductions.new_round()
            for rec in self._records.values():
                rec.new_round()
        self.round = Round.RUNNING

    def _backward_event(self) -> None:
        """A backward event: the round's first issues the ranks' agreement on no_sync(), read at
        the round's first reduction (`reduction`'s docstring)."""
        if self.units:
            self.reductions.issue_agreement(self.units[0].dp)

    def _end_if_done(self) -> None:
        """RUNNING, every unit expected to reduce has: wait for them all, the round ENDED."""
        if self.round is not Round.RUNNING:
            return
        expected = (u for u in self.units if self._trainable(u) and self._takes_part(u))
        if all(u.index in self.reductions.reduced for u in expected):
            with torch.profiler.record_function("vescale::wait_reductions"):
                self.wait_reductions()
            self.round = Round.ENDED

    # --- gradient events --------------------------------------------------------------

    def _on_grad(self, unit: Unit, i: int):
        """A gradient of parameter `i` is about to accumulate: bind it to the unit's buffer."""

        def hook(grad):
            self._open()
            self._backward_event()
            p = unit.params[i]
            if unit.placement_problem(i) is not None:
                return  # moved or cast after construction: the step refuses it
            if p.grad is not None and not isinstance(p.grad, ReducedGrad) and unit.grads.is_live(i):
                return
            if not self.backward_prefetch and not unit.grads.has_full:
                self.reductions.advance()  # one gradient buffer at a time: the one reduced is freed first
            unit.grads.bind(i)

        return hook

    def _on_accumulated(self, unit: Unit):
        """A gradient accumulated: the prefetch may be due, and a unit without a module may
        be complete."""

        def hook(p):
            if self.prefetch.accumulated(unit, p.numel()):
                self._prefetch()  # the prefetch's fixed point
            if self.on_grad is not None:
                self.on_grad(p)
            arrivals = self._rec(unit).arrivals
            if arrivals is not None:
                arrivals.arrive(p)

        return hook

    def _watch(self, unit: Unit) -> None:
        """Reduce `unit` when its own gradients are complete, in the static order."""
        rec = self._rec(unit)
        trainable = [p for p in unit.params if p.requires_grad]
        rec.arrivals = Arrivals(trainable, lambda: self._on_complete(unit))
        self._handles.append(rec.arrivals.handle)
        self.static.add(unit)

    def _on_complete(self, unit: Unit) -> None:
        """A unit without module hooks has all its gradients: reduce those now due in the
        static order (never out of order). Complete again in the same round, it is in a
        backward that round did not see the end of: a new round (its static order) opens."""
        if unit.index in self.reductions.reduced:
            self.round = Round.ENDED
            self._open()
        rec = self._rec(unit)
        rec.complete, rec.depth = True, 0
        for u in self.static.due(unit, self._waiting, self._complete, self._trainable):
            self._reduce(u)

    def _takes_part(self, unit: Unit) -> bool:
        """Whether `unit` reduces in this round: without a module always, else if it ran."""
        rec = self._rec(unit)
        return rec.module is None or rec.ran

    def _waiting(self, unit: Unit) -> bool:
        """Whether `unit` is still to reduce in this round."""
        return unit.index not in self.reductions.reduced and self._takes_part(unit)

    def _complete(self, unit: Unit) -> bool:
        return self._rec(unit).complete

    def _trainable(self, unit: Unit) -> bool:
        return self._rec(unit).trainable

    def _reduce(self, unit: Unit) -> None:
        """`unit`'s gradients of this backward are done: reduce-scatter them (unless under
        `no_sync()`; added to what its shard holds), one in flight; the last expected ends
        the round."""
        self.reductions.settle(unit.dp)  # before any reduce-scatter of the round, on every rank
        self.reductions.reduced.add(unit.index)
        rec = self._rec(unit)
        rec.complete = False
        if self.reductions.reduces and rec.trainable:
            self._prefetch()  # a deferred prefetch first: any other collective of backward issues it
            self.reductions.advance()  # the one in flight is waited for (its buffer freed) first
            self.reductions.issue(unit)
        self._end_if_done()

    def _prefetch(self) -> None:
        """Issue the deferred prefetch, if any: without waiting for the reduce-scatter in flight
        (only the next reduce-scatter waits for it), so the two overlap on a GPU."""
        following = self.prefetch.take()
        if following is not None:
            following.unshard(async_op=True)

    def _flush_deferred(self) -> None:
        """A prefetch still deferred is issued before any other gather (it is needed sooner)."""
        if self.prefetch.deferred:
            self._prefetch()

    def wait_reductions(self) -> None:
        """Wait for every reduction issued (and the all-reduces across replicas they start)."""
        self._prefetch()
        self.reductions.wait_all()

    def finish(self) -> None:
        """Before the step: RUNNING, reduce what the round did not (if its end went unseen,
        e.g. a parameter cast behind our back loses its multi-grad hooks) in the static
        order's fixed order; wait for every reduction, free what backward left gathered (not
        a unit still inside its forward: `unfinished_forward()` names it), settle the static
        order (rank 0's, from the first backward); IDLE."""
        self.reductions.verify()  # before any reduction of the step: all raise together
        if self.round is Round.RUNNING:
            for unit in self.static.rest(self.units):
                if unit.index not in self.reductions.reduced:
                    self._reduce(unit)
            self.round = Round.ENDED
        self.wait_reductions()
        for unit in self.units:
            if not self._rec(unit).in_forward:
                unit.reshard()
            self._rec(unit).forget()
        if self.static.units and not self.static.settled:
            self.static.settle(self.units[0].dp)
        self.round = Round.ENDED
        self._open()
        self.round = Round.IDLE
        self.reductions.rounds = 1  # the step's first micro-batch comes next

    def unfinished_forward(self) -> str | None:
        """The names of the units whose forward started and has not finished, if any."""
        busy = [f"'{unit.name or unit.index}'" for unit in self.units if self._rec(unit).in_forward]
        return ", ".join(busy) or None

    def drain(self, pending: Sequence[Unit]) -> None:
        """The step's reductions of `pending` and of every unit across replicas (after `finish`)."""
        self.reductions.drain(pending)

    # --- module events ----------------------------------------------------------------

    def _on_pre_forward(self, unit: Unit):
        rec = self._rec(unit)

        def hook(module, args, kwargs):
            if torch.is_grad_enabled():
                if unit.index in self.reductions.reduced and not rec.in_backward:
                    self.round = Round.ENDED  # a round left unfinished (some unit got no gradient)
                self._open()
            self._flush_deferred()
            if rec.in_backward:  # recomputation (activation checkpointing) inside backward
                unit.wait_unshard()
                return None
            if id(module) in self._tops:
                self._new_pass()
            rec.in_forward = True
            with torch.profiler.record_function(f"vescale::pre_forward[{unit.name}]"):
                unit.wait_unshard()
                following = self.prefetch.forward_starts(unit)
                if following is not None:  # issued before this unit's compute is queued
                    following.unshard(async_op=True)
            if unit.compute_dtype != unit.orig_dtype:  # param_dtype: floating inputs are cast to it
                cast = lambda t, to=unit.compute_dtype: t.to(to) if t.is_floating_point() else t  # noqa: E731
                args, kwargs = map_tensors(cast, (args, kwargs))
            if not torch.is_grad_enabled():
                return args, kwargs
            if not any(t.requires_grad for t in tensors_in((args, kwargs))):
                if rec.trainable and rec.arrivals is None:  # no post-backward trigger: watch its gradients
                    self._watch(unit)
                return args, kwargs
            pass_id = self._pass
            rec.call_counted(pass_id)
            flat: list[torch.Tensor] = []
            map_tensors(lambda t: flat.append(t) or t, (args, kwargs))
            wanted = [t for t in flat if t.requires_grad]
            out = PostBackward.apply(lambda: self._on_post_backward(unit, pass_id), *wanted)
            passed = iter((out,) if isinstance(out, torch.Tensor) else out)
            return map_tensors(lambda t: next(passed) if t.requires_grad else t, (args, kwargs))

        return hook

    def _on_post_forward(self, unit: Unit, module: nn.Module):
        rec = self._rec(unit)

        def hook(module_, args, output):
            if rec.in_backward:
                return None
            rec.in_forward = False
            outputs = [t for t in tensors_in(output) if t.requires_grad]
            backward_comes = torch.is_grad_enabled() and bool(outputs)
            if backward_comes:
                rec.ran = True
                starts = lambda grads, pass_id=self._pass: self._on_pre_backward(unit, pass_id)  # noqa: E731
                register_multi_grad_hook(outputs, starts, mode="any")
            outermost = id(module) in self._outermost
            if not backward_comes or (self.reshard_after_forward and not outermost):
                unit.reshard()
            self.prefetch.forward_ends(unit, outermost)
            return None

        return hook

    def _on_pre_backward(self, unit: Unit, pass_id: int) -> None:
        """A backward of one of the unit's calls (of forward `pass_id`) starts: gather it
        (again, if an earlier backward freed it)."""
        self._open()
        self._backward_event()
        rec = self._rec(unit)
        rec.backward_starts(pass_id)
        with torch.profiler.record_function(f"vescale::pre_backward[{unit.name}]"):
            self._flush_deferred()
            unit.wait_unshard()
            if self.prefetch.backward_starts(unit, rec.encloses):
                self._prefetch()

    def _on_post_backward(self, unit: Unit, pass_id: int) -> None:
        """A call's backward is done: once the last call of its forward in this backward is,
        free the unit (unless another call's backward still runs) and reduce its gradients
        (a watched unit reduces in the static order instead)."""
        rec = self._rec(unit)
        if not rec.backward_done(pass_id):
            return
        with torch.profiler.record_function(f"vescale::post_backward[{unit.name}]"):
            if not rec.in_backward:
                unit.reshard()
            if rec.arrivals is None:
                self._reduce(unit)

    # --- control ----------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        """Keep unreduced gradients across backward passes (reduced after the last one)."""
        previous, self.reductions.sync_grads = self.reductions.sync_grads, False
        try:
            yield
        finally:
            self.reductions.sync_grads = previous

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
