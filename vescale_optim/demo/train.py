"""The demo's training loop: every rank trains the same model on its own batches.

`train(cfg)` runs on each rank of an initialised process group, or alone with none.
Every optimizer of the run (`optimizer_names`: AdamW and Muon by default) trains a fresh model
from the same seeded weights on the same batches. Rank 0 shows the progress bar, prints the
tables and writes `summary.json` and `loss.png` (loss against step and against training wall
time) into `cfg.out`.
"""

from __future__ import annotations

import gc
import json
import math
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..shard.collectives import Comm, all_gather_object, all_reduce_
from .checkpoints import Checkpoints, collective_timeout, params_sha256
from .config import TrainConfig
from .data import Batches, load_corpus, stdlib_files, val_windows
from .model import GPT
from .optimizers import OPTIMIZERS, make_scheduler, optimizer_names, param_dtype_name


class World:
    """Rank, size and device of this process; collectives are no-ops for one process. They are
    the library's own (`shard.collectives` over the default group's `Comm`)."""

    def __init__(self) -> None:
        self.comm = Comm()
        self.distributed, self.rank, self.size = self.comm.distributed, self.comm.rank, self.comm.world_size
        self.backend = self.comm.backend
        on_gpu = torch.cuda.is_available() and self.backend in ("nccl", "none")
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        all_reduce_(t, self.comm, what="the demo's figures")
        return t

    def gather(self, obj: object) -> list:
        return all_gather_object(obj, self.comm)


SHARDING = {
    3: "ZeRO-3: shard_modules = every block + the model (parameters, gradients, state sharded)",
    2: "ZeRO-2: no shard_modules (parameters whole on every rank; gradients, state sharded)",
}

PRECISION = {
    "bf16": "param_dtype bf16 (gathered parameters and compute in bf16; fp32 shards, masters, state "
    "and gradient reduction)",
    "fp32": "fp32 throughout",
}

# The train loss reported at the end: the mean over the last TAIL steps of each step's
# loss, itself the mean next-byte cross-entropy over every rank's tokens of that step.
TAIL = 10
SMOOTH = 9  # steps in the plot's running mean, centred


def held_memory(opt: torch.optim.Optimizer) -> dict[str, int] | None:
    """Bytes the optimizer holds on this rank now (`memory_stats()`), None for one without it."""
    stats = getattr(opt, "memory_stats", None)
    return stats() if stats is not None else None


def peak_memory(device: torch.device) -> dict[str, float | None]:
    """This process's peak RSS and (on GPU) max CUDA memory allocated, in MiB, and its CPU seconds."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    rss_bytes = usage.ru_maxrss if sys.platform == "darwin" else usage.ru_maxrss * 1024
    cuda = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return {
        "rss_mib": rss_bytes / 2**20,
        "cuda_max_allocated_mib": cuda,
        "cpu_s": usage.ru_utime + usage.ru_stime,
    }


@torch.no_grad()
def evaluate(model: GPT, val: torch.Tensor, cfg: TrainConfig, world: World) -> tuple[float, int]:
    """Mean loss over fixed validation windows, split across ranks, and how many tokens it scored."""
    model.eval()
    x, y = val_windows(val, cfg.seq_len, cfg.val_tokens)
    x, y = x[world.rank :: world.size], y[world.rank :: world.size]
    total = torch.zeros(2, dtype=torch.float64, device=world.device)
    for i in range(0, x.shape[0], 32):
        xb, yb = x[i : i + 32].to(world.device), y[i : i + 32].to(world.device)
        total[0] += model.loss(xb, yb).double() * yb.numel()
        total[1] += yb.numel()
    model.train()
    total = world.sum(total)
    return (total[0] / total[1]).item(), int(total[1].item())


@dataclass
class _Run:
    """One optimizer's training: what it trains, and the losses and seconds of its steps so far."""

    model: GPT
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    batches: Batches
    checkpoints: Checkpoints
    init_digest: str  # the seeded weights every optimizer starts from
    first: int  # the step it starts at (after a resume)
    losses: list[float]
    seconds: list[float]


def _start(name: str, cfg: TrainConfig, train_data: torch.Tensor, world: World) -> _Run:
    """A fresh model (same seed, so the same initial weights) and optimizer `name`, or the
    newest checkpoint's run with `cfg.resume`."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model_config()).to(world.device)
    opt = OPTIMIZERS[name](model, cfg)
    init_digest = params_sha256(model)
    sched = make_scheduler(opt, cfg)
    batches = Batches(train_data, cfg.batch_size, cfg.seq_len, cfg.seed, world.rank)
    checkpoints = Checkpoints(cfg, model, opt, sched, batches)
    first, losses, seconds = checkpoints.resume()
    if first and world.rank == 0:
        print(f"resumed from {checkpoints.manager.path(first)}", flush=True)
    return _Run(model, opt, sched, batches, checkpoints, init_digest, first, losses, seconds)


def _step(run: _Run, cfg: TrainConfig, world: World) -> torch.Tensor:
    """One optimizer step on this rank's next batch; the batch's loss."""
    x, y = run.batches.next()
    x, y = x.to(world.device, non_blocking=True), y.to(world.device, non_blocking=True)
    loss = run.model.loss(x, y)  # in the gathered parameters' dtype (--param-dtype), fp32 logits' loss
    loss.backward()
    if hasattr(run.opt, "clip_grad_norm_"):
        run.opt.clip_grad_norm_(cfg.grad_clip)
    else:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip)
    run.opt.step()
    run.opt.zero_grad()
    run.sched.step()
    return loss


def train_one(
    name: str, cfg: TrainConfig, train_data: torch.Tensor, val_data: torch.Tensor, world: World
) -> dict:
    """Train a fresh model (same seed, so the same initial weights) with optimizer `name`, or
    continue the newest checkpoint's run with `cfg.resume`."""
    run = _start(name, cfg, train_data, world)
    if world.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(world.device)
    bar = tqdm(
        range(run.first, cfg.steps),
        desc=name,
        initial=run.first,
        total=cfg.steps,
        disable=world.rank != 0 or not cfg.progress,
        dynamic_ncols=True,
    )
    start = time.perf_counter()
    before = next((t for t in reversed(run.seconds) if math.isfinite(t)), 0.0)  # trained before a resume
    for step in bar:
        loss = _step(run, cfg, world)
        # every rank has batch_size x seq_len tokens: the mean of the ranks' means is the mean over all;
        # the seconds since training began, the ranks' mean (the same number on every rank)
        now = torch.tensor([loss.item(), before + time.perf_counter() - start], dtype=torch.float64)
        mean = world.sum(now.to(world.device)).cpu() / world.size
        run.losses.append(mean[0].item())
        run.seconds.append(mean[1].item())
        bar.set_postfix(loss=f"{run.losses[-1]:.3f}", lr=f"{run.sched.get_last_lr()[0]:.2e}", refresh=False)
        saved = run.checkpoints.after_step(step + 1, run.losses, run.seconds)
        if saved and world.rank == 0:
            bar.write(f"saved {saved}")
    if world.device.type == "cuda":
        torch.cuda.synchronize(world.device)
    train_time = time.perf_counter() - start
    bar.close()
    result = _result(run, cfg, val_data, world, train_time)
    del run
    gc.collect()
    return result


def _result(run: _Run, cfg: TrainConfig, val_data: torch.Tensor, world: World, train_time: float) -> dict:
    """What a finished run reports: its losses and seconds, validation, throughput, weights'
    digests and every rank's memory (collective: validation and the gathers)."""
    final_step = max(run.first, cfg.steps)
    digest = params_sha256(run.model)
    val_loss, val_tokens = evaluate(run.model, val_data, cfg, world)
    tokens = (final_step - run.first) * cfg.batch_size * cfg.seq_len * world.size
    held = held_memory(run.opt)  # between steps: what a rank keeps
    tail = run.losses[-min(TAIL, len(run.losses)) :]
    return {
        "loss": run.losses,
        "time_s": run.seconds,
        "peak_lr": run.sched.base_lrs[0],
        "final_loss": sum(tail) / len(tail),
        "final_loss_steps": len(tail),
        "val_loss": val_loss,
        "val_tokens": val_tokens,
        "tokens_per_s": tokens / train_time if tokens else 0.0,
        "train_time_s": train_time,
        "final_step": final_step,
        "resumed_from_step": run.first,
        "params_sha256": digest,
        "init_params_sha256": run.init_digest,
        "peak_memory": [{"rank": r, **m} for r, m in enumerate(world.gather(peak_memory(world.device)))],
        "held_bytes": world.gather(held),
    }


def train(cfg: TrainConfig, launch_time: float | None = None) -> dict:
    """Train every requested optimizer in turn; rank 0 reports and writes `cfg.out`.

    Returns the summary (the same dict on every rank). `launch_time` (`time.time()`)
    is when the command started, for the reported wall time.
    """
    launch_time = time.time() if launch_time is None else launch_time
    names = optimizer_names(cfg)
    world = World()
    train_data, val_data = load_corpus()
    n_params = sum(p.numel() for p in GPT(cfg.model_config()).parameters())
    if world.rank == 0:
        print(
            f"byte-level GPT, {n_params / 1e6:.2f}M params, on {len(stdlib_files())} stdlib files "
            f"({train_data.numel() / 1e6:.2f} MB train, {val_data.numel() / 1e6:.2f} MB val); "
            f"{world.size} rank(s), {world.backend} on {world.device.type}; {cfg.steps} steps of "
            f"{world.size}x{cfg.batch_size}x{cfg.seq_len} tokens; {SHARDING[cfg.zero]}; "
            f"{PRECISION[param_dtype_name(cfg, world.device)]}; "
            + (f"{', '.join(names)}, each from the same initial weights" if len(names) > 1 else names[0]),
            flush=True,
        )
    with collective_timeout(cfg.timeout, world.backend):
        runs = {name: train_one(name, cfg, train_data, val_data, world) for name in names}
    summary = {
        "config": asdict(cfg),
        "model": asdict(cfg.model_config()),
        "n_params": n_params,
        "world_size": world.size,
        "backend": world.backend,
        "device": world.device.type,
        "param_dtype": param_dtype_name(cfg, world.device),
        "corpus": {
            "files": [f.name for f in stdlib_files()],
            "train_bytes": train_data.numel(),
            "val_bytes": val_data.numel(),
        },
        "runs": runs,
        "wall_time_s": time.time() - launch_time,
    }
    if world.rank == 0:
        write_report(summary, Path(cfg.out))
    return summary


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain, right-aligned text table."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def memory_table(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Per optimizer and rank: the bytes the optimizer holds between steps, and the process peaks."""
    on_gpu = summary["device"] == "cuda"
    held = ["params", "grads", "state", "unsharded"]
    headers = ["optimizer", "rank", *(f"{h} MiB" for h in held), "peak RSS MiB"]
    headers += ["CUDA max alloc MiB"] if on_gpu else []
    headers += ["CPU s"]
    keys = ["parameters", "gradients", "state", "unsharded"]
    rows = []
    for name, r in summary["runs"].items():
        for m, b in zip(r["peak_memory"], r["held_bytes"]):
            cells = [f"{b[k] / 2**20:.2f}" for k in keys] if b is not None else ["-"] * len(keys)
            cuda = [f"{m['cuda_max_allocated_mib']:.0f}"] if on_gpu else []
            rows.append([name, str(m["rank"]), *cells, f"{m['rss_mib']:.0f}", *cuda, f"{m['cpu_s']:.1f}"])
    return headers, rows


def write_report(summary: dict, out: Path) -> None:
    """Print the result and memory tables; write `summary.json` and `loss.png` (loss vs step and
    vs training wall time) into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    runs = summary["runs"]
    rows = [
        [
            name,
            f"{r['final_loss']:.3f}",
            f"{r['val_loss']:.3f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['train_time_s']:.1f}",
        ]
        for name, r in runs.items()
    ]
    print(format_table(["optimizer", "train loss", "val loss", "tokens/s (global)", "train s"], rows))
    first = next(iter(runs.values()))
    print(
        f"train loss: mean next-byte cross-entropy (nats) over every rank's tokens, averaged over the "
        f"last {first['final_loss_steps']} steps; val loss: over {first['val_tokens']:,} held-out tokens "
        "after training"
    )
    starts = {r["init_params_sha256"] for r in runs.values()}
    if len(runs) > 1:
        same = "the same initial weights" if len(starts) == 1 else "DIFFERENT initial weights"
        print(
            f"{', '.join(runs)} trained from {same} (SHA-256 {', '.join(sorted(s[:12] for s in starts))}) "
            "on the same batches"
        )
    print(format_table(*memory_table(summary)))
    print(
        "held between steps, from opt.memory_stats(): parameter and gradient shards (whole parameters "
        "with --zero 2), optimizer state (fp32 masters included), unsharded = gathered parameters or "
        "unreduced gradients still alive; peak RSS: the whole process"
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_losses(summary, out / "loss.png")
    print(
        f"wall time {summary['wall_time_s']:.1f} s; wrote {out / 'summary.json'} and {out / 'loss.png'} "
        "(loss vs step and vs training wall time)"
    )


def smooth(values: list[float], window: int = SMOOTH) -> list[float]:
    """The mean of each value and its neighbours, `window` of them centred on it (fewer at the ends)."""
    half = window // 2
    windows = [values[max(0, i - half) : i + half + 1] for i in range(len(values))]
    return [sum(w) / len(w) for w in windows]


def plot_losses(summary: dict, path: Path) -> None:
    """Training loss of every optimizer against step and against training wall time (each step
    thin, the mean of the last `SMOOTH` steps bold), with its validation loss marked at the end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for name, r in summary["runs"].items():
        steps, loss, seconds = range(1, len(r["loss"]) + 1), r["loss"], r["time_s"]
        label = f"{name} train (each step; mean of {SMOOTH})"
        (line,) = by_step.plot(steps, smooth(loss), lw=1.6, label=label)
        color = line.get_color()
        by_step.plot(steps, loss, lw=0.6, alpha=0.35, color=color)
        by_time.plot(seconds, smooth(loss), lw=1.6, color=color, label=f"{name} train")
        by_time.plot(seconds, loss, lw=0.6, alpha=0.35, color=color)
        val = f"{name} val {r['val_loss']:.3f}"
        by_step.plot([len(loss)], [r["val_loss"]], "o", color=color, label=val)
        by_time.plot([seconds[-1] if seconds else 0.0], [r["val_loss"]], "o", color=color, label=val)
    for ax in (by_step, by_time):
        ax.axhline(math.log(256), color="gray", ls=":", lw=1, label="uniform (ln 256)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    by_step.set(xlabel="step", ylabel="loss (nats / byte)")
    by_time.set(xlabel="training wall time (s)")
    fig.suptitle(
        f"byte-level GPT on stdlib source, {summary['world_size']} rank(s), "
        f"{'ZeRO-3' if summary['config']['zero'] == 3 else 'ZeRO-2'}, from the same initial weights"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
