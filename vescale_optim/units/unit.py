"""A communication unit: parameters planned into one flat buffer per role, gathered and
freed as one (FSDP2's parameter group).

Persistent, per rank: `shard`, the rank's `S` parameter elements (fp32 for bf16/fp16
parameters: it is their master copy), and `grad`, the rank's `S` averaged-gradient
elements in the same dtype. Transient: `full`, the unsharded parameters in the compute
dtype — every parameter's `.data` is a view of it — and `full_grad`, where autograd
accumulates while every `.grad` is a view of it. A sharded unit frees `full` between
uses; an unsharded one (no `shard_modules`) keeps it. `full_grad` lives from the first
gradient of a backward to the reduce-scatter that empties it into `grad`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import torch

from ..shard.buffer import FlatBuffer
from ..shard.collectives import Comm, Handle, all_gather_into_, all_reduce_, broadcast_, reduce_scatter_into_
from ..shard.layout import Layout
from .reduced_grad import ReducedGrad

LOW_PRECISION = (torch.bfloat16, torch.float16)


def ring(world: int, shard_bytes: int, passes: int = 1) -> int:
    """Bytes a rank sends (and receives) to gather or reduce-scatter `shard_bytes` per rank
    over `world` ranks (an all-reduce of `world * shard_bytes` is two passes)."""
    return passes * (world - 1) * shard_bytes


class _Reduction(Handle):
    """A gradient reduction in two stages: `first` (the reduce-scatter), then the handle
    `second()` issues (the all-reduce across replicas, if any). `advance()` waits for the
    first stage and issues the second; `wait()` finishes both."""

    def __init__(self, first: Handle, second: Callable[[], Handle] | None):
        super().__init__()
        self._first, self._start, self._second = first, second, None

    def first_finished(self) -> bool:
        return self._second is not None or self._first.is_completed()

    @property
    def second_issued(self) -> bool:
        return self._second is not None

    def advance(self) -> None:
        if self._second is None:
            self._first.wait()
            self._second = self._start() if self._start is not None else Handle()

    def wait(self) -> None:
        self.advance()
        self._second.wait()


class State(enum.Enum):
    RESHARDED = "resharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


def shard_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """Where a parameter of `dtype` keeps its shard: fp32 for low precision (the master)."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


class Unit:
    """Parameters `params` of one module (or one bucket), planned by `layout`.

    `sharded=False` keeps the unsharded parameters (ZeRO-2-like): `gather_after_step()`
    refreshes them, and nothing is freed. `param_dtype` is the dtype of the unsharded
    parameters (compute and all-gather); `reduce_dtype` that of the reduce-scatter.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        layout: Layout,
        comm: Comm,
        *,
        index: int = 0,
        name: str = "",
        sharded: bool = True,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        sync_params: bool = True,
        replicate: Comm | None = None,
        world: Comm | None = None,
        labels: Sequence[str] | None = None,
    ):
        if not params:
            raise ValueError(f"unit {name or index} has no parameters")
        self.params, self.names, self.layout, self.comm = list(params), list(names), layout, comm
        # how errors name each parameter
        self.labels = list(labels) if labels is not None else [f"'{n}' (shape {tuple(p.shape)})"
                                                               for n, p in zip(names, params)]  # fmt: skip
        self.replicate = replicate or Comm.alone()  # the same shard in other replicas: gradients are averaged
        self.world = world or comm  # every rank: parameters start from world rank 0's
        self.defer_replicas = False  # accumulate the replicas' gradients unsynced (`grad_unsynced`)
        self.grad_unsynced: torch.Tensor | None = None
        self.index, self.name, self.sharded = index, name, sharded
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            detail = ", ".join(f"{n}: {p.dtype}" for n, p in zip(names, params))
            raise ValueError(
                f"unit {name or index} mixes parameter dtypes ({detail}); a unit gathers one dtype "
                "(give it param_dtype, or put the parameters in different units)"
            )
        self.orig_dtype = params[0].dtype
        meta = self.meta = any(p.is_meta for p in params)
        if device is None:
            device = comm.device if meta else params[0].device
        self.device = torch.device(device)
        self.compute_dtype = param_dtype or self.orig_dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        self.shard_dtype = shard_dtype_for(self.orig_dtype)
        shapes = [tuple(p.shape) for p in params]
        rank, s = comm.rank, layout.shard_size
        self.full = FlatBuffer(layout, shapes, rank, self.compute_dtype, self.device)
        self.full_grad = self._new_grad_buffer()
        if meta:
            self.shard = torch.zeros(s, dtype=self.shard_dtype, device=self.device)
        else:
            self.shard = self._initial_shard(sync_params)
            if not sharded:  # keep whole parameters: rank 0's (gathered) or this rank's own
                if sync_params:
                    all_gather_into_(self.full.data, self.shard, comm, what=f"unit {self.name}'s parameters")
                else:
                    for i, p in enumerate(params):
                        self.full.view(i).copy_(p.detach())
        if not sharded and self.shard_dtype == self.compute_dtype:
            self.shard = self.full.local  # the update writes the kept parameters in place
        self._grad = torch.zeros(s, dtype=self.shard_dtype, device=self.device)
        self.grad_has_values = False  # `grad` holds reductions not yet consumed
        self.state = State.GATHERED
        self._gather: Handle | None = None
        with torch.no_grad():
            for i, p in enumerate(params):
                grad = p.grad
                if p.is_meta:  # a real parameter in its place (the same object for everyone holding it)
                    real = torch.nn.Parameter(torch.empty(0, dtype=self.compute_dtype, device=self.device),
                                              requires_grad=p.requires_grad)  # fmt: skip
                    real.data = self.full.view(i)  # its own version counter, as for `.data` below
                    torch.utils.swap_tensors(p, real)
                else:
                    p.data = self.full.view(i)
                p.grad = None
                if grad is not None:
                    self.grad_view(i).copy_(grad)
                    p.grad = self.full_grad.view(i)
        self.views = [self.full.view(i) for i in range(len(params))]  # each `.data` while gathered
        nan = torch.full((), float("nan"), dtype=self.compute_dtype, device=self.device)
        self.stand_ins = [nan.expand(p.shape) for p in params]  # each `.data` between uses
        self._reduced = [ReducedGrad._of(self, i, p.shape, p.dtype, p.device) for i, p in enumerate(params)]
        self._reduction: _Reduction | None = None  # the reduction writing `grad`, until waited
        self.scattering: torch.Tensor | None = None  # the gradients last reduce-scattered (freed once done)
        self.sent_bytes = 0  # by this unit's gradient reductions so far (as many received)
        if sharded:
            self.reshard()

    # --- construction ----------------------------------------------------------------

    def _initial_shard(self, sync_params: bool) -> torch.Tensor:
        """This rank's shard of the parameters' current values (rank 0's with `sync_params`)."""
        s, rank = self.layout.shard_size, self.comm.rank
        if sync_params and self.world.active:
            staged = torch.zeros(self.layout.numel, dtype=self.shard_dtype, device=self.device)
            for i, p in enumerate(self.params):
                start = self.layout.offsets[i]
                staged[start : start + p.numel()].copy_(p.detach().reshape(-1))
            broadcast_(staged, 0, self.world, what=f"unit {self.name}'s initial parameters")
            shard = staged[rank * s : (rank + 1) * s].clone()
            # a finished broadcast's work can outlive wait() and keep `staged` (seen on gloo): free it now
            staged.untyped_storage().resize_(0)
            return shard
        self.shard = torch.zeros(s, dtype=self.shard_dtype, device=self.device)
        for i, p in enumerate(self.params):
            self.write_piece(i, p.detach())
        return self.shard

    # --- parameters ------------------------------------------------------------------

    def unshard(self, async_op: bool = True) -> None:
        """Start gathering the parameters (no-op when gathered or on the way)."""
        if self.state is not State.RESHARDED:
            return
        with torch.profiler.record_function(f"vescale::unshard[{self.name}]"):
            self.full.allocate()
            self._gather = all_gather_into_(self.full.data, self.shard, self.comm, async_op=True,
                                            what=f"unit {self.name}'s parameters")  # fmt: skip
            self.state = State.GATHERING
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        """Block until the parameters are gathered (gathering them first if needed)."""
        if self.state is State.RESHARDED:
            self.unshard(async_op=True)
        if self.state is State.GATHERING:
            with torch.profiler.record_function(f"vescale::wait_unshard[{self.name}]"):
                self._gather.wait()
            self._gather = None
            self._show()

    def open_empty(self) -> None:
        """Give the unsharded parameters memory without gathering (for whoever fills them)."""
        if self.state is State.RESHARDED:
            self.full.allocate()
            self._show()

    def reshard(self) -> None:
        """Free the unsharded parameters (sharded units only)."""
        if not self.sharded or self.state is State.RESHARDED:
            return
        if self.state is State.GATHERING:
            self._gather.wait()
            self._gather = None
        with torch.profiler.record_function(f"vescale::reshard[{self.name}]"):
            self._hide()
            self.full.free()

    def _show(self) -> None:
        """Parameters are views of the (gathered) unsharded buffer."""
        for i, (p, view) in enumerate(zip(self.params, self.views)):
            problem = self.placement_problem(i)
            if problem is not None:
                raise RuntimeError(problem)
            p.data = view
        self.state = State.GATHERED

    def _hide(self) -> None:
        """Between uses a parameter holds a stand-in, not a view of freed memory: reading it
        gives NaN (never a crash), writing it fails, and `model.double()`/`.to()` produce a
        parameter the next step refuses by name."""
        for p, stand_in in zip(self.params, self.stand_ins):
            p.data = stand_in
        self.state = State.RESHARDED

    def holds_stand_in(self, i: int) -> bool:
        return self.params[i].data_ptr() == self.stand_ins[i].data_ptr()

    def placement_problem(self, i: int) -> str | None:
        """Why parameter `i` no longer fits its unit (moved or cast after construction), if it does not."""
        p, shape = self.params[i], self.full.shapes[i]
        if p.dtype == self.compute_dtype and p.device == self.device and tuple(p.shape) == shape:
            return None
        return (
            f"parameter {self.labels[i]} is now {p.dtype} on {p.device}, shape {tuple(p.shape)}, but the "
            f"optimizer holds it as {self.compute_dtype} on {self.device}: it was moved or cast after the "
            "optimizer was built (model.double(), .half(), .to(...)); move the model first, then build "
            "the optimizer"
        )

    def take_data(self, i: int) -> None:
        """A tensor assigned to parameter `i`'s `.data` (same dtype, device and shape) becomes
        its value: this rank's piece goes into the shard, and `.data` is the unit's again."""
        p = self.params[i]
        if p.data_ptr() == self.views[i].data_ptr() or self.holds_stand_in(i):
            return
        self.write_param(i, p.detach())
        p.data = self.stand_ins[i] if self.state is State.RESHARDED else self.views[i]

    def gather_after_step(self, async_op: bool = False) -> Handle | None:
        """Unsharded units: refresh the kept parameters from every rank's updated shard."""
        if self.sharded:
            return None
        with torch.profiler.record_function(f"vescale::gather_params[{self.name}]"):
            return all_gather_into_(self.full.data, self.shard, self.comm, async_op=async_op,
                                    what=f"unit {self.name}'s parameters")  # fmt: skip

    def write_piece(self, i: int, value: torch.Tensor) -> None:
        """Write this rank's piece of `value` (parameter `i`'s full tensor) into the shard."""
        start, stop = self.full.local_range(i)
        if stop > start:
            lo, hi = self.full.tensor_range(i)
            self.shard[start:stop].copy_(value.reshape(-1)[lo:hi])

    def write_param(self, i: int, value: torch.Tensor) -> None:
        """Set parameter `i` to `value` (its full tensor): this rank's piece goes into the
        shard, and into the kept unsharded parameters of an unsharded unit."""
        self.write_piece(i, value)
        if not self.sharded:
            self.full.view(i).copy_(value)

    def refresh_shard(self) -> None:
        """Unsharded units with a separate shard (an fp32 master, or `param_dtype`): where a
        kept parameter no longer equals its shard rounded to the parameter's dtype, it was
        written from outside (`model.load_state_dict`, `p.copy_`): take the parameter's value."""
        if self.sharded or self.shard.data_ptr() == self.full.local.data_ptr():
            return
        local = self.full.local
        stale = self.shard.to(local.dtype) != local
        if bool(stale.any()):
            self.shard[stale] = local[stale].to(self.shard.dtype)

    # --- gradients -------------------------------------------------------------------

    def _new_grad_buffer(self) -> FlatBuffer:
        shapes = [tuple(p.shape) for p in self.params]
        rank = self.comm.rank
        return FlatBuffer(self.layout, shapes, rank, self.compute_dtype, self.device, allocate=False)

    @property
    def has_full_grad(self) -> bool:
        return self.full_grad.allocated and self.full_grad.data.numel() > 0

    def grad_view(self, i: int) -> torch.Tensor:
        """Parameter `i`'s view of the unsharded gradient buffer (allocated, zeroed, on first use)."""
        if not self.has_full_grad:
            self.full_grad.allocate(zero=True)
        return self.full_grad.view(i)

    def is_live_grad(self, i: int) -> bool:
        """Whether parameter `i`'s `.grad` is its view of the unreduced gradient buffer."""
        g = self.params[i].grad
        return g is not None and self.has_full_grad and g.data_ptr() == self.full_grad.view(i).data_ptr()

    def drop_grad(self, i: int) -> None:
        """Forget what parameter `i` accumulated: its part of the unreduced buffer and this
        rank's piece of `grad`."""
        self.wait_grad()
        if self.has_full_grad:
            self.full_grad.view(i).zero_()
        start, stop = self.full.local_range(i)
        if stop > start:
            if self.grad_bytes:
                self._grad[start:stop].zero_()
            if self.grad_unsynced is not None:
                self.grad_unsynced[start:stop].zero_()

    def take_grad(self, i: int, grad: torch.Tensor) -> None:
        """A gradient set by hand replaces parameter `i`'s: it goes into the unreduced buffer
        and what `grad` accumulated for it so far is dropped."""
        self.drop_grad(i)
        self.grad_view(i).copy_(grad)
        self.params[i].grad = self.full_grad.view(i)

    def reduce_grad(self, async_op: bool = True) -> Handle:
        """Average the unsharded gradients over ranks into `grad` (added to what it holds
        since the last `clear_grad()`). Each `.grad` that was a view of the buffer becomes a
        `ReducedGrad` at once: a later backward accumulates into a new buffer while this one
        is reduced and freed.

        With replicas this is two stages, a reduce-scatter in the shard group and then an
        all-reduce of its result across replicas: `advance_grad()` waits for the first and
        issues the second, which `wait_grad()` finishes."""
        self.wait_grad()  # one reduction of a unit at a time (already done in a normal backward)
        if not self.has_full_grad:
            self.full_grad.allocate(zero=True)
        for i, p in enumerate(self.params):
            if self.is_live_grad(i):
                p.grad = self._reduced[i]
        buf, self.full_grad = self.full_grad, self._new_grad_buffer()
        data = buf.data
        with torch.profiler.record_function(f"vescale::reduce_scatter[{self.name}]"):
            if self.reduce_dtype != data.dtype:
                data = data.to(self.reduce_dtype)
                buf.free()  # the cast is what is reduced
            self.scattering = data
            self.sent_bytes += ring(self.comm.world_size, self._grad.numel() * data.element_size())
            what = f"unit {self.name}'s gradients"
            if not self.replicate.active:
                add = self.grad_has_values
                scatter = reduce_scatter_into_(data, self.grad, self.comm, "mean", add, True, what)
                self.grad_has_values = True
                across = None
            else:
                part = torch.empty_like(self._grad)
                scatter = reduce_scatter_into_(data, part, self.comm, "mean", async_op=True, what=what)
                defer = self.defer_replicas
                across = lambda: self._over_replicas(part, defer)  # noqa: E731
        self._reduction = _Reduction(scatter.then(lambda: data.untyped_storage().resize_(0)), across)
        if not async_op:
            self.wait_grad()
        return self._reduction

    def _over_replicas(self, part: torch.Tensor, defer: bool) -> Handle:
        """Start averaging this shard group's reduction `part` over the replicas into `grad`
        (or keep it, unsynced, when `defer`)."""
        if self.grad_unsynced is not None:
            part.add_(self.grad_unsynced)
            self.grad_unsynced = None
        if defer:
            self.grad_unsynced = part
            return Handle()
        return self._all_reduce_replicas(part)

    def _all_reduce_replicas(self, part: torch.Tensor) -> Handle:
        self.sent_bytes += ring(self.replicate.world_size, part.numel() * part.element_size(), 2)
        with torch.profiler.record_function(f"vescale::all_reduce_replicas[{self.name}]"):
            handle = all_reduce_(part, self.replicate, "mean", async_op=True,
                                 what=f"unit {self.name}'s gradients over replicas")  # fmt: skip

        def add() -> None:
            if self.grad_has_values:
                self.grad.add_(part)
            else:
                self.grad.copy_(part)
            self.grad_has_values = True

        return handle.then(add)

    def keep_unsynced(self, keep: bool) -> None:
        """Whether reductions from now on keep this shard group's result unsynced across
        replicas (summed in `grad_unsynced`) instead of all-reducing it."""
        self.defer_replicas = keep

    def sync_replicas(self) -> Handle:
        """Start averaging what was kept unsynced over the replicas into `grad` (collective
        over the replicas when there is something; every replica has or has not)."""
        self.wait_grad()
        if self.grad_unsynced is None:
            return Handle()
        part, self.grad_unsynced = self.grad_unsynced, None
        self._reduction = _Reduction(Handle(), lambda: self._all_reduce_replicas(part))
        return self._reduction

    def advance_grad(self) -> None:
        """Wait for the reduce-scatter in flight and issue its all-reduce across replicas
        (without waiting for it)."""
        if self._reduction is not None:
            self._reduction.advance()

    def scatter_finished(self) -> bool:
        """Whether the reduce-scatter of the reduction in flight is done (never blocks)."""
        return self._reduction is None or self._reduction.first_finished()

    @property
    def reducing_over_replicas(self) -> bool:
        """Whether an all-reduce of this unit's gradients across replicas is issued and not yet waited."""
        return self._reduction is not None and self._reduction.second_issued

    def wait_grad(self) -> None:
        """Block until `grad` holds every reduction issued so far."""
        if self._reduction is not None:
            reduction, self._reduction = self._reduction, None
            reduction.wait()

    @property
    def grad(self) -> torch.Tensor:
        """This rank's averaged-gradient shard. `clear_grad()` frees its memory, as torch's
        `zero_grad(set_to_none=True)` frees gradients; it comes back zero when next used."""
        storage = self._grad.untyped_storage()
        if storage.nbytes() == 0 and self._grad.numel():
            storage.resize_(self._grad.numel() * self._grad.element_size())
            self._grad.zero_()
        return self._grad

    @property
    def grad_bytes(self) -> int:
        """Bytes the gradient shard holds now (0 while freed)."""
        return self._grad.untyped_storage().nbytes()

    def clear_grad(self, set_to_none: bool = True) -> None:
        """Forget accumulated gradients: free the shard (`set_to_none`) or zero it, drop an
        unreduced buffer; every `.grad` becomes None, or with `set_to_none=False` a
        `ReducedGrad` (now zero) where there was a gradient."""
        self.wait_grad()
        if set_to_none:
            self._grad.untyped_storage().resize_(0)
        elif self.grad_bytes:
            self._grad.zero_()
        self.grad_has_values = False
        self.grad_unsynced = None
        if self.has_full_grad:
            self.full_grad.free()
        for i, p in enumerate(self.params):
            if set_to_none or p.grad is None:
                p.grad = None
            elif p.requires_grad:
                p.grad = self._reduced[i]

    # --- accounting ------------------------------------------------------------------

    def transient_bytes(self) -> int:
        """Unsharded buffers alive now (sharded parameters while gathered, gradients, and
        the gradients being reduce-scattered)."""
        scattering = self.scattering.untyped_storage().nbytes() if self.scattering is not None else 0
        return (self.full.nbytes if self.sharded else 0) + self.full_grad.nbytes + scattering

    def __repr__(self) -> str:
        return (
            f"Unit({self.name or self.index}: {len(self.params)} params, S={self.layout.shard_size}, "
            f"{self.state.value})"
        )
