"""A unit's values moving between its shard and its unsharded buffer: the initial values, the
all-gather of the shards into `full` (straight, or through the gather codec), and the values
written into kept parameters from outside taken back into the shard.

Functions of a `Unit` (`unit`, which calls them), apart from its lifecycle: which state it is
in, and when it gathers or frees, stay the unit's own.
"""

from __future__ import annotations

import torch

from ..shard.collectives import Handle, all_gather_into_, broadcast_
from .grad_buffers import ring
from .tensor_parallel import local


def take_initial_values(unit, sync_params: bool) -> None:
    """The unit's shard from the parameters' current values (rank 0's with `sync_params`: one
    broadcast over the unit's `dp`), and the whole parameters of an unsharded unit."""
    s, rank = unit.layout.shard_size, unit.comm.rank
    if sync_params and unit.dp.active:
        staged = torch.zeros(unit.layout.numel, dtype=unit.shard_dtype, device=unit.device)
        for i, p in enumerate(unit.params):
            start = unit.layout.offsets[i]
            value = local(p).detach()
            staged[start : start + value.numel()].copy_(value.reshape(-1))
        broadcast_(staged, 0, unit.dp, what=f"unit {unit.name}'s initial parameters")
        unit.shard.copy_(staged[rank * s : (rank + 1) * s])
        # a finished broadcast's work can outlive wait() and keep `staged` (seen on gloo): free it now
        staged.untyped_storage().resize_(0)
    else:
        for i, p in enumerate(unit.params):
            unit.write_piece(i, local(p).detach())
    if not unit.sharded:  # keep whole parameters: rank 0's (gathered) or this rank's own
        if sync_params or unit.gather_codec is not None:
            gather_into_full(unit, async_op=False)
        else:
            for i, p in enumerate(unit.params):
                unit.full.view(i).copy_(local(p).detach())


def gather_into_full(unit, async_op: bool) -> Handle:
    """Every rank's shard into the unit's `full`: in the compute dtype, or through the gather
    codec (`gather_bits`: packed on the compute stream, one all-gather of the bytes, then decoded
    into `full` when waited for; see `kernels.wire`). Counts the bytes in `gathered_bytes`."""
    world, s, what = unit.comm.world_size, unit.layout.shard_size, f"unit {unit.name}'s parameters"
    codec = unit.gather_codec
    if codec is None:
        unit.gathered_bytes += ring(world, s * unit.full.data.element_size())
        with unit.streams.gathering():  # issued there; a blocking wait belongs to the compute stream
            handle = all_gather_into_(unit.full.data, unit.shard, unit.comm, async_op=True, what=what)
        if not async_op:
            handle.wait()
        return handle
    rank = unit.comm.rank
    rows = torch.empty(world, codec.packed_width(s), dtype=torch.uint8, device=unit.device)
    codec.pack(unit.shard, 1, out=rows[rank])
    unit.gathered_bytes += ring(world, rows.shape[1])
    with unit.streams.gathering():
        gathered = all_gather_into_(rows.view(-1), rows[rank], unit.comm, async_op=True, what=what)

    def decode() -> None:
        codec.unpack(rows, unit.compute_dtype, out=unit.full.data)  # straight in
        rows.untyped_storage().resize_(0)

    handle = gathered.then(decode)
    if not async_op:
        handle.wait()
    return handle


def take_changed(unit) -> None:
    """Where this rank's slice of the unit's `full` differs from the shard as gathered, take it
    into the shard (a mask the size of the shard, no host sync: the update is a `where`)."""
    kept_slice = unit.full.local
    codec = unit.gather_codec
    if codec is not None:  # the kept parameters are the shard through the gather codec
        kept = codec.unpack(codec.pack(unit.shard), kept_slice.dtype)
    else:
        kept = unit.shard.to(kept_slice.dtype)
    stale = kept != kept_slice
    torch.where(stale, kept_slice.to(unit.shard.dtype), unit.shard, out=unit.shard)
