"""Fully sharded training under torchrun, with checkpoints that resume at any world size.

    torchrun --nproc-per-node 2 examples/train_torchrun.py --steps 40 --checkpoint-dir ckpt
    torchrun --nproc-per-node 4 examples/train_torchrun.py --steps 80 --checkpoint-dir ckpt  # resumes at 40
    torchrun --nproc-per-node 2 --max-restarts 3 examples/train_torchrun.py --checkpoint-dir ckpt

Every block of a small model, and the model itself, is a unit of `shard_modules`: between
steps each rank holds only its shard of the parameters, gradients and optimizer state
(ZeRO-3). The model is built on the meta device and materialised one unit at a time.
Each process joins torchrun's group through `vo.init_distributed`: NCCL on its own GPU when
there is one, gloo on CPU, under keys of this restart attempt only (a restarted run meets
again). Run without torchrun, it trains in one process with no process group.

A `vescale_optim.CheckpointManager` saves the model, optimizer, schedule and random states
into `step-N` folders (atomically: a folder with that name is complete) and the run starts
from the newest one, so a run that torchrun restarts after a failure continues where it
left off. A rank that dies or hangs makes the others fail within `--timeout` seconds.
"""

from __future__ import annotations

import argparse
import hashlib
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import vescale_optim as vo

VOCAB = 256


class Block(nn.Module):
    """Pre-norm residual MLP."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Model(nn.Module):
    """Token embedding, residual blocks, final norm and a head over the same vocabulary."""

    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def setup(timeout: timedelta) -> tuple[torch.device, int, int]:
    """Join torchrun's process group (when launched by torchrun); this rank's device, rank, world size.

    `vo.init_distributed` joins it under keys of this restart attempt only, so a run that
    `torchrun --max-restarts` restarts meets again (NCCL on cuda:LOCAL_RANK, gloo on CPU).
    `timeout` bounds every collective wait: the process group's own (NCCL, gloo, DCP) and, on
    gloo, the optimizer's (`set_collective_timeout`: its error names the collective)."""
    on_gloo = not torch.cuda.is_available()
    device = vo.init_distributed(timeout=timeout, collective_timeout=timeout if on_gloo else None)
    if not dist.is_initialized():  # plain `python train_torchrun.py`: one process, no group
        return device, 0, 1
    return device, dist.get_rank(), dist.get_world_size()


def batch(step: int, rank: int, args, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of step `step`: random tokens, and as targets a fixed permutation of them."""
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(args.seed))
    g = torch.Generator().manual_seed((args.seed * 1_000_003 + step) * 1_009 + rank)
    tokens = torch.randint(0, VOCAB, (args.batch_size, args.seq_len), generator=g)
    return tokens.to(device), perm[tokens].to(device)


def mean_over_ranks(x: torch.Tensor, world: int) -> float:
    x = x.detach().float().reshape(1).clone()
    if world > 1:
        dist.all_reduce(x)  # every rank has as many tokens: the mean of the ranks' means
    return x.item() / world


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="train until this step (default: %(default)s)")
    p.add_argument("--dim", type=int, default=64, help="model width (default: %(default)s)")
    p.add_argument("--layers", type=int, default=4, help="blocks (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="initial weights and data (default: %(default)s)")
    p.add_argument("--log-every", type=int, default=10, help="steps between lines (default: %(default)s)")
    p.add_argument("--checkpoint-dir", type=Path, help="save step-N folders here; resume from the latest")
    p.add_argument("--save-every", type=int, default=20, help="steps between saves (default: %(default)s)")
    p.add_argument("--async-save", action="store_true", help="write checkpoints while training goes on")
    p.add_argument(
        "--timeout",
        type=float,
        default=60,
        help="seconds a collective may wait for the other ranks before failing (default: %(default)s)",
    )
    args = p.parse_args()

    device, rank, world = setup(timedelta(seconds=args.timeout))
    try:
        # Every rank is initialised from rank 0's random state, so the seed only needs to be
        # set here for the initial weights to be reproducible.
        torch.manual_seed(args.seed)
        with torch.device("meta"):  # no memory: each unit is materialised, then sharded, in turn
            model = Model(args.dim, args.layers)
        opt = vo.AdamW(
            model.parameters(),
            lr=args.lr,
            betas=(0.9, 0.95),
            weight_decay=0.1,
            shard_modules=[*model.layers, model],
            device=device,
        )
        warmup = 10
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
        n_params = sum(p.numel() for p in model.parameters())
        manager, loaded = None, None
        if args.checkpoint_dir:  # keeps the newest 3; every call of it is collective
            manager = vo.CheckpointManager(args.checkpoint_dir, model, opt, sched, async_save=args.async_save)
            loaded = manager.load()  # the newest complete checkpoint, or None
        start = loaded.step if loaded else 0
        if rank == 0:
            origin = f"resumed from {loaded.path}" if loaded else "from scratch"
            where = f"{len(opt.units)} units on {world} rank(s), {device.type}"
            print(f"{n_params:,} parameters in {where}; {origin}", flush=True)

        for step in range(start, args.steps):
            x, y = batch(step, rank, args, device)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()  # each unit's gradients are reduce-scattered into the ranks' shards here
            norm = opt.clip_grad_norm_(1.0)  # over every shard; torch.nn.utils' cannot see them
            opt.step()
            opt.zero_grad()
            sched.step()
            done = step + 1
            if done % args.log_every == 0 or done == args.steps:
                mean = mean_over_ranks(loss, world)
                if rank == 0:
                    print(
                        f"step {done}: loss {mean:.4f} (mean over all ranks' tokens), grad norm "
                        f"{norm.item():.3f}, lr {sched.get_last_lr()[0]:.2e}",
                        flush=True,
                    )
            if manager and (done % args.save_every == 0 or done == args.steps):
                path = manager.save(done)  # with --async-save: returns once this rank's pieces are copied
                if rank == 0:
                    print(f"{'saving' if args.async_save else 'saved'} {path}", flush=True)
        if manager:
            manager.close()  # waits for an asynchronous save to be complete

        weights = model.state_dict()  # collective: full tensors, gathered unit by unit
        if rank == 0:  # equal for equal weights, bit for bit
            data = b"".join(v.float().cpu().numpy().tobytes() for v in weights.values())
            fingerprint = hashlib.sha256(data).hexdigest()[:16]
            memory = ", ".join(f"{k} {v / 2**10:.0f} KiB" for k, v in opt.memory_stats().items())
            print(
                f"done at step {args.steps}; weights fingerprint {fingerprint}; held on rank 0: {memory}",
                flush=True,
            )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
