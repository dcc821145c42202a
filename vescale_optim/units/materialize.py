"""Initialise a model built on the meta device one unit at a time.

Modules are visited in the outermost module's `modules()` order (the order a model
usually builds them). Each module holding parameters or buffers on the meta device is
initialised by `init(module)` — the user's `param_init_fn`, by default the module's own
`reset_parameters()` — parameters into their unit's unsharded buffer, buffers (persistent
or not) into tensors made on the units' device first (a buffer-only module, like a rotary embedding's
`inv_freq`, is visited too). Once every module of a unit is done, the rank keeps its
shard and frees the buffer, so the peak is about one unit (plus the outermost one, whose
modules come first and last). A parameter that a module shares with an earlier one (a
tied head) keeps the earlier module's values, as when the tie is made after building;
so does any parameter that was not on the meta device. Every rank draws from rank 0's
random state (sent on the group's device), so they agree, and the result equals the
model built normally under that state; the callers' own random states are left as they
were. A parameter or buffer that nothing can initialise is a `ValueError` naming it.

DTensor parameters (a model tensor-parallelised on the meta device, then handed to the
optimizer) are initialised as the unparallelised model would be, each rank keeping only its TP
shard. While `init(module)` runs, each of the module's DTensor parameters is stood in for by a
parameter of its global shape on the meta device (`shard_init`): the initialisation draws from
rank 0's random state as it would on the whole tensor, and its writes reach this rank's shard (its
DTensor's local tensor, a view of the unit's buffer). A random fill draws the whole tensor's
stream a chunk at a time into a small scratch buffer and keeps the part in the shard, so the
values and the random state after are bitwise those of the whole draw; constant fills, copies and
exactly rounded element-wise ops apply to the shard. So the values equal the model built normally
under the same seed with the TP plan applied after, whatever the TP size, and on the CPU a rank
holds its shard and a chunk (64 Ki elements, twice that at most), never a whole expert stack. DTensor's own
random ops would not give that: `nn.init` on a DTensor draws through DTensor's random-state
tracker, whose values depend on the TP layout (on a CPU mesh each shard even draws as if it were
the whole). What a shard cannot reproduce (a write through a view, `orthogonal_`'s QR, a
rejection that redraws, any op reading the values) stops the module's initialisation
(`NeedsWhole`): the random states are rewound (the default CPU and CUDA generators and every
generator handed to a torch function meanwhile) and the module is initialised again with whole
tensors, each DTensor parameter replaced by a plain parameter of its global shape on the units'
device and sliced after, at the price of one module's parameters whole. On CUDA a random fill
draws only the chunks that hold the shard, each at the Philox offset where torch's kernel
reaches it (`cuda_draw`: about 32 MiB of scratch); where its once-per-process calibration does
not prove that layout, the parameter is drawn whole (one at a time, freed at once), with a warning.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..shard.collectives import Comm, broadcast_
from .assign import module_order
from .shard_init import Attempt, GeneratorWatch, NeedsWhole, ShardTarget, stand_in
from .tensor_parallel import is_dtensor, local, tp_box, tp_slice
from .unit import Unit


def _rank0_rng_states(world: Comm, device: torch.device) -> list[torch.Tensor]:
    """The CPU (and `device`'s CUDA) random states of world rank 0, on every rank."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    for state in states:
        wire = state.to(world.device)  # NCCL sends device tensors only
        broadcast_(wire, 0, world, what="rank 0's random state for the meta-device initialisation")
        state.copy_(wire.cpu())
    return states


def needs_materializing(units: Sequence[Unit], modules: Sequence[nn.Module]) -> bool:
    """Whether a parameter of `units` or a buffer of `modules` is on the meta device."""
    return any(u.meta for u in units) or any(
        b.is_meta for _, m in module_order(modules) for b in m.buffers(recurse=False)
    )


def _reset(module: nn.Module) -> None:
    module.reset_parameters()


def _take_replaced_parameters(
    module: nn.Module, held: dict[str, nn.Parameter], prefix: str, how: str
) -> None:
    """Parameters the initialisation replaced (`self.weight = nn.Parameter(...)`) instead of
    writing into: the new values go into the parameter the optimizer holds (a view of its
    unit), which takes its place in the module again. One of another shape, or left on the
    meta device, is a `ValueError` naming it."""
    for name, new in list(module.named_parameters(recurse=False)):
        old = held.get(name)
        if old is None or new is old:
            continue
        if new.is_meta or tuple(new.shape) != tuple(old.shape):
            where = "the meta device" if new.is_meta else f"shape {tuple(new.shape)}"
            raise ValueError(
                f"{prefix}{name} was replaced by {how} with a new parameter on {where}, but the optimizer "
                f"holds it as shape {tuple(old.shape)}: write into the parameter instead (nn.init.*_, "
                "copy_) or give the new one the same shape"
            )
        old.copy_(new.detach())
        setattr(module, name, old)


def _whole_stand_ins(module: nn.Module, device: torch.device) -> dict[str, nn.Parameter]:
    """The module's DTensor parameters by name, each replaced in the module by a plain
    parameter of its global shape on `device` for the initialisation to fill whole."""
    dtensors = {n: p for n, p in module.named_parameters(recurse=False) if is_dtensor(p)}
    for name, p in dtensors.items():
        whole = torch.empty(p.shape, dtype=p.dtype, device=device)
        setattr(module, name, nn.Parameter(whole, requires_grad=p.requires_grad))
    return dtensors


def _shard_stand_ins(
    module: nn.Module, fresh: set[int], attempt: Attempt, at: str
) -> dict[str, nn.Parameter]:
    """The module's DTensor parameters by name, each replaced in the module by a stand-in of
    its global shape on the meta device whose writes reach this rank's TP shard (`shard_init`);
    one initialised before (shared with an earlier module) only draws what it would."""
    dtensors = {n: p for n, p in module.named_parameters(recurse=False) if is_dtensor(p)}
    for name, p in dtensors.items():
        whole, origin = tp_box(p)
        shard = local(p) if id(p) in fresh else None
        target = ShardTarget(f"{at}{name}", whole, p.dtype, origin, shard, attempt)
        setattr(module, name, stand_in(target, p.requires_grad))
    return dtensors


def _adopt_buffers(module: nn.Module, buffers: Sequence[str], device: torch.device) -> list:
    """The module's buffers `buffers` after its initialisation, as (name, tensor): one it
    replaced (`self.inv_freq = ...`, torchtitan's `freqs_cis`) is kept, moved to `device`."""
    found = []
    for name in buffers:
        t = getattr(module, name)
        if t is not None and not t.is_meta and t.device != device:
            t = t.to(device)
            setattr(module, name, t)
        if t is not None:
            found.append((name, t))
    return found


def materialize(
    units: Sequence[Unit],
    modules: Sequence[nn.Module],
    init: Callable[[nn.Module], None] | None = None,
    world: Comm | None = None,
) -> None:
    """Initialise every parameter of `units` (the units of `modules`) and every buffer of
    `modules` that is on the meta device, by `init(module)` (default: `reset_parameters()`),
    from the random state of rank 0 of `world` (default: the units' world; every rank of a
    dp x tp root mesh under tensor parallelism, so that TP peers draw alike)."""
    custom = init is not None
    init = init or _reset
    plan, remaining = _plan_visits(units, modules, custom)
    if not plan:
        return
    device = units[0].device
    states = _rank0_rng_states(world or units[0].dp, device)
    names = {id(m): name for name, m in module_order(modules)}
    done: set[int] = set()  # parameters initialised so far (by id)
    how = "param_init_fn" if custom else "reset_parameters()"
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        torch.set_rng_state(states[0])
        if device.type == "cuda":
            torch.cuda.set_rng_state(states[1], device)
        for module, mine, buffers in plan:
            for unit, _ in mine:
                unit.open_empty()
            fresh = {id(unit.params[i]) for unit, i in mine} - done
            _visit(module, fresh, buffers, device, init, f"{names[id(module)]}.", how)
            done |= fresh
            for unit, _ in mine:
                remaining[unit.index] -= 1
                if remaining[unit.index] == 0:
                    unit.adopt_full()
    _refuse_left_on_meta(modules, custom)


# a module to initialise: the (unit, index) of its parameters that wait for values, its meta buffers
_Visit = tuple[nn.Module, list[tuple[Unit, int]], list[str]]


def _plan_visits(
    units: Sequence[Unit], modules: Sequence[nn.Module], custom: bool
) -> tuple[list[_Visit], dict[int, int]]:
    """The modules to initialise, in order, and how many of them each unit (by index) waits
    for; a module that holds meta tensors but has nothing to initialise them is refused."""
    owner: dict[int, tuple[Unit, int]] = {}
    for unit in units:
        if unit.meta:
            for i, p in enumerate(unit.params):
                owner[id(p)] = (unit, i)
    plan: list[_Visit] = []
    remaining: dict[int, int] = {}
    for name, module in module_order(modules):
        mine = [owner[id(p)] for p in module.parameters(recurse=False) if id(p) in owner]
        buffers = [b for b, t in module.named_buffers(recurse=False) if t.is_meta]
        if not mine and not buffers:
            continue
        if not custom and not hasattr(module, "reset_parameters"):
            what = [n for n, p in module.named_parameters(recurse=False) if id(p) in owner] + buffers
            raise ValueError(
                f"{name}.{what[0]} is on the meta device, but its module ({type(module).__name__}) has no "
                "reset_parameters() to initialise it; give the module one, pass param_init_fn, or build it "
                "off the meta device"
            )
        plan.append((module, mine, buffers))
        for unit, _ in mine:
            remaining[unit.index] = remaining.get(unit.index, 0) + 1
    return plan, remaining


def _visit(
    module: nn.Module,
    fresh: set[int],
    buffers: Sequence[str],
    device: torch.device,
    init: Callable[[nn.Module], None],
    at: str,
    how: str,
) -> None:
    """`init(module)` for its `fresh` parameters (by id) and meta `buffers`: DTensor parameters
    on shards' stand-ins, or once more on whole tensors when a shard cannot reproduce it; the
    module's other parameters keep their values."""
    params = dict(module.named_parameters(recurse=False))
    kept = [(p, p.detach().clone()) for p in params.values() if id(p) not in fresh and not is_dtensor(p)]
    attempt = Attempt(device) if any(is_dtensor(p) for p in params.values()) else None
    try:
        skipped = _initialise(module, params, fresh, buffers, device, init, at, how, attempt)
    except NeedsWhole:  # rewound, then the same initialisation on whole tensors
        for p, value in kept:
            p.copy_(value)
        attempt.rewind()
        skipped = _initialise(module, params, fresh, buffers, device, init, at, how, None)
    for p, value in kept:
        p.copy_(value)
    if skipped:
        raise ValueError(
            f"{at}{skipped[0]} was not initialised by {how}: nothing wrote it (a tensor still "
            "holds NaN where its meta tensor got memory)"
        )


def _refuse_left_on_meta(modules: Sequence[nn.Module], custom: bool) -> None:
    """A `ValueError` naming the first parameter or buffer of `modules` still on the meta device."""
    for name, m in module_order(modules):
        for n, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
            if t.is_meta:
                how = "param_init_fn" if custom else "every module's reset_parameters()"
                raise ValueError(
                    f"{name}.{n} is still on the meta device after {how}: nothing initialised it"
                )


def _initialise(
    module: nn.Module,
    params: dict[str, nn.Parameter],
    fresh: set[int],
    buffers: Sequence[str],
    device: torch.device,
    init: Callable[[nn.Module], None],
    at: str,
    how: str,
    attempt: Attempt | None,
) -> list[str]:
    """Run `init(module)` once: its DTensor parameters stood in for by shards' stand-ins
    (`attempt`, which `NeedsWhole` ends) or by whole tensors (`attempt` None); the names of the
    parameters and buffers it left uninitialised."""
    for b in buffers:
        setattr(module, b, torch.empty_like(getattr(module, b), device=device))
    if attempt is None:
        stand_ins = _whole_stand_ins(module, device)
    else:
        stand_ins = _shard_stand_ins(module, fresh, attempt, at)
    # what the initialisation must write starts as NaN: one it skips is found below
    blank = [
        (n, getattr(module, n))
        for n, p in params.items()
        if id(p) in fresh and (attempt is None or n not in stand_ins)
    ]
    blank += [(b, getattr(module, b)) for b in buffers]
    for _, t in blank:
        if t.is_floating_point():
            t.fill_(float("nan"))
    held = dict(module.named_parameters(recurse=False))
    try:
        with GeneratorWatch(attempt) if attempt is not None else contextlib.nullcontext():
            init(module)
        _take_replaced_parameters(module, held, at, how)
    finally:  # the parameters the optimizer holds, whatever the initialisation replaced or raised
        now = dict(module.named_parameters(recurse=False))
        for n, p in params.items():
            if now.get(n) is not p:
                setattr(module, n, p)
    if attempt is not None and attempt.reason is not None:  # even if the initialisation caught it
        raise NeedsWhole(attempt.reason)
    unwritten = []
    for n, p in params.items():  # this rank's TP shard of a fresh one; the others untouched
        if n in stand_ins and id(p) in fresh:
            if attempt is None:
                local(p).copy_(tp_slice(p, held[n]))
            elif not held[n]._target.written:
                unwritten.append(n)
    blank = [(n, t) for n, t in blank if n not in buffers] + _adopt_buffers(module, buffers, device)
    return unwritten + [n for n, t in blank if t.is_floating_point() and bool(t.isnan().any())]
