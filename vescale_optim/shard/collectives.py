"""The one place that moves data with `torch.distributed`.

Every call works on a process group, on world size 1, and with no process group at
all (one process). Backend quirks are hidden here: gloo cannot send fp8 (data
movement sends a uint8 view instead), and gathers of uneven pieces are padded.
Calls with `async_op=True` return a `Handle`; `wait()` finishes any unpacking.

Every wait is bounded: by `set_collective_timeout(...)` when set, else by the process group's own
timeout. A collective that fails or times out (another rank died, or did not make the
same call) raises `CollectiveError` naming the operation, its tensor and its group, so a
dead rank surfaces as an error on the others instead of a hang.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .comm import Comm, forced
from .handle import (
    CollectiveError,
    Handle,
    Op,
    before_synchronous,
    get_collective_timeout,
    issue,
    local_copy,
    set_collective_timeout,
)
from .redistribution import Plan, RankProgram, plan_redistribute
from .spec import RaggedShard, Shape

_BYTE_VIEW = {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases have only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}

__all__ = [
    "CollectiveError",
    "Comm",
    "Handle",
    "forced",
    "get_collective_timeout",
    "set_collective_timeout",
]


def _movable(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in _BYTE_VIEW else t


def _scale(splits: Sequence[int], t: torch.Tensor) -> list[int]:
    k = t.element_size() if t.dtype in _BYTE_VIEW else 1
    return [s * k for s in splits]


def _op(op: str):
    if op not in _OPS:
        raise ValueError(f"unknown reduction {op!r}; expected one of {sorted(_OPS)}")
    return _OPS[op]


def _local(run, out: torch.Tensor, async_op: bool, garble: bool = True) -> Handle:
    """A collective on a group of one, done as a local copy: `run()` writes `out` on the current
    stream (a side stream, perhaps), and the handle orders whoever waits for it after that
    (`handle.local_copy`); `garble`: whether `out` may be garbled until then under `delayed()`
    (not when `run` reads it)."""
    return _waited(Handle(local_copy(run, out.device, (out,), garble)), async_op)


def _waited(handle: Handle, async_op: bool) -> Handle:
    """`handle`, waited for now unless `async_op`."""
    if not async_op:
        handle.wait()
    return handle


# Each issues one torch.distributed call through the door (`issue`), fp8 moved as bytes.


def _issue_all_gather(desc: Op, out: torch.Tensor, inp: torch.Tensor, comm: Comm):
    """Every rank's `inp` into `out`, in rank order."""
    group = comm.group
    return issue(desc, lambda: _all_gather_single(_movable(out), _movable(inp), group=group, async_op=True))


def _issue_broadcast(desc: Op, tensor: torch.Tensor, src: int, comm: Comm):
    """`src`: a rank of `comm`'s group."""
    root, group = comm.global_rank(src), comm.group
    return issue(desc, lambda: dist.broadcast(_movable(tensor), root, group=group, async_op=True))


def _issue_all_to_all(
    desc: Op,
    out: torch.Tensor,
    inp: torch.Tensor,
    comm: Comm,
    out_splits: Sequence[int] | None = None,
    in_splits: Sequence[int] | None = None,
):
    """Equal pieces without splits; `out_splits[r]` and `in_splits[r]` elements from and to
    rank r with them."""
    out_sizes = None if out_splits is None else _scale(out_splits, out)
    in_sizes = None if in_splits is None else _scale(in_splits, inp)
    recv, send, group = _movable(out), _movable(inp), comm.group
    return issue(
        desc, lambda: dist.all_to_all_single(recv, send, out_sizes, in_sizes, group=group, async_op=True)
    )


def _gather_in_place(
    data: torch.Tensor, shard_size: int, comm: Comm, async_op: bool, what: str | None = None
) -> Handle:
    """Every rank's slice `[r*S, (r+1)*S)` of `data` from that rank, in place.

    On gloo, whose all-gather stages through a temporary buffer and copies out, every
    slice is broadcast in place from its rank instead.
    """
    if not comm.active:
        return Handle()
    s = shard_size
    if comm.gloo:
        op = Op("all-gather", what, data, comm)
        works = [_issue_broadcast(op, data[r * s : (r + 1) * s], r, comm) for r in range(comm.world_size)]
        return _waited(Handle(works, op=op), async_op)
    local = data[comm.rank * s : (comm.rank + 1) * s]
    op = Op("all-gather", what, data, comm)
    return _waited(Handle(_issue_all_gather(op, data, local, comm), op=op), async_op)


def all_gather_into_(
    data: torch.Tensor, shard: torch.Tensor, comm: Comm, async_op: bool = False, what: str | None = None
) -> Handle:
    """Fill `data` (`W*S` elements) from every rank's `shard` (its `S` elements, any dtype).

    The shard is gathered straight into `data` when the backend can (NCCL, same dtype);
    otherwise it is written (cast if need be) into the rank's own slice and `data`
    gathered in place.
    """
    s = shard.numel()
    local = data[comm.rank * s : (comm.rank + 1) * s]
    if shard.data_ptr() == local.data_ptr() and shard.dtype == data.dtype:
        return _gather_in_place(data, s, comm, async_op, what)
    if comm.active and not comm.gloo and shard.dtype == data.dtype:
        op = Op("all-gather", what, data, comm)
        return _waited(Handle(_issue_all_gather(op, data, shard, comm), op=op), async_op)
    if not comm.active:
        return _local(lambda: local.copy_(shard), local, async_op)
    local.copy_(shard)
    return _gather_in_place(data, s, comm, async_op, what)


def reduce_scatter_into_(
    data: torch.Tensor,
    out: torch.Tensor,
    comm: Comm,
    op: str = "mean",
    accumulate: bool = False,
    async_op: bool = False,
    what: str | None = None,
) -> Handle:
    """Reduce `data` (`W*S` elements) over ranks into `out` (the rank's `S` elements, any
    dtype), or add the reduction to `out` when `accumulate`.

    `data` is scratch afterwards. On gloo `data` is all-reduced in place and the mean
    divided straight into `out`; on NCCL the reduce-scatter writes `out` itself unless a
    dtype change or accumulation needs a staging slice.
    """
    reduce_op = _op(op)
    s = out.numel()
    divisor = comm.world_size if op == "mean" else 1
    desc = Op("reduce-scatter", what, data, comm)
    if comm.active and comm.gloo:
        summed = dist.ReduceOp.SUM if op == "mean" else reduce_op
        src = data[comm.rank * s : (comm.rank + 1) * s]
        work = issue(desc, lambda: dist.all_reduce(data, op=summed, group=comm.group, async_op=True))
    elif comm.active:
        direct = not accumulate and out.dtype == data.dtype
        src = out if direct else data.new_empty(s)
        work = issue(
            desc, lambda: _reduce_scatter_single(src, data, op=reduce_op, group=comm.group, async_op=True)
        )
        divisor = 1
        if direct:
            return _waited(Handle(work, op=desc), async_op)
    else:
        src, work, divisor = data, None, 1

    def finish() -> None:
        if accumulate:
            out.add_(src.div_(divisor) if divisor != 1 else src)
        elif divisor != 1:
            torch.div(src, divisor, out=out)
        else:
            out.copy_(src)

    return _waited(Handle(work, finish, desc), async_op)


def broadcast_(
    tensor: torch.Tensor, src: int, comm: Comm, async_op: bool = False, what: str | None = None
) -> Handle:
    """Every rank's `tensor` becomes rank `src`'s (a rank of `comm`'s group), in place."""
    if not comm.active:
        return Handle()
    desc = Op(f"broadcast from rank {src}", what, tensor, comm)
    return _waited(Handle(_issue_broadcast(desc, tensor, src, comm), op=desc), async_op)


def all_reduce_(
    tensor: torch.Tensor, comm: Comm, op: str = "sum", async_op: bool = False, what: str | None = None
) -> Handle:
    reduce_op = _op(op)
    if not comm.active:
        return Handle()
    desc = Op(f"all-reduce ({op})", what, tensor, comm)
    work = issue(desc, lambda: dist.all_reduce(tensor, op=reduce_op, group=comm.group, async_op=True))
    return _waited(Handle(work, op=desc), async_op)


def all_to_all_(
    out: torch.Tensor, inp: torch.Tensor, comm: Comm, async_op: bool = False, what: str | None = None
) -> Handle:
    """Rank r's r-th equal piece of every rank's flat `inp`, in rank order, into its `out`
    (one `all_to_all_single` with equal splits; `out` may not alias `inp`)."""
    if not comm.active:
        return _local(lambda: out.copy_(inp), out, async_op)
    desc = Op("all-to-all", what, inp, comm)
    return _waited(Handle(_issue_all_to_all(desc, out, inp, comm), op=desc), async_op)


def all_to_all_v_(
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: Sequence[int],
    in_splits: Sequence[int],
    comm: Comm,
    async_op: bool = False,
    what: str | None = None,
) -> Handle:
    """`in_splits[r]` elements of the flat `inp` (in rank order) to rank r, and `out_splits[r]` from
    rank r into the flat `out` (one `all_to_all_single` with uneven splits, which gloo takes too)."""
    if not comm.active:
        return _local(lambda: out.copy_(inp), out, async_op)
    desc = Op("all-to-all", what, inp, comm)
    work = _issue_all_to_all(desc, out, inp, comm, out_splits, in_splits)
    return _waited(Handle(work, op=desc), async_op)


def run_plan(
    plan: Plan,
    src: torch.Tensor,
    dst: torch.Tensor,
    comm: Comm,
    program: RankProgram | None = None,
    async_op: bool = False,
    what: str | None = None,
) -> Handle:
    """Execute `plan` from this rank's flat `src` into its flat `dst` with one
    `all_to_all_single`. Runs of contiguous, in-order intervals are sent and received
    in place; only scattered intervals are packed or unpacked."""
    if plan.world_size != comm.world_size:
        raise ValueError(f"plan for {plan.world_size} ranks run on a world of {comm.world_size}")
    prog = program or plan.program(comm.rank)
    if not comm.active:

        def copy() -> None:
            for (so, n), (do, _) in zip(prog.sends, prog.recvs):
                if src.data_ptr() != dst.data_ptr() or so != do:
                    dst[do : do + n].copy_(src[so : so + n])

        return _local(copy, dst, async_op, garble=False)  # `dst` may be `src`
    if prog.send_range is not None:
        send = src[prog.send_range[0] : prog.send_range[1]]
    else:
        send = torch.cat([src[o : o + n] for o, n in prog.sends])
    if prog.recv_range is not None:
        recv, finish = dst[prog.recv_range[0] : prog.recv_range[1]], None
    else:
        recv = torch.empty(sum(prog.recv_splits), dtype=dst.dtype, device=dst.device)

        def finish() -> None:
            pos = 0
            for o, n in prog.recvs:
                dst[o : o + n].copy_(recv[pos : pos + n])
                pos += n

    desc = Op("all-to-all", what, send, comm)
    work = _issue_all_to_all(desc, recv, send, comm, prog.recv_splits, prog.send_splits)
    return _waited(Handle(work, finish, desc), async_op)


def full_tensor(
    local: torch.Tensor, shape: Shape, placement: RaggedShard, comm: Comm, async_op: bool = False
) -> tuple[torch.Tensor, Handle]:
    """Ragged -> replicated: every rank gets the whole tensor from the ranks' pieces.

    Equal pieces are gathered straight into the result; uneven ones are padded to
    the largest piece (gloo cannot gather uneven lists) and unpadded afterwards.
    """
    shape = tuple(shape)
    placement.check(shape, comm.world_size)
    ranges = placement.ranges(shape)
    local = local.reshape(-1)
    if local.numel() != ranges[comm.rank][1] - ranges[comm.rank][0]:
        raise ValueError(
            f"rank {comm.rank} holds {local.numel()} elements but its piece of {shape} "
            f"under {placement} has {ranges[comm.rank][1] - ranges[comm.rank][0]}"
        )
    out = torch.empty(shape, dtype=local.dtype, device=local.device)
    if not comm.active:
        return out, _local(lambda: out.view(-1).copy_(local), out, async_op)
    lengths = [b - a for a, b in ranges]
    width = max(lengths)
    if width == 0:
        return out, Handle()
    gather = Op("all-gather", "a ragged tensor", local, comm)
    if all(n == width for n in lengths):
        handle = Handle(_issue_all_gather(gather, out.view(-1), local, comm), op=gather)
    else:
        padded = torch.zeros(width, dtype=local.dtype, device=local.device)
        padded[: local.numel()].copy_(local)
        gathered = torch.empty(width * comm.world_size, dtype=local.dtype, device=local.device)
        work = _issue_all_gather(gather, gathered, padded, comm)

        def unpad() -> None:
            flat = out.view(-1)
            for r, (a, b) in enumerate(ranges):
                flat[a:b].copy_(gathered[r * width : r * width + b - a])

        handle = Handle(work, unpad, gather)
    return out, _waited(handle, async_op)


def redistribute(
    local: torch.Tensor,
    shape: Shape,
    src: RaggedShard,
    dst: RaggedShard,
    comm: Comm,
    async_op: bool = False,
) -> tuple[torch.Tensor, Handle]:
    """Ragged -> ragged between any two placements of one tensor (one `all_to_all_single`).

    Returns this rank's new piece, shaped by `dst.local_shape`.
    """
    plan = plan_redistribute(tuple(shape), src, dst)
    out = torch.empty(plan.dst_numel[comm.rank], dtype=local.dtype, device=local.device)
    handle = run_plan(plan, local.reshape(-1), out, comm, async_op=async_op)
    return out.view(dst.local_shape(shape, comm.rank)), handle


def all_gather_flat(local: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Every rank's equal-sized flat `local`, concatenated in rank order."""
    if not comm.active:
        return local
    out = torch.empty(local.numel() * comm.world_size, dtype=local.dtype, device=local.device)
    desc = Op("all-gather", "equal pieces", local, comm)
    Handle(_issue_all_gather(desc, out, local.reshape(-1), comm), op=desc).wait()
    return out


def local_slice(full: torch.Tensor, placement: RaggedShard, rank: int) -> torch.Tensor:
    """Replicated -> ragged: this rank's piece of a full tensor, as a flat view."""
    start, stop = placement.local_range(tuple(full.shape), rank)
    return full.reshape(-1)[start:stop]


def all_gather_object(obj, comm: Comm) -> list:
    """Every rank's `obj` (for construction-time checks, not for tensors)."""
    if not comm.active:
        return [obj]
    out = [None] * comm.world_size
    before_synchronous(Op("all-gather", "Python objects", None, comm))
    try:
        dist.all_gather_object(out, obj, group=comm.group)
    except RuntimeError as e:
        raise Op("all-gather", "Python objects", None, comm).error(e, False) from e
    return out
