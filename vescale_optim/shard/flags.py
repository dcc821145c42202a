"""Whether some rank has a flag set: the small all-reduces the runtime agrees through.

The step's agreement (which parameters step, problems, the hyperparameters' digest), each
backward's agreement on `no_sync()` and the non-finite check are flags any rank may set;
`any_rank` reduces many at once, `any_rank_issued` issues them now to be read later, and
`any_rank_flag` reduces a flag computed on the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .comm import Comm, host_to_device
from .handle import Handle, Op, issue


def any_rank(flags: Sequence[bool], comm: Comm, device: torch.device | None = None,
             what: str | None = None) -> list[bool]:  # fmt: skip
    """For each flag, whether some rank of `comm` has it set (one all-reduce).

    On gloo the flags travel as bits of int64 words (bitwise or): a handful of words
    instead of one float per flag, and below the world size gloo's small-message path is
    several times faster than its ring (4 ranks on 2 cores: 0.7 ms for 2 words, 5-7 ms
    for 78 floats). NCCL has no bitwise reduction: a byte per flag, max, on the group's
    device, copied there without a stall; reading the answer back is one host sync (the
    host decides what follows from it). `device` is ignored (kept for callers)."""
    return any_rank_issued(flags, comm, what, own_stream=False)()


def any_rank_issued(flags: Sequence[bool], comm: Comm, what: str | None = None,
                    own_stream: bool = True) -> Callable[[], list[bool]]:  # fmt: skip
    """`any_rank`, issued now and read later: the returned call waits for the all-reduce and
    reads the answer. With `own_stream` a CUDA read goes through a stream of its own, so it
    waits for this all-reduce alone, not for what the current stream was told to wait for
    since (a reduction that another rank never joins)."""
    if not comm.active:
        answer = [bool(f) for f in flags]
        return lambda: answer
    if comm.gloo:
        words = [0] * -(-len(flags) // 64)
        for i, f in enumerate(flags):
            if f:
                words[i // 64] |= 1 << (i % 64)
        signed = [w - (1 << 64) if w >> 63 else w for w in words]
        tensor, reduce_op = torch.tensor(signed, dtype=torch.int64), dist.ReduceOp.BOR
    else:
        tensor = host_to_device([bool(f) for f in flags], torch.uint8, comm.device)
        reduce_op = dist.ReduceOp.MAX
    desc = Op("all-reduce (any)", what, tensor, comm)
    work = issue(desc, lambda: dist.all_reduce(tensor, op=reduce_op, group=comm.group, async_op=True))
    handle = Handle(work, op=desc)

    def read() -> list[bool]:
        if comm.gloo:
            handle.wait()
            words = tensor.tolist()
            return [bool(words[i // 64] >> (i % 64) & 1) for i in range(len(flags))]
        side = own_stream and tensor.device.type == "cuda"
        with torch.cuda.stream(torch.cuda.Stream(tensor.device)) if side else contextlib.nullcontext():
            handle.wait()
            return [bool(b) for b in tensor.tolist()]

    return read


def any_rank_flag(flag: torch.Tensor, comm: Comm, what: str | None = None) -> bool:
    """Whether some rank's boolean tensor `flag` (one element, on any device) is set: one
    all-reduce on the group's device and one host sync, to read the answer."""
    wire = flag.reshape(1).to(comm.device, torch.uint8)
    if comm.active:
        desc = Op("all-reduce (any)", what, wire, comm)
        Handle(issue(desc, lambda: dist.all_reduce(wire, op=dist.ReduceOp.MAX, group=comm.group,
                                                   async_op=True)), op=desc).wait()  # fmt: skip
    return bool(wire.item())
