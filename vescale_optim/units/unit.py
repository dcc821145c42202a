"""A communication unit: parameters planned into one flat buffer per role, gathered and
freed as one (FSDP2's parameter group).

Persistent, per rank: `shard`, the rank's `S` parameter elements (fp32 for bf16/fp16
parameters: it is their master copy). Transient: `full`, the unsharded parameters in the
compute dtype — every parameter's `.data` (a DTensor's local tensor) is a view of it while the
unit is gathered. A sharded unit frees `full` between uses; an unsharded one (no `shard_modules`)
keeps it. The gradients are the unit's `grads` (`grad_buffers.GradBuffers`).

A unit declares where its parameters are (`state`: `RESHARDED`, `GATHERING` or
`GATHERED`), and only its own methods change that: `unshard` / `wait_unshard` gather,
`reshard` frees, `open_empty` gives memory to be filled, `regather` refreshes gathered
parameters after the shard was rewritten, `adopt_full` keeps what was written into
`full` as the shard.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.autograd.graph import increment_version

from ..shard.buffer import FlatBuffer
from ..shard.collectives import Comm, Handle
from ..shard.layout import Layout
from . import stand_in
from .config import ShardingConfig
from .fsdp_shards import copy_in, copy_out
from .grad_buffers import GradBuffers
from .streams import streams_for
from .tensor_parallel import is_dtensor, local, local_shape, set_data
from .unit_values import gather_into_full, take_changed, take_initial_values

LOW_PRECISION = (torch.bfloat16, torch.float16)


class State(enum.Enum):
    RESHARDED = "resharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


def shard_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """Where a parameter of `dtype` keeps its shard: fp32 for low precision (the master)."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


def _device(device: torch.device | str) -> torch.device:
    """`device` as tensors report theirs, so that the two compare equal: `cuda` is the
    current CUDA device (`cuda:0`), and `cpu:0` is `cpu`."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        return torch.device("cpu")
    return device


@dataclass(frozen=True)
class UnitComms:
    """The groups a unit talks over: `shard`, its layout's ranks (gathers, reduce-scatters);
    `replicate`, the same shard in other replicas (gradients are averaged over it; None: alone);
    `dp`, every rank of the mesh (parameters start from its rank 0's; None: `shard`); `reduce`,
    the group over `shard`'s ranks the gradient reductions run on (`streams.reduction_comm`;
    None: `shard`)."""

    shard: Comm
    replicate: Comm | None = None
    dp: Comm | None = None
    reduce: Comm | None = None


class Unit:
    """Parameters `params` of one module (or one bucket), planned by `layout`, over `comms`.

    `config` is the runtime's `ShardingConfig`: not sharded (no `shard_modules`) keeps the
    unsharded parameters (ZeRO-2-like), `gather_after_step()` refreshes them and nothing is freed;
    `param_dtype` is the dtype of the unsharded parameters (compute and all-gather), `reduce_dtype`
    that of the reduce-scatter; `gather_bits` / `reduce_bits` the wire codecs. What is the unit's
    own: its `index` and `name`, `labels` naming its parameters in errors, and `external`: FSDP2
    owns the parameters' memory (`fsdp_shards`)."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        layout: Layout,
        comms: UnitComms,
        config: ShardingConfig,
        *,
        index: int = 0,
        name: str = "",
        labels: Sequence[str] | None = None,
        external: bool = False,
    ):
        if not params:
            raise ValueError(f"unit {name or index} has no parameters")
        self.params, self.names, self.layout, self.config = list(params), list(names), layout, config
        self.labels = list(labels or (f"'{n}' (shape {tuple(p.shape)})" for n, p in zip(names, params)))
        self.comm = comms.shard
        self.replicate = comms.replicate or Comm.alone()  # the same shard in other replicas: averaged
        self.reduce_comm = comms.reduce or comms.shard  # the reductions' own communicator (`streams`)
        self.dp = comms.dp or comms.shard  # every rank of the mesh: parameters start from its rank 0's
        self.index, self.name, self.sharded, self.external = index, name, config.sharded, external
        # the wire codecs of the all-gathers and the gradient reductions (None: full precision)
        self.gather_codec = config.wire_codec(config.gather_bits)
        self.reduce_codec = config.wire_codec(config.reduce_bits)
        self.gathered_bytes = 0  # sent by this unit's parameter all-gathers so far (as many received)
        self._take_dtypes()
        self.full = FlatBuffer(
            layout,
            [local_shape(p) for p in params],
            self.comm.rank,
            self.compute_dtype,
            self.device,
            allocate=not external,
        )
        size = 0 if external else layout.shard_size  # external: FSDP2's local tensor, or a copy (`copy_in`)
        self.shard = torch.zeros(size, dtype=self.shard_dtype, device=self.device)
        self.grads, self.state, self.borrowed = GradBuffers(self), State.GATHERED, False
        self.dtensors = [is_dtensor(p) for p in params]
        if external:  # `.grad` stays FSDP2's, so no placeholders
            return copy_in(self)
        if not self._meta:
            take_initial_values(self, config.sync_params)
        if not self.sharded and self.shard_dtype == self.compute_dtype and self.gather_codec is None:
            self.shard = self.full.local  # the update writes the kept parameters in place
        self._gather: Handle | None = None
        self._held = 0  # `hold()`: kept gathered (inside `opt.gathered()`) until `release()`
        self._adopt_params()
        if self.sharded:
            self.reshard()

    def _take_dtypes(self) -> None:
        """The dtypes (one for all parameters: refused otherwise, naming them) and the device."""
        params, dtypes = self.params, {p.dtype for p in self.params}
        if len(dtypes) > 1:
            detail = ", ".join(f"{n}: {p.dtype}" for n, p in zip(self.names, params))
            raise ValueError(
                f"unit {self.name or self.index} mixes parameter dtypes ({detail}); a unit gathers one dtype "
                "(give it param_dtype, or put the parameters in different units)"
            )
        self.orig_dtype = params[0].dtype
        self._meta = any(p.is_meta for p in params)
        device = self.config.device
        if device is None:
            device = self.comm.device if self._meta else params[0].device
        self.device = _device(device)
        self.streams = streams_for(self.device)
        self.compute_dtype = self.config.param_dtype or self.orig_dtype
        self.reduce_dtype = self.config.reduce_dtype or self.compute_dtype
        self.shard_dtype = shard_dtype_for(self.orig_dtype)

    def _adopt_params(self) -> None:
        """Every parameter's values become a view of `full` (its `.grad` taken into the gradient
        buffer first), its `.grad` the unit's placeholder once reduced; a sharded unit's become
        stand-ins between uses (`stand_in`)."""
        with torch.no_grad():
            for i, p in enumerate(self.params):
                grad = local(p.grad)
                if p.is_meta and not is_dtensor(p):  # a real parameter in its place (the same object)
                    real = torch.nn.Parameter(
                        torch.empty(0, dtype=self.compute_dtype, device=self.device),
                        requires_grad=p.requires_grad,
                    )
                    real.data = self.full.view(i)  # its own version counter, as for `.data` below
                    torch.utils.swap_tensors(p, real)
                else:
                    set_data(p, self.full.view(i))  # a DTensor's local tensor (meta too): `tensor_parallel`
                p.grad = None
                if grad is not None:
                    self.grads.take(i, grad)
        self.grads.make_placeholders()
        self.views = [self.full.view(i) for i in range(len(self.params))]  # each `.data` while gathered
        # a DTensor's local tensor stays a view of `full` for good: `free()` and `allocate()` keep
        # the storage object, so it is the gathered buffer whenever the unit is gathered
        if self.sharded:
            for p, label in zip(self.params, self.labels):
                stand_in.register(p, label)
        # each `.data` between uses: a scalar of its own, never read (see `stand_in`)
        scalar = lambda: torch.full((), float("nan"), dtype=self.compute_dtype, device=self.device)  # noqa: E731
        self.stand_ins = [scalar().expand(local_shape(p)) for p in self.params]

    @property
    def meta(self) -> bool:
        """Whether the parameters still wait to be initialised (built on the meta device)."""
        return self._meta

    # --- parameters ------------------------------------------------------------------

    def unshard(self, async_op: bool = True) -> None:
        """Start gathering the parameters (no-op when gathered or on the way): the buffer is
        allocated on the compute stream, the all-gather issued on the gather stream."""
        if self.state is not State.RESHARDED:
            return
        with torch.profiler.record_function(f"vescale::unshard[{self.name}]"):
            self.full.allocate()
            self._gather = gather_into_full(self, async_op=True)
            self.state = State.GATHERING
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        """Until the parameters are gathered (gathering them first if needed); on CUDA the
        compute stream waits, the host does not."""
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
        """Free the unsharded parameters (sharded units only), after the gather in flight."""
        if not self.sharded or self.state is State.RESHARDED or self._held:
            return
        if self.state is State.GATHERING:
            self._gather.wait()
            self._gather = None
        with torch.profiler.record_function(f"vescale::reshard[{self.name}]"):
            self._hide()
            self.full.free()

    def regather(self) -> None:
        """The shard was rewritten while the unit is gathered (a model state dict loaded):
        gather the parameters again (collective for gathered units; nothing otherwise)."""
        if self.state is State.RESHARDED:
            return
        self.wait_unshard()
        gather_into_full(self, async_op=False)

    def adopt_full(self) -> None:
        """`full` holds the parameters' values (written by their modules' initialisation): keep
        this rank's slice as the shard; a sharded unit frees `full`, an unsharded one gathers
        the shards back into it (the ranks' slices came from one random state)."""
        self.shard.copy_(self.full.local)
        self._meta = False
        if self.sharded:
            self.reshard()
        else:
            self.gather_after_step()

    def _show(self) -> None:
        """Parameters are views of the (gathered) unsharded buffer (profiled as
        `vescale::stand_ins[unit]`, with `_hide`: what the stand-ins cost a step)."""
        with torch.profiler.record_function(f"vescale::stand_ins[{self.name}]"):
            for i, (p, view) in enumerate(zip(self.params, self.views)):
                stand_in.show(p)
                problem = self.placement_problem(i)
                if problem is not None:
                    raise RuntimeError(problem)
                if not self.dtensors[i]:
                    p.data = view
        self.state = State.GATHERED

    def _hide(self) -> None:
        """Between uses a parameter is its stand-in (`stand_in`), not a view of freed memory:
        its metadata reads as before, and reading or writing its values raises, naming it."""
        with torch.profiler.record_function(f"vescale::stand_ins[{self.name}]"):
            for p, scalar, dtensor in zip(self.params, self.stand_ins, self.dtensors):
                if not dtensor:  # (a DTensor's local tensor is a view of the freed buffer)
                    with stand_in.revealed(p):
                        p.data = scalar
                stand_in.hide(p)
        self.state = State.RESHARDED

    def holds_stand_in(self, i: int) -> bool:
        if self.dtensors[i]:
            return self.state is State.RESHARDED
        return self.params[i].data_ptr() == self.stand_ins[i].data_ptr()

    def placement_problem(self, i: int) -> str | None:
        """Why parameter `i` no longer fits its unit (moved or cast after construction), if it does not."""
        p, shape = self.params[i], self.full.shapes[i]
        here = local_shape(p) if self.dtensors[i] else p.shape  # (per parameter per step: the flag is known)
        if p.dtype == self.compute_dtype and p.device == self.device and here == shape:
            return None
        return (
            f"parameter {self.labels[i]} is now {p.dtype} on {p.device}, shape {tuple(here)}, but the "
            f"optimizer holds it as {self.compute_dtype} on {self.device}: it was moved or cast after the "
            "optimizer was built (model.double(), .half(), .to(...)); move the model first, then build "
            "the optimizer"
        )

    def take_data(self, i: int) -> None:
        """A tensor assigned to parameter `i`'s `.data` (same dtype, device and shape) becomes
        its value: this rank's piece goes into the shard, and `.data` is the unit's again."""
        p = self.params[i]
        if self.external or self.dtensors[i]:  # `.data =` does not re-point a DTensor's local tensor
            return
        if (ptr := p.data_ptr()) == self.views[i].data_ptr() or ptr == self.stand_ins[i].data_ptr():
            return
        with stand_in.revealed(p):
            self.write_param(i, local(p).detach())
            set_data(p, self.stand_ins[i] if self.state is State.RESHARDED else self.views[i])

    def gather_after_step(self, async_op: bool = False) -> Handle | None:
        """Unsharded units: refresh the kept parameters from every rank's updated shard (an external
        unit's: copied into the local tensors, the shard freed unless it is a master)."""
        if self.sharded:
            return None
        if self.external:
            return copy_out(self)
        with torch.profiler.record_function(f"vescale::gather_params[{self.name}]"):
            return gather_into_full(self, async_op)

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

    def hold(self) -> None:
        """Keep the (gathered) parameters until `release()`: `reshard()` does nothing meanwhile."""
        self._held += 1

    def release(self) -> None:
        self._held -= 1

    def write_back(self) -> None:
        """Gathered parameters were written in place (`opt.gathered()`): a tensor assigned to
        a parameter's `.data` is copied into its view, then what changed in this rank's
        slice goes into the shard (`refresh_shard`'s comparison, for sharded units too)."""
        for i, (p, view) in enumerate(zip(self.params, self.views)):
            if local(p).data_ptr() != view.data_ptr():
                problem = self.placement_problem(i)
                if problem is not None:
                    raise RuntimeError(problem)
                view.copy_(local(p).detach())
                set_data(p, view)
        if self.shard.data_ptr() != self.full.local.data_ptr():
            take_changed(self)

    def bump_versions(self) -> None:
        """The parameters' values changed outside autograd (a step, a write-back): a graph
        saved before refuses its backward, as torch's version counter does for in-place writes."""
        with stand_in.revealed_all(self.params):
            for p in self.params:
                increment_version(p)

    def refresh_shard(self) -> None:
        """Unsharded units with a separate shard (an fp32 master, or `param_dtype`): where a
        kept parameter no longer equals its shard rounded to the parameter's dtype, it was
        written from outside (`model.load_state_dict`, `p.copy_`): take the parameter's value.
        (A mask the size of the shard, no host sync: the update is a `where`.)"""
        if self.external:
            return copy_in(self)
        if self.sharded or self.shard.data_ptr() == self.full.local.data_ptr():
            return
        take_changed(self)

    # --- accounting ------------------------------------------------------------------

    def transient_bytes(self) -> int:
        """Unsharded buffers alive now (sharded parameters while gathered, gradients being reduced)."""
        return (self.full.nbytes if self.sharded else 0) + self.grads.transient_bytes()

    def __repr__(self) -> str:
        return (
            f"Unit({self.name or self.index}: {len(self.params)} params, S={self.layout.shard_size}, "
            f"{self.state.value})"
        )
