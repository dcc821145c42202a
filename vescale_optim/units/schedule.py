"""When units gather, free and reduce: module and autograd hooks, prefetch, and ordering.

Every rank must issue the same collectives in the same order, and on a GPU the host
runs ahead of the device, so each collective is issued at a fixed point of the hook
order, tied to the model's structure — never to which parameters happened to receive
gradients, and never to whether an earlier collective looks finished (nothing here
polls completion; a wait is an order, on CUDA a stream waiting for another):

- forward: a unit gathers in its module's forward pre-hook (having been prefetched by
  the unit before it in the recorded forward order, issued before that unit's compute
  is queued) and frees in the post-hook;
- backward: a unit gathers when the first gradient reaches its module's outputs, and
  frees and reduce-scatters its gradients when the gradients of its module's inputs are
  done; units without such a trigger (the outermost one, a module whose inputs need no
  gradient, the buckets of no `shard_modules`) reduce-scatter in a fixed order as soon as
  their own gradients are complete (a multi-grad hook over just their parameters);
- backward's prefetch of the unit before: issued once the unit computing has accumulated
  half of its gradient elements (the start of a unit's backward holds the most
  activations and autograd's transient for its first gradient, as large as that
  parameter; the unit before is needed only at its end). A unit whose module holds
  other units' (the model around its blocks) gets gradients before and after theirs:
  there the prefetch follows its first gradient. If a backward reaches another unit or
  reduction first, the prefetch is issued there, before anything else.

One reduce-scatter is in flight at a time: before the next reduce-scatter or gather of
backward is issued, the one in flight is waited for (its buffer freed) and its
all-reduce across replicas (HSDP) issued, to run on while backward goes on. So at most
three unit-sized buffers are alive in backward: the parameters and gradient buffer of
the unit computing, and either the gradient buffer being reduced or the parameters
prefetched. Without backward prefetch a unit gathers when its backward starts, and
allocates its gradient buffer only once the reduce-scatter in flight has freed its own:
two unit-sized buffers at most.

A backward's round of reductions ends when every unit expected to reduce has (the
trainable units without a module, and those whose module ran forward towards a loss):
then it waits for every reduction, so that `step()` finds the gradients complete.
Units that did not reduce in backward (no gradient came) reduce in `finish()`.

The schedule keeps its bookkeeping of each unit in a `_Record` of its own; it changes a
unit only through the unit's methods.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from ..shard.collectives import all_gather_object
from .hooks import Arrivals, PostBackward, map_tensors, tensors_in
from .reduced_grad import ReducedGrad
from .unit import State, Unit


@dataclass
class _Record:
    """What the schedule knows of one unit: its module, whether that module encloses other
    units' and whether the unit has trainable parameters (fixed), and where the unit is
    in the current round (reset by `_new_round`)."""

    module: nn.Module | None
    encloses: bool
    trainable: bool
    arrivals: Arrivals | None = None  # counts its gradients when no module hook tells
    in_forward: bool = False
    in_backward: bool = False
    forward_calls: int = 0  # forwards towards a backward whose backward has not ended
    ran: bool = False  # its forward ran towards a backward in this round
    complete: bool = False  # (no module) its gradients arrived; it may reduce in order

    def reset(self) -> None:
        self.in_backward, self.forward_calls, self.ran, self.complete = False, 0, False, False
        if self.arrivals is not None:
            self.arrivals.reset()


class Schedule:
    """Drives `units` through forward and backward; `modules[k]` is unit k's module, or
    None for units without one (then nothing is ever freed, only gradients reduced).

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
    ):
        self.units = list(units)
        self.reshard_after_forward = reshard_after_forward
        self.backward_prefetch = backward_prefetch
        self.on_grad = on_grad
        self.sync_grads = True
        self.forward_order: list[Unit] = []  # pre-forward order, recorded as units first run
        self.backward_order: list[Unit] = []  # reverse post-forward order of the last forward
        self._post_forward_seen: list[Unit] = []
        self._reduced: set[int] = set()  # units reduced in this backward
        self._in_flight: Unit | None = None  # the unit whose reduce-scatter has not been waited
        self._deferred: Unit | None = None  # the unit backward prefetches next
        self._computing: Unit | None = None  # ... once this unit has accumulated
        self._grad_awaited = 0  # this many more gradient elements
        self._round_ended = False
        self._busy = False  # a forward or backward ran since the last step
        self._handles: list = []
        inner = {id(m): {id(c) for c in m.modules() if c is not m} for m in modules if m is not None}
        self._outermost = set(inner) - set().union(*inner.values())
        self._records: dict[int, _Record] = {}
        for unit, module in zip(self.units, modules):
            trainable = [(i, p) for i, p in enumerate(unit.params) if p.requires_grad]
            # its backward wraps other units': its gradients arrive before and after theirs
            encloses = module is not None and bool(inner[id(module)] & inner.keys())
            self._records[unit.index] = _Record(module, encloses, bool(trainable))
            for i, p in trainable:
                self._handles.append(p.register_hook(self._attach(unit, i)))
                self._handles.append(p.register_post_accumulate_grad_hook(self._accumulated(unit)))
            if module is not None:
                # the hooks run eagerly, outside any compiled graph of the module (a graph
                # breaks at them: at the unit's boundaries, nowhere else)
                pre = module.register_forward_pre_hook(torch.compiler.disable(self._pre_forward(unit)),
                                                       with_kwargs=True)  # fmt: skip
                post = module.register_forward_hook(torch.compiler.disable(self._post_forward(unit, module)))
                self._handles += [pre, post]
        # the fixed order of reductions not tied to a module: backward's usual order, then
        # the order they completed in the first backward on rank 0 (`_settle_order`)
        self._static = [u for u in sorted(self.units, key=lambda u: -u.index) if self._rec(u).module is None]
        self._completed: list[Unit] = []  # static units in the order they completed, first backward
        self._order_settled = False
        for unit in list(self._static):
            if self._rec(unit).trainable:
                self._watch(unit)

    def _rec(self, unit: Unit) -> _Record:
        return self._records[unit.index]

    # --- gradients ------------------------------------------------------------------

    def _attach(self, unit: Unit, i: int):
        def hook(grad):
            self._new_round()
            p = unit.params[i]
            if unit.placement_problem(i) is not None:
                return  # moved or cast after construction: the step refuses it
            if p.grad is not None and not isinstance(p.grad, ReducedGrad) and unit.grads.is_live(i):
                return
            if not self.backward_prefetch and not unit.grads.has_full:
                self._finish_scatter()  # one gradient buffer at a time: the one reduced is freed first
            unit.grads.bind(i)

        return hook

    def _accumulated(self, unit: Unit):
        def hook(p):
            if self._computing is unit:
                self._grad_awaited -= p.numel()
                if self._grad_awaited <= 0:
                    self._advance()  # the prefetch's fixed point
            if self.on_grad is not None:
                self.on_grad(p)
            arrivals = self._rec(unit).arrivals
            if arrivals is not None:
                arrivals.arrive(p)

        return hook

    def _watch(self, unit: Unit) -> None:
        """Reduce `unit` when its own gradients are complete, in the fixed order of such units."""
        rec = self._rec(unit)
        trainable = [p for p in unit.params if p.requires_grad]
        rec.arrivals = Arrivals(trainable, lambda: self._static_ready(unit))
        self._handles.append(rec.arrivals.handle)
        if unit not in self._static:
            self._static.append(unit)
            self._order_settled = False

    def _static_ready(self, unit: Unit) -> None:
        """A unit without module hooks has all its gradients: reduce it and every unit
        before it in the fixed order that is also complete (never out of order)."""
        rec = self._rec(unit)
        rec.complete, rec.in_backward = True, False
        if not self._order_settled:  # learning the order: reduce once all are complete, in index order
            if unit not in self._completed:
                self._completed.append(unit)
            waiting = [u for u in self._static if u.index not in self._reduced
                       and not (self._rec(u).module is not None and not self._rec(u).ran)]  # fmt: skip
            if all(self._rec(u).complete or not self._rec(u).trainable for u in waiting):
                for u in waiting:  # so the first backward leaves averaged gradients, as every later one
                    self._reduce(u)
            return
        for u in self._static:
            r = self._rec(u)
            if u.index in self._reduced or (r.module is not None and not r.ran):
                continue
            if r.trainable and not r.complete:
                break
            self._reduce(u)

    def _reduce(self, unit: Unit) -> None:
        if unit.index in self._reduced:
            return
        self._reduced.add(unit.index)
        rec = self._rec(unit)
        rec.complete = False
        if self.sync_grads and rec.trainable:
            # one reduce-scatter in flight: its buffer is freed before the next is issued
            self._advance()
            unit.grads.reduce(async_op=True)
            self._in_flight = unit
        expected = (u for u in self.units if self._rec(u).trainable and (self._rec(u).ran
                    or self._rec(u).module is None))  # fmt: skip
        if not self._round_ended and all(u.index in self._reduced for u in expected):
            with torch.profiler.record_function("vescale::wait_reductions"):
                self.wait_reductions()
            self._round_ended = True

    def _reduce_rest(self) -> None:
        """Reduce the units this backward did not, in a fixed order (the same on every rank)."""
        order = sorted(self.units, key=lambda u: -u.index)
        for unit in self._static + [u for u in order if u not in self._static]:
            self._reduce(unit)
        self._round_ended = True

    def _advance(self) -> None:
        """Wait for the reduce-scatter in flight, start its all-reduce across replicas, and
        issue the deferred prefetch (whatever else it waits for)."""
        self._finish_scatter()
        if self._deferred is not None:
            unit, self._deferred = self._deferred, None
            self._computing, self._grad_awaited = None, 0
            unit.unshard(async_op=True)

    def _flush_deferred(self) -> None:
        """A prefetch still deferred is issued before any other gather (it is needed sooner):
        the order of collectives never depends on how far the unit computing got."""
        if self._deferred is not None:
            self._advance()

    def _finish_scatter(self) -> None:
        if self._in_flight is not None:
            self._in_flight.grads.advance()
            self._in_flight = None

    def _new_round(self) -> None:
        """First event after a backward ended (or a step): forget that backward's marks."""
        self._busy = True
        if self._round_ended:
            self._round_ended = False
            self._reduced.clear()
            for rec in self._records.values():
                rec.reset()

    def wait_reductions(self) -> None:
        """Wait for every reduction issued (and the all-reduces across replicas they start)."""
        self._advance()
        for unit in self.units:
            unit.grads.wait()

    def finish(self) -> None:
        """Before the step: finish the round of reductions a backward started (if its end
        went unseen, e.g. a parameter cast behind our back loses its multi-grad hooks), wait
        for them, free what backward left gathered (not a unit still inside its forward:
        `unfinished_forward()` names it), and settle the order of reductions without a
        module (rank 0's, from the first backward)."""
        if self._busy and not self._round_ended:
            self._reduce_rest()
        self.wait_reductions()
        for unit in self.units:
            if not self._rec(unit).in_forward:
                unit.reshard()
        if self._static and not self._order_settled:
            self._settle_order()
        self._round_ended = True
        self._new_round()
        self._busy = False

    def unfinished_forward(self) -> str | None:
        """The names of the units whose forward started and has not finished, if any."""
        busy = [f"'{unit.name or unit.index}'" for unit in self.units if self._rec(unit).in_forward]
        return ", ".join(busy) or None

    def _settle_order(self) -> None:
        """Units without a module reduce in the order they completed in the first backward
        on rank 0 (every rank must issue them in one order); until then, at its end."""
        comm = self.units[0].world  # one order in every replica too: their all-reduces pair up
        seen = [u.index for u in self._completed]
        order = all_gather_object(seen, comm)[0]
        by_index = {u.index: u for u in self._static}
        ranked = [by_index[i] for i in order if i in by_index]
        self._static = ranked + [u for u in self._static if u not in ranked]
        self._order_settled = True

    # --- module hooks ---------------------------------------------------------------

    def _pre_forward(self, unit: Unit):
        rec = self._rec(unit)

        def hook(module, args, kwargs):
            if torch.is_grad_enabled() and unit.index in self._reduced and not rec.in_backward:
                self._round_ended = True  # a round its backward left unfinished (some unit got no gradient)
            if torch.is_grad_enabled():
                self._new_round()
            self._flush_deferred()
            if rec.in_backward:  # recomputation (activation checkpointing) inside backward
                unit.wait_unshard()
                return None
            rec.in_forward = True
            if unit not in self.forward_order:
                self.forward_order.append(unit)
            with torch.profiler.record_function(f"vescale::pre_forward[{unit.name}]"):
                unit.wait_unshard()
                following = self._next(self.forward_order, unit)
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
            rec.forward_calls += 1
            flat: list[torch.Tensor] = []
            map_tensors(lambda t: flat.append(t) or t, (args, kwargs))
            wanted = [t for t in flat if t.requires_grad]
            out = PostBackward.apply(lambda: self._post_backward(unit), *wanted)
            passed = iter((out,) if isinstance(out, torch.Tensor) else out)
            return map_tensors(lambda t: next(passed) if t.requires_grad else t, (args, kwargs))

        return hook

    def _post_forward(self, unit: Unit, module: nn.Module):
        rec = self._rec(unit)

        def hook(module_, args, output):
            if rec.in_backward:
                return None
            rec.in_forward = False
            if unit in self._post_forward_seen:
                self._post_forward_seen.remove(unit)
            self._post_forward_seen.append(unit)
            outputs = [t for t in tensors_in(output) if t.requires_grad]
            backward_comes = torch.is_grad_enabled() and bool(outputs)
            if backward_comes:
                rec.ran = True
                register_multi_grad_hook(outputs, lambda grads: self._pre_backward(unit), mode="any")
            outermost = id(module) in self._outermost
            if not backward_comes or (self.reshard_after_forward and not outermost):
                unit.reshard()
            if outermost:
                self.backward_order = list(reversed(self._post_forward_seen))
                self._post_forward_seen = []
            return None

        return hook

    def _pre_backward(self, unit: Unit) -> None:
        self._new_round()
        rec = self._rec(unit)
        rec.in_backward = True
        with torch.profiler.record_function(f"vescale::pre_backward[{unit.name}]"):
            self._flush_deferred()
            unit.wait_unshard()
            following = self._next(self.backward_order, unit) if self.backward_prefetch else None
            if following is None:
                return
            numel = sum(p.numel() for p in unit.params if p.requires_grad)
            awaited = min(numel, 1) if rec.encloses else numel // 2
            self._deferred = following
            if awaited:
                self._computing, self._grad_awaited = unit, awaited
            else:
                self._advance()

    def _post_backward(self, unit: Unit) -> None:
        rec = self._rec(unit)
        rec.forward_calls -= 1
        if rec.forward_calls > 0:
            return
        with torch.profiler.record_function(f"vescale::post_backward[{unit.name}]"):
            rec.in_backward = False
            unit.reshard()
            self._reduce(unit)

    @staticmethod
    def _next(order: list[Unit], unit: Unit) -> Unit | None:
        """The unit after `unit` in `order`, if it is to be gathered (prefetched)."""
        if unit in order:
            k = order.index(unit) + 1
            if k < len(order) and order[k].state is State.RESHARDED:
                return order[k]
        return None

    # --- control ----------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        """Keep unreduced gradients across backward passes (reduced after the last one)."""
        previous, self.sync_grads = self.sync_grads, False
        try:
            yield
        finally:
            self.sync_grads = previous

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
