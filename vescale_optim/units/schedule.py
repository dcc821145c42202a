"""When units gather, free and reduce: module and autograd hooks, prefetch, and ordering.

Every rank must issue the same collectives in the same order, so each trigger is tied
to the model's structure, never to which parameters happened to receive gradients:

- forward: a unit gathers in its module's forward pre-hook (having been prefetched by
  the unit before it in the recorded forward order) and frees in the post-hook;
- backward: a unit gathers when the first gradient reaches its module's outputs
  (prefetching the next unit in the recorded backward order), and frees and
  reduce-scatters its gradients when the gradients of its module's inputs are done;
- units without such a trigger (the outermost one, a module whose inputs need no
  gradient, the buckets of no `shard_modules`) reduce-scatter in a fixed order as soon
  as their own gradients are complete (a multi-grad hook over just their parameters).

One reduce-scatter is in flight at a time; once it finishes (seen at the next gradient,
or waited for before the next is issued) its all-reduce across replicas (HSDP) starts
and runs on while backward goes on. Backward's prefetch waits for that moment too, so
that at most three unit-sized buffers are alive: the parameters and gradient buffer of
the unit computing, and either the gradient buffer being reduced or the parameters
prefetched. It also waits until the unit computing has accumulated half of its gradient
elements: the start of a unit's backward holds the most activations and autograd's
transient for its first gradient (as large as that parameter), and the prefetched unit
is only needed at its end. A unit whose module holds other units' (the model around its
blocks) gets gradients before and after theirs: there the prefetch waits for its first.
The order of collectives stays fixed: a unit's gather always comes after the
reduce-scatter issued before its prefetch point and before the next one.
Without backward prefetch a unit gathers when its backward starts, and allocates its
gradient buffer only once the reduce-scatter in flight has freed its own: two
unit-sized buffers at most, the parameters and gradients of the unit computing.
A backward's round of reductions ends when every unit expected to reduce has (the
trainable units without a module, and those whose module ran forward towards a loss):
then it waits for every reduction, so that `step()` finds the gradients complete.
Units that did not reduce in backward (no gradient came) reduce in `finish()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from ..shard.collectives import all_gather_object
from .reduced_grad import ReducedGrad
from .unit import State, Unit


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj):
    """`obj` with `fn` applied to every tensor inside nested tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple
        return type(obj)(*(_map_tensors(fn, x) for x in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(_map_tensors(fn, x) for x in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(fn, v) for k, v in obj.items()}
    return obj


def _tensors(obj) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    _map_tensors(lambda t: found.append(t) or t, obj)
    return found


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs whose backward runs once the module's backward is
    done (every gradient of its inputs is computed)."""

    @staticmethod
    def forward(ctx, callback, *inputs):
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


class _Arrivals:
    """Calls `on_done` once every parameter of `params` that takes part in a backward has
    had its gradient accumulated.

    The first backward learns which take part from a multi-grad hook, which holds every
    incoming gradient until the last arrives; later backward passes count arrivals of those
    parameters and hold nothing. (A parameter that stops taking part leaves the unit for
    `finish()` to reduce; one that starts is reduced after the rest, at the step.)"""

    def __init__(self, params: Sequence[torch.Tensor], on_done: Callable[[], None]):
        self.params = list(params)
        self.expected: set[int] | None = None  # ids of the parameters that take part
        self.arrived: set[int] = set()
        self.on_done = on_done
        self.handle = register_multi_grad_hook(self.params, self._learn, mode="all")

    def _learn(self, grads) -> None:
        if self.expected is None:
            self.expected = {id(p) for p, g in zip(self.params, grads) if g is not None}
            self._check()

    def arrive(self, p: torch.Tensor) -> None:
        self.arrived.add(id(p))
        self._check()

    def reset(self) -> None:
        """A new round: forget arrivals; once learned, drop the multi-grad hook."""
        self.arrived = set()
        if self.expected is not None and self.handle is not None:
            self.handle.remove()
            self.handle = None

    def _check(self) -> None:
        if self.expected is not None and self.expected <= self.arrived:
            self.arrived = set()
            self.on_done()


class Schedule:
    """Drives `units` through forward and backward; `modules[k]` is unit k's module, or
    None for units without one (then nothing is ever freed, only gradients reduced).

    `marks` is called with each parameter whose gradient was accumulated.
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
        self.modules = list(modules)
        self.reshard_after_forward = reshard_after_forward
        self.backward_prefetch = backward_prefetch
        self.on_grad = on_grad
        self.sync_grads = True
        self.forward_order: list[Unit] = []  # pre-forward order, recorded as units first run
        self.backward_order: list[Unit] = []  # reverse post-forward order of the last forward
        self._post_forward_seen: list[Unit] = []
        self._reduced: set[int] = set()  # units reduced in this backward
        self._in_flight: Unit | None = None  # the unit whose reduce-scatter has not been waited
        self._deferred: Unit | None = None  # the unit to prefetch once that reduce-scatter is done
        self._computing: Unit | None = None  # ... and once this unit has accumulated
        self._grad_awaited = 0  # this many more gradient elements
        self._round_ended = False
        self._busy = False  # a forward or backward ran since the last step
        # the fixed order of reductions not tied to a module: backward's usual order
        self._order = sorted(self.units, key=lambda u: -u.index)
        for unit, module in zip(self.units, self.modules):
            unit.has_module = module is not None
        self._static = [u for u in self._order if not u.has_module]
        self._completed: list[Unit] = []  # static units in the order they completed, first backward
        self._order_settled = False
        self._handles: list = []
        inner = {id(m): {id(c) for c in m.modules() if c is not m} for m in modules if m is not None}
        self._outermost = set(inner) - set().union(*inner.values())
        for unit, module in zip(self.units, self.modules):
            # its backward wraps other units': its gradients arrive before and after theirs
            unit.encloses = module is not None and bool(inner[id(module)] & inner.keys())
            unit.in_forward = unit.in_backward = False
            unit.forward_calls = 0
            unit.ran = False  # its forward ran towards a backward in this round
            trainable = [(i, p) for i, p in enumerate(unit.params) if p.requires_grad]
            unit.trainable = bool(trainable)  # a unit of frozen parameters never reduces
            for i, p in trainable:
                self._handles.append(p.register_hook(self._attach(unit, i)))
                self._handles.append(p.register_post_accumulate_grad_hook(self._accumulated(unit)))
            unit.arrivals = None
            if module is None and trainable:
                self._watch(unit)
            if module is not None:
                pre = module.register_forward_pre_hook(self._pre_forward(unit), with_kwargs=True)
                self._handles += [pre, module.register_forward_hook(self._post_forward(unit, module))]

    # --- gradients ------------------------------------------------------------------

    def _attach(self, unit: Unit, i: int):
        def hook(grad):
            self._new_round()
            self._poll()
            p = unit.params[i]
            if p.dtype != unit.compute_dtype or p.device != unit.device:
                return  # moved or cast after construction: the step refuses it
            if p.grad is not None and not isinstance(p.grad, ReducedGrad) and unit.is_live_grad(i):
                return
            if not self.backward_prefetch and not unit.has_full_grad:
                self._finish_scatter()  # one gradient buffer at a time: the one reduced is freed first
            if p.grad is None:  # no gradient so far (zero_grad): nothing reduced earlier counts
                unit.drop_grad(i)
                p.grad = unit.grad_view(i)
            elif isinstance(p.grad, ReducedGrad):
                p.grad = unit.grad_view(i)  # the reduced gradient stays in the shard; this adds to it
            else:
                unit.take_grad(i, p.grad)  # a gradient set by hand: autograd accumulates on it

        return hook

    def _accumulated(self, unit: Unit):
        def hook(p):
            if self._computing is unit:
                self._grad_awaited -= p.numel()
                if self._grad_awaited <= 0:
                    self._computing = None
            self._poll()
            if self.on_grad is not None:
                self.on_grad(p)
            if unit.arrivals is not None:
                unit.arrivals.arrive(p)

        return hook

    def _watch(self, unit: Unit) -> None:
        """Reduce `unit` when its own gradients are complete, in the fixed order of such units."""
        trainable = [p for p in unit.params if p.requires_grad]
        unit.arrivals = _Arrivals(trainable, lambda: self._static_ready(unit))
        self._handles.append(unit.arrivals.handle)
        if unit not in self._static:
            self._static.append(unit)
            self._order_settled = False

    def _static_ready(self, unit: Unit) -> None:
        """A unit without module hooks has all its gradients: reduce it and every unit
        before it in the fixed order that is also complete (never out of order)."""
        unit.complete = True
        unit.in_backward = False
        if not self._order_settled:  # learning the order: reduce at the end of backward
            if unit not in self._completed:
                self._completed.append(unit)
            return
        for u in self._static:
            if u.index in self._reduced or (u.has_module and not u.ran):
                continue
            if u.trainable and not getattr(u, "complete", False):
                break
            self._reduce(u)

    def _reduce(self, unit: Unit) -> None:
        if unit.index in self._reduced:
            return
        self._reduced.add(unit.index)
        unit.complete = False
        if self.sync_grads and unit.trainable:
            # one reduce-scatter in flight: its buffer is freed before the next is issued
            self._advance()
            unit.reduce_grad(async_op=True)
            self._in_flight = unit
        expected = (u for u in self.units if u.trainable and (u.ran or not u.has_module))
        if not self._round_ended and all(u.index in self._reduced for u in expected):
            with torch.profiler.record_function("vescale::wait_reductions"):
                self.wait_reductions()
            self._round_ended = True

    def _reduce_rest(self) -> None:
        """Reduce the units this backward did not, in a fixed order (the same on every rank)."""
        for unit in self._static + [u for u in self._order if u not in self._static]:
            self._reduce(unit)
        self._round_ended = True

    def _advance(self) -> None:
        """Wait for the reduce-scatter in flight, start its all-reduce across replicas, and
        issue the deferred gather (whatever else it waits for)."""
        self._finish_scatter()
        if self._deferred is not None:
            unit, self._deferred = self._deferred, None
            self._computing = None
            unit.unshard(async_op=True)

    def _finish_scatter(self) -> None:
        if self._in_flight is not None:
            self._in_flight.advance_grad()
            self._in_flight = None

    def _flush_deferred(self) -> None:
        """Issue a deferred gather before any other: whether a poll already did depends on
        timing, so every gather issued from a hook must come after it."""
        if self._deferred is not None:
            self._advance()

    def _poll(self) -> None:
        """Without waiting: move on from a finished reduce-scatter, and issue the deferred
        gather once it waits for nothing."""
        if self._in_flight is not None and self._in_flight.scatter_finished():
            self._finish_scatter()
        if self._in_flight is None and self._deferred is not None and self._computing is None:
            self._advance()

    def _new_round(self) -> None:
        """First event after a backward ended (or a step): forget that backward's marks."""
        self._busy = True
        if self._round_ended:
            self._round_ended = False
            self._reduced.clear()
            for unit in self.units:
                unit.in_backward = False
                unit.forward_calls = 0
                unit.ran = False
                unit.complete = False
                if unit.arrivals is not None:
                    unit.arrivals.reset()

    def wait_reductions(self) -> None:
        """Wait for every reduction issued (and the all-reduces across replicas they start)."""
        self._advance()
        for unit in self.units:
            unit.wait_grad()

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
            if not unit.in_forward:
                unit.reshard()
        if self._static and not self._order_settled:
            self._settle_order()
        self._round_ended = True
        self._new_round()
        self._busy = False

    def unfinished_forward(self) -> str | None:
        """The names of the units whose forward started and has not finished, if any."""
        busy = [f"'{unit.name or unit.index}'" for unit in self.units if unit.in_forward]
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
        def hook(module, args, kwargs):
            if torch.is_grad_enabled() and unit.index in self._reduced and not unit.in_backward:
                self._round_ended = True  # a round its backward left unfinished (some unit got no gradient)
            if torch.is_grad_enabled():
                self._new_round()
            self._flush_deferred()
            if unit.in_backward:  # recomputation (activation checkpointing) inside backward
                unit.wait_unshard()
                return None
            unit.in_forward = True
            if unit not in self.forward_order:
                self.forward_order.append(unit)
            with torch.profiler.record_function(f"vescale::pre_forward[{unit.name}]"):
                unit.wait_unshard()
                following = self._next(self.forward_order, unit)
                if following is not None:
                    following.unshard(async_op=True)
            if unit.compute_dtype != unit.orig_dtype:  # param_dtype: floating inputs are cast to it
                cast = lambda t, to=unit.compute_dtype: t.to(to) if t.is_floating_point() else t  # noqa: E731
                args, kwargs = _map_tensors(cast, (args, kwargs))
            if not torch.is_grad_enabled():
                return args, kwargs
            if not any(t.requires_grad for t in _tensors((args, kwargs))):
                if unit.trainable and unit.arrivals is None:  # no post-backward trigger: watch its gradients
                    self._watch(unit)
                return args, kwargs
            unit.forward_calls += 1
            flat: list[torch.Tensor] = []
            _map_tensors(lambda t: flat.append(t) or t, (args, kwargs))
            wanted = [t for t in flat if t.requires_grad]
            out = _PostBackward.apply(lambda: self._post_backward(unit), *wanted)
            passed = iter((out,) if isinstance(out, torch.Tensor) else out)
            return _map_tensors(lambda t: next(passed) if t.requires_grad else t, (args, kwargs))

        return hook

    def _post_forward(self, unit: Unit, module: nn.Module):
        def hook(module_, args, output):
            if unit.in_backward:
                return None
            unit.in_forward = False
            if unit in self._post_forward_seen:
                self._post_forward_seen.remove(unit)
            self._post_forward_seen.append(unit)
            outputs = [t for t in _tensors(output) if t.requires_grad]
            backward_comes = torch.is_grad_enabled() and bool(outputs)
            if backward_comes:
                unit.ran = True
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
        unit.in_backward = True
        with torch.profiler.record_function(f"vescale::pre_backward[{unit.name}]"):
            self._flush_deferred()
            unit.wait_unshard()
            following = self._next(self.backward_order, unit) if self.backward_prefetch else None
            if following is not None:
                # gathered once the reduce-scatter in flight has freed its buffer and this
                # unit has accumulated half of its gradient elements (the start of its
                # backward holds the most activations; the next unit is needed at its end)
                self._deferred = following
                numel = sum(p.numel() for p in unit.params if p.requires_grad)
                awaited = min(numel, 1) if unit.encloses else numel // 2
                self._computing, self._grad_awaited = (unit, awaited) if awaited else (None, 0)
                self._poll()

    def _post_backward(self, unit: Unit) -> None:
        unit.forward_calls -= 1
        if unit.forward_calls > 0:
            return
        with torch.profiler.record_function(f"vescale::post_backward[{unit.name}]"):
            unit.in_backward = False
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
