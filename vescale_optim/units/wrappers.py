"""Who else averages the gradients: torch's `DistributedDataParallel` around the model.

DDP all-reduces every gradient itself, into `.grad` (or with `gradient_as_bucket_view`, `.grad`
*is* a view of its bucket), reading each `.grad` as autograd produces it and writing the mean
back when backward ends. A runtime under it must therefore neither reduce again nor leave in
`.grad` anything DDP could read or write (its `ReducedGrad` placeholders): it takes ZeRO-1's
part (`DDPGrads`): `.grad` stays DDP's, the step copies this rank's pieces of it into the
gradient shards, updates them and gathers the parameters; only the state is sharded.

The optimizer sees parameters, not the module, and is often built before DDP wraps the model
(HF Trainer, accelerate and Lightning wrap it for the user). The one point every rank passes, in
program order and before any gradient of DDP's exists, is DDP's forward: a global module forward
pre-hook (torch's public `register_module_forward_pre_hook`) sees it, and every runtime that
holds parameters of that DDP switches there, on every rank alike (no timing, no collective).
The hook is installed with the first runtime and stays: it is one `isinstance` check, which
`torch.compile` folds away where it inlines a module call (no graph break, and nothing it guards
on ever changes, so no recompilation); in eager mode it costs about a microsecond per module call
(measured on CPU: 151 calls took 492 us instead of 333). A model DDP wraps at any point is seen,
as long as no gradient of the runtime's own is pending then.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..shard.handle import group_size, initialized
from .tensor_parallel import local


class WrapperError(RuntimeError):
    """The optimizer cannot take the part a wrapper around the model leaves it (named, with
    the supported ways)."""


_runtimes: weakref.WeakSet = weakref.WeakSet()  # every live runtime, told of DDP's forwards
# runtime -> whether it was built with no process group to join, until its first step
_built_alone: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_hook = None  # the global forward pre-hook, installed with the first runtime


def _on_forward(module: nn.Module, args) -> None:
    if isinstance(module, DistributedDataParallel):  # (folded away where torch.compile inlines a call)
        _ddp_forward(module)


@torch.compiler.disable
def _ddp_forward(ddp: nn.Module) -> None:
    for runtime in list(_runtimes):
        if runtime.wrapper is None and any(id(p) in runtime.tracker.where for p in ddp.parameters()):
            runtime.under_ddp(ddp)


def watch(runtime: Any) -> None:
    """Call `runtime.under_ddp(ddp)` at every forward of a DDP holding some of its parameters."""
    global _hook
    _runtimes.add(runtime)
    _built_alone[runtime] = not runtime.dp.distributed
    if _hook is None:
        _hook = nn.modules.module.register_module_forward_pre_hook(_on_forward)


def unwatch(runtime: Any) -> None:
    """`runtime` no longer takes part (its optimizer was laid out anew)."""
    _runtimes.discard(runtime)
    _built_alone.pop(runtime, None)


def first_step(runtime: Any) -> None:
    """At `runtime`'s first step, a process group created after it (HF's `TrainingArguments` creates
    one) is named once, with the fix: it is not joined later."""
    if not _built_alone.pop(runtime, False):
        return
    if initialized() and group_size() > 1:
        how = "DDP averages the gradients, but " if runtime.wrapper is not None else ""
        warnings.warn(
            f"this optimizer was built before torch.distributed's process group existed, so it runs as one "
            f"process: {how}nothing is sharded over the {group_size()} ranks. Build it after "
            "init_process_group (with HF Trainer: after TrainingArguments, or pass "
            "optimizer_cls_and_kwargs=) to shard its state",
            stacklevel=5,
        )


class WrappedGrads:
    """A runtime's gradients when a wrapper reduced them (DDP's whole mean, or FSDP2's shards):
    `.grad` is the wrapper's, read at the step, and never one of the runtime's placeholders."""

    def __init__(self, units, tracker):
        self.units, self.tracker = list(units), tracker

    def take(self) -> None:
        """This rank's pieces of every `.grad` into the gradient shards (a copy, no communication);
        a parameter steps iff it has a gradient, as in torch."""
        for u in self.units:
            for i, has in enumerate(self.take_unit(u)):
                self.tracker.mark(u.params[i], has)
        self.tracker.reattach(grads=False)

    def take_unit(self, u) -> list[bool]:
        """Each parameter's `.grad` of unit `u`, the wrapper's mean, gives this rank's piece of the
        gradient shard (a copy; `.grad` stays the wrapper's). Per parameter, whether it has one."""
        shard, has = u.grads.own_shard(gaps_only=True), []
        for i, p in enumerate(u.params):
            g = local(p.grad)
            has.append(g is not None)
            start, stop = u.full.local_range(i)
            if stop <= start:
                continue
            if g is None:
                shard[start:stop].zero_()
            else:
                lo, hi = u.full.tensor_range(i)
                shard[start:stop].copy_(g.reshape(-1)[lo:hi])
        u.grads.has_values = True
        return has

    def grads(self) -> Iterator[torch.Tensor]:
        """The wrapper's gradients, local tensors (clipping scales them too, as torch's leaves them)."""
        return (local(p.grad) for u in self.units for p in u.params if p.grad is not None)


class DDPGrads(WrappedGrads):
    """A runtime's gradients under DDP (ZeRO-1): DDP's mean `.grad`, whole on every rank."""

    @classmethod
    def of(cls, runtime: Any, ddp: nn.Module) -> DDPGrads | None:
        """`runtime`'s gradients under `ddp` if `ddp` holds its parameters (None if it holds
        none); a `WrapperError` on every rank where that cannot work."""
        ours = {id(p): runtime.labels[id(p)] for u in runtime.units for p in u.params}
        theirs = {id(p) for p in ddp.parameters()}
        if not ours.keys() & theirs:
            return None
        problem = _ddp_problem(runtime.config.sharded, ours, theirs)
        if problem is None and any(u.grads.has_full or u.grads.has_values for u in runtime.units):
            problem = (
                "the model was wrapped in DistributedDataParallel after a backward of the bare model "
                "accumulated gradients into this optimizer; call opt.zero_grad() before the first DDP "
                "forward (or wrap the model before training)"
            )
        if problem is not None:
            raise WrapperError(problem)
        return cls(runtime.units, runtime.tracker)


def _ddp_problem(sharded: bool, ours: dict[int, str], theirs: set[int]) -> str | None:
    """Why a runtime over parameters `ours` (id -> label; `sharded`: with `shard_modules`) cannot
    run inside a DDP holding `theirs`, if it cannot."""
    if sharded:
        return (
            "the model is wrapped in DistributedDataParallel, which needs whole parameters on every rank, "
            "but this optimizer was built with shard_modules= (ZeRO-3: parameters are freed between uses); "
            "drop shard_modules= to run inside DDP (DDP averages the gradients, the optimizer shards its "
            "state: ZeRO-1), or drop the DDP wrapper and keep shard_modules= (the optimizer then averages "
            "the gradients itself)"
        )
    outside = [label for key, label in ours.items() if key not in theirs]
    if outside:
        return (
            f"parameters {outside[:3]} of this optimizer are not in the DistributedDataParallel module that "
            "holds its other parameters, so nothing would average their gradients; give the optimizer the "
            "DDP model's parameters only, or wrap the whole model in DDP"
        )
    return None
