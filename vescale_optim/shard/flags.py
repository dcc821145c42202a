"""Whether some rank has a flag set: the small all-reduces the runtime agrees through.

The step's agreement (which parameters step, problems, the hyperparameters' digest, and with
`skip_nonfinite` the non-finite check) and each backward's agreement on `no_sync()` are flags
any rank may set; `any_rank` reduces many at once, read back once, `any_rank_issued` issues
them now to be read later, and `any_rank_flag` reduces a flag computed on the device. A
*tail* of flags (host values or one-element tensors computed on the device, read with the
rest) is or'ed over further groups too (tensor parallelism) before the one read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .comm import Comm, host_to_device
from .handle import Handle, Op, issue

Flag = bool | torch.Tensor  # a host value, or a one-element tensor computed on the device


def any_rank(
    flags: Sequence[bool],
    comm: Comm,
    device: torch.device | None = None,
    what: str | None = None,
    *,
    tail: Sequence[Flag] = (),
    tail_over: Sequence[Comm] = (),
) -> list[bool]:
    """For each flag, whether some rank of `comm` has it set (one all-reduce), then for each
    flag of `tail`, whether some rank of `comm` and of every group of `tail_over` has it set
    (one all-reduce more per active group of `tail_over`, of the tail alone). One read of the
    answer: `flags`' answers, then `tail`'s.

    On gloo the flags travel as bits of int64 words (bitwise or): a handful of words
    instead of one float per flag, and below the world size gloo's small-message path is
    several times faster than its ring (4 ranks on 2 cores: 0.7 ms for 2 words, 5-7 ms
    for 78 floats); the tail's flags are a word each. NCCL has no bitwise reduction: a byte
    per flag, max, on the group's device, copied there without a stall (a flag computed on
    the device is copied in there, on the device); reading the answer back is one host sync
    (the host decides what follows from it). `device` is ignored (kept for callers)."""
    return any_rank_issued(flags, comm, what, own_stream=False, tail=tail, tail_over=tail_over)()


def any_rank_issued(
    flags: Sequence[bool],
    comm: Comm,
    what: str | None = None,
    own_stream: bool = True,
    *,
    tail: Sequence[Flag] = (),
    tail_over: Sequence[Comm] = (),
) -> Callable[[], list[bool]]:
    """`any_rank`, issued now and read later: the returned call waits for the all-reduces and
    reads the answer. With `own_stream` a CUDA read goes through a stream of its own, so it
    waits for these all-reduces alone, not for what the current stream was told to wait for
    since (a reduction that another rank never joins)."""
    over = [g for g in tail_over if g.active] if tail else []
    carrier = comm if comm.active else over[0] if over else None
    if carrier is None:  # nothing to talk to: the flags as they are, those on the device read at once
        return _alone(flags, tail)
    tensor, reduce_op, start = _on_the_wire(flags, tail, carrier)
    handles: list[Handle] = []
    if comm.active:
        desc = Op("all-reduce (any)", what, tensor, comm)
        work = issue(desc, lambda: dist.all_reduce(tensor, op=reduce_op, group=comm.group, async_op=True))
        handles.append(Handle(work, op=desc))
    part = tensor[start:]
    for group in over:
        if handles:
            handles[-1].wait()  # an order on the device (CUDA: the stream waits), not a read
        desc = Op("all-reduce (any)", f"{what or 'flags'} (tail, over tensor parallelism)", part, group)
        work = issue(
            desc, lambda g=group: dist.all_reduce(part, op=dist.ReduceOp.MAX, group=g.group, async_op=True)
        )
        handles.append(Handle(work, op=desc))

    def read() -> list[bool]:
        side = own_stream and tensor.device.type == "cuda"
        with torch.cuda.stream(torch.cuda.Stream(tensor.device)) if side else contextlib.nullcontext():
            for h in handles:
                h.wait()
            values = tensor.tolist()
        if carrier.gloo:
            answer = [bool(values[i // 64] >> (i % 64) & 1) for i in range(len(flags))]
        else:
            answer = [bool(b) for b in values[:start]]
        return answer + [bool(v) for v in values[start:]]

    return read


def _on_the_wire(
    flags: Sequence[bool], tail: Sequence[Flag], carrier: Comm
) -> tuple[torch.Tensor, object, int]:
    """The flags as they travel over `carrier`'s backend (bits of int64 words on gloo, a byte
    each on the device otherwise), the tail's after them (a device flag copied in there, not
    read); the reduction that ors them, and where the tail starts."""
    if carrier.gloo:
        words = [0] * -(-len(flags) // 64)
        for i, f in enumerate(flags):
            if f:
                words[i // 64] |= 1 << (i % 64)
        head = [w - (1 << 64) if w >> 63 else w for w in words]
        tensor = torch.tensor([*head, *(_host(t) for t in tail)], dtype=torch.int64)
        reduce_op = dist.ReduceOp.BOR
    else:
        head = [bool(f) for f in flags]
        tensor = host_to_device([*head, *(bool(_host(t)) for t in tail)], torch.uint8, carrier.device)
        reduce_op = dist.ReduceOp.MAX
    start = len(head)
    for i, t in enumerate(tail):
        if isinstance(t, torch.Tensor):  # computed on the device: copied in there, no read
            tensor[start + i : start + i + 1].copy_(t.reshape(1))
    return tensor, reduce_op, start


def _host(flag: Flag) -> int:
    """A tail flag's host value (0 for one computed on the device, copied in later)."""
    return 0 if isinstance(flag, torch.Tensor) else int(bool(flag))


def _alone(flags: Sequence[bool], tail: Sequence[Flag]) -> Callable[[], list[bool]]:
    """The answer with nothing to talk to: the flags themselves, the tail's device flags read
    together (one read, only if there are some)."""
    answer = [bool(f) for f in flags]
    on_device = [t for t in tail if isinstance(t, torch.Tensor)]
    if not on_device:
        answer += [bool(t) for t in tail]
        return lambda: answer
    values = iter(torch.stack([t.reshape(()).to(torch.bool) for t in on_device]).tolist())
    answer += [bool(next(values)) if isinstance(t, torch.Tensor) else bool(t) for t in tail]
    return lambda: answer


def any_rank_flag(flag: torch.Tensor, comm: Comm, what: str | None = None, over: Sequence[Comm] = ()) -> bool:
    """Whether some rank's boolean tensor `flag` (one element, on any device) is set, over
    `comm` and then every group of `over` (tensor parallelism): one all-reduce per active
    group, on the group's device, and one host sync, to read the answer."""
    return any_rank([], comm, what=what, tail=[flag], tail_over=over)[0]
