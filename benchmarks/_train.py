"""What the training benchmarks share to train their configurations side by side: the same
per-rank batches, one step timed phase by phase, one trainer per configuration (a GPT, or the model
a subclass builds; its optimizer ours or a peer of `benchmarks._optim`), every configuration of a
world stepped in turn, and the rows and ratios made of what they measured.

    class Mine(Trainer): def optimizer(self, model): ...        # one configuration (a GPT unless `build`)
    interleave(trainers, batches(shape, rank, world), warmup, steps)
    results = {tr.config: tr.result(x, y, more=...) for tr in trainers}   # for the parent
    row = timed_row(config, every_ranks_result)                 # ms per phase, train ms, losses
    rows = against_peers(rows_by_config, peer, ["train", "step"])   # "train x", "step x", "|Δ loss|"
    seconds, out = barrier_timed(fn, *args)                     # fn(*args) timed after a barrier

Models and batches live on the rank's `device()`: the GPU a NCCL group is bound to (under
torchrun), else the CPU. On CUDA `train_step` waits for the device (`torch.cuda.synchronize()`)
before it reads each phase's clock, so a phase's time is its work on the device; the library
itself never synchronises for this.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch.profiler import record_function

from benchmarks._comm import CommMeter
from benchmarks._gpt import gpt_loss, param_count, random_batch, shaped_gpt
from benchmarks._measure import median_ratio, slowest

PHASES = ["fwd", "bwd", "step", "zero_grad"]


def device() -> torch.device:
    """This rank's device: the current GPU when the group is NCCL's (which talks only to CUDA
    tensors; `vo.init_distributed` made `cuda:LOCAL_RANK` current), else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def batches(shape: dict, rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A pool of two batches for this rank on its `device()`, cycled, so a working optimizer lowers
    the loss (drawn on the CPU: the same tokens on any device)."""
    drawn = [
        random_batch(shape["batch"], shape["seq"], shape["vocab"], 1000 + i * world + rank) for i in (0, 1)
    ]
    return [(x.to(device()), y.to(device())) for x, y in drawn]


def _wait_for_device(x: torch.Tensor) -> None:
    """On CUDA: until the device has done all it was given (a benchmark's clock only)."""
    if x.is_cuda:
        torch.cuda.synchronize(x.device)


def train_step(
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    opt,
    x: torch.Tensor,
    y: torch.Tensor,
    meter: CommMeter | None = None,
    around: Mapping[str, AbstractContextManager] | None = None,
) -> tuple[float, dict[str, float], dict[str, dict]]:
    """One train step after a barrier, each phase of `PHASES` under `bench::PHASE` (and its context
    in `around`, entered outside that), the forward being `loss_of(x, y)`: the loss, the seconds of
    each phase (on CUDA, until the device finished it) and, with a `meter`, what it measured in each
    phase."""
    around = around or {}
    if meter is not None:
        meter.take()
    _wait_for_device(x)
    (meter.barrier if meter is not None else dist.barrier)()
    _wait_for_device(x)  # a NCCL barrier may return before the device has passed it
    times, comm, loss = {}, {}, None
    for name in PHASES:
        with around.get(name, nullcontext()), record_function(f"bench::{name}"):
            t0 = time.perf_counter()
            if name == "fwd":
                loss = loss_of(x, y)
            elif name == "bwd":
                loss.backward()
            else:
                getattr(opt, name)()
            _wait_for_device(x)
            times[name] = time.perf_counter() - t0
        if meter is not None:
            comm[name] = meter.take()
    return loss.item(), times, comm


def barrier_timed(fn: Callable, *args):
    """After a barrier: the seconds `fn(*args)` took on this rank, and what it returned."""
    dist.barrier()
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def interleave(trainers: list, pool: list, warmup: int, steps: int) -> None:
    """`warmup + steps` rounds, each calling every trainer's `step` once on the round's batch of `pool`, the
    order rotating so that load on the machine hits them alike; warm-up rounds are not recorded."""
    for s in range(warmup + steps):
        k = s % len(trainers)
        for tr in trainers[k:] + trainers[:k]:
            tr.step(*pool[s % len(pool)], record=s >= warmup)


class Trainer:
    """One configuration: its own seeded model copy (`build(shape)`, a GPT on `device()` unless a
    subclass builds another), its optimizer (`optimizer`, which subclasses define; it may set
    `module`, what the forward calls, to a wrapper such as DDP), and what its recorded steps
    measured: `times[phase]` (seconds per step), `comm` (per step, each phase's `meter.take()`;
    empty without a meter) and every step's loss."""

    def __init__(self, config: str, shape: dict, meter: CommMeter | None = None):
        self.config, self.meter = config, meter
        self.model = self.module = self.build(shape)
        self.params = param_count(self.model)
        self.opt = self.optimizer(self.model)
        self.times: dict[str, list[float]] = {k: [] for k in PHASES}
        self.comm: list[dict[str, dict]] = []
        self.losses: list[float] = []

    def build(self, shape: dict) -> torch.nn.Module:
        return shaped_gpt(shape, seed=0, device=device())

    def optimizer(self, model: torch.nn.Module):
        raise NotImplementedError

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return gpt_loss(self.module, x, y)

    def step(self, x: torch.Tensor, y: torch.Tensor, record: bool = True, around: Mapping | None = None):
        """One `train_step` (see there); recorded unless `record` is false (warm-up)."""
        loss, times, comm = train_step(self.loss, self.opt, x, y, self.meter, around)
        self.losses.append(loss)
        if record:
            for k in PHASES:
                self.times[k].append(times[k])
            if self.meter is not None:
                self.comm.append(comm)

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return self.loss(x, y).item()

    def result(self, x: torch.Tensor, y: torch.Tensor, **more) -> dict:
        """What the recorded steps measured, for the parent (`timed_row` reads it): the parameter
        count, each phase's seconds per step, every step's loss, the loss on `(x, y)` after
        training, this rank's device type, and `more`."""
        out = dict(params=self.params, times_s=self.times, losses=self.losses, device=device().type)
        return {**out, "loss_after": self.eval_loss(x, y), **more}


def ms(per_step: list[float]) -> float:
    """The median of per-step seconds, in ms."""
    return 1e3 * statistics.median(per_step)


def timed_row(config: str, res: list[dict]) -> dict:
    """One configuration's row from every rank's `Trainer.result()`: each phase's `ms` (the median
    over steps of the slowest rank's), `train ms` their sum, the first step's loss and the loss after
    training (means over ranks); `_train` and `_step`, per step, for `against_peers`."""
    phases = {k: slowest([r["times_s"][k] for r in res]) for k in PHASES}
    train = [sum(t) for t in zip(*phases.values())]
    row = {"config": config, "params": res[0]["params"], "_train": train, "_step": phases["step"]}
    row.update({"train ms": ms(train), **{f"{k} ms": ms(v) for k, v in phases.items()}})
    row["loss first"] = statistics.mean(r["losses"][0] for r in res)
    row["loss after"] = statistics.mean(r["loss_after"] for r in res)
    return row


def against_peers(rows: dict[str, dict], peer: Callable[[str], str], keys: Sequence[str]) -> list[dict]:
    """For each row whose peer configuration (`peer(config)`) has a row: `K x`, the median of the
    per-step ratios of its `_K` times to the peer's (the two ran each step side by side), and
    `|Δ loss|` against the peer's loss after training; the `_K` lists are then dropped."""
    for row in rows.values():
        base = rows.get(peer(row["config"]))
        if base is None:
            continue
        for k in keys:
            row[f"{k} x"] = median_ratio(row[f"_{k}"], base[f"_{k}"])
        row["|Δ loss|"] = abs(row["loss after"] - base["loss after"])
    for row in rows.values():
        for k in keys:
            del row[f"_{k}"]
    return list(rows.values())
