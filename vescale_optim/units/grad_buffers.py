"""A unit's gradients: the unreduced buffer autograd accumulates into, its reduction, and
the rank's averaged-gradient shard.

Persistent: `shard`, the rank's `S` averaged-gradient elements (the dtype of the
parameters' shard, fp32 for bf16/fp16 parameters), from the first reduction until
`clear()`. Transient: `full`, where autograd accumulates while every `.grad` is a view
of it, from the first gradient of a backward to the reduction that empties it into
`shard`. A reduction is a reduce-scatter in the shard group and, with replicas (HSDP),
an all-reduce of its result across them: `advance()` waits for the first stage (freeing
the buffer it read) and issues the second, `wait()` finishes both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..shard.buffer import FlatBuffer
from ..shard.collectives import Handle, all_reduce_, all_to_all_, reduce_scatter_into_
from .reduced_grad import ReducedGrad, Sharded
from .tensor_parallel import like, local, local_shape, set_grad
from .tp_grads import tp_places

if TYPE_CHECKING:
    from .unit_view import UnitView


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


def _zero_as_torch(p: torch.Tensor, set_to_none: bool) -> None:
    """`torch.optim.Optimizer.zero_grad`'s treatment of one `.grad` (a wrapper's)."""
    if p.grad is None:
        return
    if set_to_none:
        p.grad = None
        return
    if p.grad.grad_fn is not None:
        p.grad.detach_()
    else:
        p.grad.requires_grad_(False)
    p.grad.zero_()


class GradBuffers:
    """The gradients of `unit`'s parameters (see the module's docstring)."""

    def __init__(self, unit: UnitView):
        self.unit = unit
        self.full = self._new_buffer()
        self._shard = torch.zeros(unit.layout.shard_size, dtype=unit.shard_dtype, device=unit.device)
        self.has_values = False  # `shard` holds reductions not yet consumed
        self.unsynced: torch.Tensor | None = None  # kept unsynced across replicas (`no_all_reduce`)
        self._keep_unsynced = False
        self.placeholders: list[ReducedGrad] = []  # each `.grad` once reduced (`make_placeholders`)
        self.plain = False  # one process, shard in the parameters' dtype: `.grad` is a view of the shard
        self._reduction: _Reduction | None = None  # the reduction writing `shard`, until waited
        self._home = None  # CUDA: the stream its buffers belong to (current at issue), which waits for it
        self.scattering: torch.Tensor | None = None  # the gradients last reduce-scattered (freed once done)
        self.sent_bytes = 0  # by this unit's reductions so far (as many received)
        self._borrowed: torch.Tensor | None = None  # a wrapper's gradient as the shard (`borrow`)

    def make_placeholders(self) -> None:
        """What each `.grad` holds once reduced, in the parameters' compute dtype and device
        (called once the parameters are views of the unit's buffer)."""
        u = self.unit
        # a DTensor parameter's reads as its DTensor gradient (global shape, placements: `tp_grads`)
        places = tp_places(u.params)
        self.placeholders = [
            ReducedGrad._of(u, i, tuple(p.shape) if tp else local_shape(p), p.dtype, p.device, tp)
            for i, (p, tp) in enumerate(zip(u.params, places))
        ]
        alone = not u.comm.active and not u.replicate.active
        # with DTensor parameters the placeholders are kept in one process too: the norms of the
        # plain parameters' ordinary tensors and of DTensors would not stack (torch's clipping)
        self.plain = alone and all(p.dtype == self._shard.dtype and not tp for p, tp in zip(u.params, places))

    def placeholder(self, i: int) -> torch.Tensor:
        """What parameter `i`'s `.grad` holds once reduced: in one process (nothing to reduce)
        an ordinary view of the shard when it has the parameter's dtype, else a `ReducedGrad`."""
        if not self.plain:
            return self.placeholders[i]
        start, stop = self.unit.full.local_range(i)
        return like(self.unit.params[i], self.shard[start:stop].view(self.unit.full.shapes[i]))

    def _local_grad(self, i: int) -> torch.Tensor | None:
        g = self.unit.params[i].grad  # (read per parameter per step: the DTensor flag is known)
        return local(g) if self.unit.dtensors[i] else g

    def is_reduced(self, i: int) -> bool:
        """Whether parameter `i`'s `.grad` is its reduced gradient (`placeholder(i)`)."""
        g = self._local_grad(i)
        if isinstance(g, ReducedGrad):
            return True
        if g is None or not self.plain or type(g) is not torch.Tensor or g.dtype != self._shard.dtype:
            return False
        start, _ = self.unit.full.local_range(i)
        here = self._shard.data_ptr() + start * self._shard.element_size()
        return g.data_ptr() == here and tuple(g.shape) == self.unit.full.shapes[i] and g.is_contiguous()

    def _new_buffer(self) -> FlatBuffer:
        u = self.unit
        shapes = [local_shape(p) for p in u.params]
        return FlatBuffer(u.layout, shapes, u.comm.rank, u.compute_dtype, u.device, allocate=False)

    # --- the unreduced buffer ---------------------------------------------------------------

    @property
    def has_full(self) -> bool:
        return self.full.allocated and self.full.data.numel() > 0

    def view(self, i: int) -> torch.Tensor:
        """Parameter `i`'s view of the unreduced buffer (allocated, zeroed, on first use)."""
        if not self.has_full:
            self.full.allocate(zero=True)
        return self.full.view(i)

    def is_live(self, i: int) -> bool:
        """Whether parameter `i`'s `.grad` is its view of the unreduced buffer."""
        g = self._local_grad(i)
        return g is not None and self.has_full and g.data_ptr() == self.full.view(i).data_ptr()

    def drop(self, i: int) -> None:
        """Forget what parameter `i` accumulated: its part of the unreduced buffer and this
        rank's piece of `shard`."""
        self.wait()
        if self.has_full:
            self.full.view(i).zero_()
        start, stop = self.unit.full.local_range(i)
        if stop > start:
            if self.shard_bytes:
                self._shard[start:stop].zero_()
            if self.unsynced is not None:
                self.unsynced[start:stop].zero_()

    def take(self, i: int, grad: torch.Tensor) -> None:
        """A gradient set by hand replaces parameter `i`'s: it goes into the unreduced buffer
        and what `shard` accumulated for it so far is dropped."""
        grad = local(grad)  # a DTensor parameter's gradient: its local tensor
        if isinstance(grad, Sharded):  # an averaged gradient of this layout: straight into the shard
            if grad._ranges != self.placeholders[i]._ranges or tuple(grad.shape) != self.unit.full.shapes[i]:
                raise ValueError(
                    f"the sharded gradient assigned to parameter {self.unit.labels[i]}'s .grad has another "
                    "layout; assign the gradient of this parameter, or a full tensor"
                )
            self.drop(i)
            start, stop = self.unit.full.local_range(i)
            self.shard[start:stop].copy_(grad.local())
            self.has_values = True
            self.unit.params[i].grad = self.placeholder(i)
            return
        self.drop(i)
        self.view(i).copy_(grad)
        set_grad(self.unit.params[i], self.full.view(i))

    def bind(self, i: int) -> None:
        """Autograd is about to accumulate parameter `i`'s gradient: its `.grad` becomes its
        view of the unreduced buffer (a reduced gradient stays in the shard and this adds
        to it; after `zero_grad` nothing reduced earlier counts; a gradient set by hand is
        taken in, and autograd accumulates on it)."""
        p = self.unit.params[i]
        if p.grad is None:
            self.drop(i)
            set_grad(p, self.view(i))
        elif self.is_reduced(i):
            set_grad(p, self.view(i))
        else:
            self.take(i, p.grad)
            if not self.is_live(i):
                set_grad(p, self.view(i))

    # --- the reduction -----------------------------------------------------------------------

    def reduce(self, async_op: bool = True) -> Handle:
        """Average the unreduced gradients over ranks into `shard` (added to what it holds
        since the last `clear()`). Each `.grad` that was a view of the buffer becomes its
        reduced gradient (`placeholder`) at once: a later backward accumulates into a new
        buffer while this one is reduced and freed (once the reduce-scatter is waited for).
        Over ranks, trainable parameters without a gradient on this rank get theirs too (what
        other ranks accumulated, averaged), so `.grad` is the same on every rank."""
        u = self.unit
        self.wait()  # one reduction of a unit at a time (already done in a normal backward)
        self._home = u.streams.current()
        if not self.has_full:
            self.full.allocate(zero=True)
        # over ranks every trainable parameter of the unit gets its reduced gradient, so that
        # every rank holds the same `.grad`s (utilities that reduce over them pair up)
        together = u.comm.active or u.replicate.active

        def absent(i: int, p: torch.Tensor) -> bool:  # trainable, no gradient on this rank, placeable
            return p.requires_grad and p.grad is None and u.placement_problem(i) is None

        live = [i for i, p in enumerate(u.params) if self.is_live(i) or (together and absent(i, p))]
        buf, self.full = self.full, self._new_buffer()
        data = buf.data
        with torch.profiler.record_function(f"vescale::reduce_scatter[{u.name}]"):
            if u.reduce_dtype != data.dtype:
                data = data.to(u.reduce_dtype)  # on the compute stream: see `streams`
                buf.free()  # the cast is what is reduced
            self.scattering = data
            what = f"unit {u.name}'s gradients"
            # across replicas the wire is in reduce_dtype too: half the inter-node bytes in bf16
            part = None
            if u.replicate.active:
                part = torch.empty(self._shard.numel(), dtype=data.dtype, device=data.device)
            if u.reduce_codec is not None:  # decoded, summed in fp32, then sent across in reduce_dtype
                part = None if part is None else torch.empty_like(self._shard)
                scatter = self._reduce_encoded(data, self.shard if part is None else part, part is None, what)
            else:
                self.sent_bytes += ring(u.comm.world_size, self._shard.numel() * data.element_size())
                add = part is None and self.has_values
                target = self.shard if part is None else part  # allocated on the compute stream
                with u.streams.reducing():
                    scatter = reduce_scatter_into_(data, target, u.reduce_comm, "mean", add, True, what)
            if part is None:
                self.has_values = True
                across = None
            else:
                keep = self._keep_unsynced
                across = lambda: self._over_replicas(part, keep)  # noqa: E731
        self._reduction = _Reduction(scatter.then(lambda: data.untyped_storage().resize_(0)), across)
        for i in live:
            u.params[i].grad = self.placeholder(i)
        if not async_op:
            self.wait()
        return self._reduction

    def _reduce_encoded(self, data: torch.Tensor, out: torch.Tensor, accumulate: bool, what: str) -> Handle:
        """qgZ's reduction: the piece of `data` each rank owns, encoded by the unit's reduce
        codec, goes to it in one all-to-all; this rank sums the pieces it receives in fp32
        into `out` (their mean; added to `out` when `accumulate` and `out` holds values). The
        encoding runs on the compute stream, the all-to-all on the reduce stream."""
        u = self.unit
        world, codec = u.comm.world_size, u.reduce_codec
        send = codec.pack(data, world)
        data.untyped_storage().resize_(0)  # read on the compute stream already: free it now
        self.scattering = send  # what is alive while the reduction runs
        recv = torch.empty_like(send)
        self.sent_bytes += ring(world, send.shape[1])
        add = accumulate and self.has_values
        with u.streams.reducing():
            moved = all_to_all_(recv, send, u.reduce_comm, async_op=True, what=what)

        def mean() -> None:
            total = codec.unpack_sum(recv).div_(world)  # the rows summed in order
            if add:
                out.add_(total)
            else:
                out.copy_(total)
            send.untyped_storage().resize_(0)
            recv.untyped_storage().resize_(0)

        return moved.then(mean)

    def _over_replicas(self, part: torch.Tensor, keep: bool) -> Handle:
        """Start averaging this shard group's reduction `part` (in `reduce_dtype`) over the
        replicas into `shard`, or keep it unsynced when `keep` (summed in the shard's
        dtype, so that many micro-batches do not round in bf16)."""
        if keep:
            kept = part.to(self._shard.dtype)
            self.unsynced = kept if self.unsynced is None else self.unsynced.add_(kept)
            return Handle()
        if self.unsynced is not None:
            part = self.unsynced.add_(part)
            self.unsynced = None
        return self._all_reduce_replicas(part.to(self.unit.reduce_dtype))

    def _all_reduce_replicas(self, part: torch.Tensor) -> Handle:
        u = self.unit
        self.sent_bytes += ring(u.replicate.world_size, part.numel() * part.element_size(), 2)
        profiled = torch.profiler.record_function(f"vescale::all_reduce_replicas[{u.name}]")
        with profiled, u.streams.across_replicas():
            handle = all_reduce_(
                part, u.replicate, "mean", async_op=True, what=f"unit {u.name}'s gradients over replicas"
            )

        def add() -> None:
            if self.has_values:
                self.shard.add_(part)
            else:
                self.shard.copy_(part)
            self.has_values = True

        return handle.then(add)

    def keep_unsynced(self, keep: bool) -> None:
        """Whether reductions from now on keep this shard group's result unsynced across
        replicas (summed in `unsynced`) instead of all-reducing it."""
        self._keep_unsynced = keep

    def sync_replicas(self) -> Handle:
        """Start averaging what was kept unsynced over the replicas into `shard` (collective
        over the replicas when there is something; every replica has or has not)."""
        self.wait()
        if self.unsynced is None:
            return Handle()
        part, self.unsynced = self.unsynced.to(self.unit.reduce_dtype), None
        self._home = self.unit.streams.current()
        self._reduction = _Reduction(Handle(), lambda: self._all_reduce_replicas(part))
        return self._reduction

    def advance(self) -> None:
        """Wait for the reduce-scatter in flight (its buffer is freed) and issue its
        all-reduce across replicas (without waiting for it)."""
        if self._reduction is not None:
            with self.unit.streams.waited_from(self._home):
                self._reduction.advance()

    @property
    def reducing_over_replicas(self) -> bool:
        """Whether an all-reduce across replicas is issued and not yet waited for."""
        return self._reduction is not None and self._reduction.second_issued

    def wait(self) -> None:
        """Until `shard` holds every reduction issued so far (on CUDA: the current stream,
        and the stream the reduction's buffers belong to before they are freed, when the two
        differ: a `.grad` read under a user's stream, `Streams.waited_from`)."""
        if self._reduction is not None:
            reduction, self._reduction = self._reduction, None
            with self.unit.streams.waited_from(self._home):
                reduction.wait()

    # --- the shard ------------------------------------------------------------------------------

    @property
    def shard(self) -> torch.Tensor:
        """This rank's averaged-gradient shard: a wrapper's gradient where `borrow`ed, else memory
        of its own, which `clear()` frees, as torch's `zero_grad(set_to_none=True)` frees
        gradients; it comes back zero when next used."""
        return self._borrowed if self._borrowed is not None else self.own_shard()

    def own_shard(self, gaps_only: bool = False) -> torch.Tensor:
        """The shard's own memory, zeroed if it was freed (`gaps_only`: only where no parameter's
        piece lies, for a caller that writes every piece)."""
        storage = self._shard.untyped_storage()
        if storage.nbytes() or not self._shard.numel():
            return self._shard
        storage.resize_(self._shard.numel() * self._shard.element_size())
        u, at = self.unit, 0
        for start, stop in sorted(u.full.local_range(i) for i in range(len(u.params))) if gaps_only else ():
            self._shard[at : max(at, start)].zero_()
            at = max(at, stop)
        self._shard[at:].zero_()
        return self._shard

    @property
    def shard_bytes(self) -> int:
        """Bytes the gradient shard holds now (0 while freed; a borrowed one's are the wrapper's)."""
        b = self._borrowed
        return b.numel() * b.element_size() if b is not None else self._shard.untyped_storage().nbytes()

    @property
    def borrowed(self) -> bool:
        return self._borrowed is not None

    def borrow(self, grad: torch.Tensor | None) -> None:
        """`grad` (flat, the shard's dtype and length: FSDP2's local gradient of the unit's one
        parameter) is the shard until `clear()` (None: its own memory). A step only reads it."""
        self._borrowed = grad

    def clear(self, set_to_none: bool = True, own_grads: bool = True) -> None:
        """Forget accumulated gradients: free the shard (`set_to_none`) or zero it, drop an
        unreduced buffer; every `.grad` becomes None, or with `set_to_none=False` a
        `ReducedGrad` (now zero) where there was a gradient. `own_grads=False` (a wrapper's
        `.grad`, DDP's): `.grad` is set to None or zeroed in place, as torch.optim does."""
        self.wait()
        self._borrowed = None  # (the wrapper's gradient: never freed or zeroed here)
        if set_to_none:
            self._shard.untyped_storage().resize_(0)
        elif self.shard_bytes:
            self._shard.zero_()
        self.has_values = False
        self.unsynced = None
        if self.has_full:
            self.full.free()
        for i, p in enumerate(self.unit.params):
            if not own_grads:
                _zero_as_torch(p, set_to_none)
            elif set_to_none or p.grad is None:
                p.grad = None
            elif p.requires_grad:
                p.grad = self.placeholder(i)

    def transient_bytes(self) -> int:
        """The unreduced buffer and the gradients being reduce-scattered, alive now."""
        scattering = self.scattering.untyped_storage().nbytes() if self.scattering is not None else 0
        return self.full.nbytes + scattering
