"""Join torchrun's process group so that an elastic restart can join it again: `init_distributed`.

    device = vo.init_distributed(timeout=60)    # under torchrun: NCCL on cuda:LOCAL_RANK, or gloo
    ...                                         # without it: no group, this process's device
    dist.destroy_process_group()                # as usual, when dist.is_initialized()

Why it exists. `torchrun --max-restarts N` restarts every worker after a failure, but the
workers of the new attempt meet in the same key-value store as the failed one: torchrun's
agent hosts one TCPStore for the whole job (MASTER_ADDR:MASTER_PORT, announced by
`TORCHELASTIC_USE_AGENT_STORE=True`) and keeps it across attempts. The agent namespaces its
own rendezvous keys per round (`torch.rendezvous.<run id>.<round>/...`), but the workers get
the bare store, and `dist.init_process_group()` (env://) writes gloo's addresses and NCCL's
unique id under the same keys in every attempt. A restarted rank can read the dead attempt's
value before the live rank overwrites it: gloo then fails with "connectFullMesh failed ...
Connect timeout", NCCL connects to a dead port. `TORCHELASTIC_RESTART_COUNT` does not make a
safe namespace: each node's agent counts its own restarts, and a node restarted because
another one failed does not count it (torch tried that prefix and dropped it, pytorch#135712).
`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` on the torchrun command line avoids the shared store,
but only where the launch command is yours to change.

What it does. Under torchrun's shared store, this attempt's ranks agree on a generation
number that no earlier attempt used, whatever that attempt left in the store: rank 0 takes a
ticket from a store counter (`Store.add`) as the generation and answers every later ticket
with it; each other rank takes a ticket (necessarily newer than any dead attempt's) and waits
for its answer, then says it has arrived; rank 0 answers until all have. The process group
then meets under `PrefixStore("vescale_optim/init_distributed/group/<generation>", store)`,
keys of this attempt only, for gloo and NCCL alike. Every wait is bounded by `timeout`. With
any other env:// launch (a store per attempt) it calls `dist.init_process_group()` as is.

What it does not replace. `dist.init_process_group` stays usable (other launchers, your own
store or init_method, a single restart-free run); meshes and sub-groups are made after it as
usual (`init_device_mesh`, `dist.new_group`); destroying the group is the caller's; resuming
from a checkpoint is the script's (`CheckpointManager.load()`).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from .shard import handle, set_collective_timeout
from .shard.comm import local_cuda_index

__all__ = ["init_distributed"]

NAMESPACE = "vescale_optim/init_distributed"
_TICKETS = f"{NAMESPACE}/tickets"  # a counter over every attempt of the job
_ANSWERED = f"{NAMESPACE}/answered"  # the newest ticket a rank 0 has answered
_POLL = 0.005  # seconds between rank 0's looks at the store while it answers

_joined = False  # this process's default group was made here


def _seconds(timeout: float | timedelta) -> timedelta:
    timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    return timeout


def _local_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _generation(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> int:
    """A number every rank of this attempt gets and no earlier attempt on `store` used
    (collective over the `world_size` ranks of the attempt; see the module's docstring).

    Only live ranks take tickets, and an earlier attempt's ranks are all gone when a new one
    starts (torchrun stops every worker before it starts the next attempt), so every ticket
    of this attempt is newer than any earlier one, and an answer under a ticket of this
    attempt can only come from this attempt's rank 0.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    if rank != 0:
        ticket = store.add(_TICKETS, 1)
        try:
            number = int(store.get(f"{NAMESPACE}/answer/{ticket}"))
        except (dist.DistError, RuntimeError) as e:  # the store's own timeout
            raise RuntimeError(
                f"init_distributed: rank {rank} got no answer from rank 0 of this attempt within "
                f"{timeout.total_seconds():g} s (ticket {ticket}): rank 0 died, or did not call "
                "init_distributed"
            ) from e
        store.add(f"{NAMESPACE}/arrived/{number}", 1)
        return number
    number = store.add(_TICKETS, 1)
    answered = int(store.get(_ANSWERED)) if store.check([_ANSWERED]) else 0
    arrived = f"{NAMESPACE}/arrived/{number}"
    while True:
        newest = store.add(_TICKETS, 0)
        if newest > answered:  # a dead attempt's tickets are answered too: no one reads those
            tickets = range(answered + 1, newest + 1)
            store.multi_set([f"{NAMESPACE}/answer/{t}" for t in tickets], [str(number)] * len(tickets))
            store.set(_ANSWERED, str(newest))
            answered = newest
        count = store.add(arrived, 0)
        if count >= world_size - 1:
            return number
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"init_distributed: {count} of the other {world_size - 1} ranks joined rank 0 within "
                f"{timeout.total_seconds():g} s: a rank died, or did not call init_distributed"
            )
        time.sleep(_POLL)


def init_distributed(
    backend: str | None = None,
    timeout: float | timedelta | None = None,
    collective_timeout: float | timedelta | None = None,
) -> torch.device:
    """Join the process group of a torchrun (or other env://) launch; this process's device.

    `backend`: None picks NCCL when CUDA is available, gloo otherwise. With NCCL the device
    is `cuda:LOCAL_RANK` (modulo the GPUs this process sees: a launcher may show each
    process only its own, SLURM's `--gpus-per-task=1`), made current (`torch.cuda.set_device`)
    and bound to the group (`device_id`, which initialises NCCL eagerly); with gloo it is the CPU. `timeout`
    (seconds or a `timedelta`) is the process group's (None: torch's default for the
    backend) and bounds the meeting of the ranks too. `collective_timeout`, when given, is
    passed to `vescale_optim.set_collective_timeout` (on NCCL it makes waits block the host:
    prefer the group's timeout there).

    Under torchrun the group meets under keys of this restart attempt only, so a run that
    `torchrun --max-restarts N` restarts joins its group again (the module's docstring says
    why plain `dist.init_process_group()` may not). Without RANK and WORLD_SIZE in the
    environment nothing is started: it returns the current CUDA device, or the CPU. Raises
    RuntimeError when a default process group exists already (made here or elsewhere).
    """
    global _joined
    if handle.initialized():
        made = "by an earlier init_distributed()" if _joined else "by dist.init_process_group()"
        raise RuntimeError(
            f"init_distributed: this process has joined a process group already ({made}); call it "
            "once per process, or dist.destroy_process_group() first"
        )
    if collective_timeout is not None:
        set_collective_timeout(collective_timeout)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return _local_device()
    if not dist.is_available():
        raise RuntimeError("init_distributed: this torch build has no torch.distributed")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    pg_timeout = None if timeout is None else _seconds(timeout)
    device = torch.device("cpu")
    kwargs: dict = {}
    if "nccl" in backend.lower():
        if not torch.cuda.is_available():
            raise RuntimeError(f"init_distributed: backend {backend!r} needs CUDA, which is not available")
        device = torch.device("cuda", local_cuda_index() or 0)  # LOCAL_RANK modulo the visible GPUs
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's store, kept across attempts
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        meet = pg_timeout or default_pg_timeout
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=meet
        )
        number = _generation(store, rank, world_size, meet)
        kwargs.update(
            store=dist.PrefixStore(f"{NAMESPACE}/group/{number}", store), rank=rank, world_size=world_size
        )
    dist.init_process_group(backend, timeout=pg_timeout, **kwargs)
    _joined = True
    return device
