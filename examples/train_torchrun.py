"""Fully sharded training under torchrun, with checkpoints that resume at any world size.

    torchrun --nproc-per-node 2 examples/train_torchrun.py --steps 40 --checkpoint-dir ckpt
    torchrun --nproc-per-node 4 examples/train_torchrun.py --steps 80 --checkpoint-dir ckpt  # resumes at 40

Every block of a small model, and the model itself, is a unit of `shard_modules`: between
steps each rank holds only its shard of the parameters, gradients and optimizer state
(ZeRO-3). The model is built on the meta device and materialised one unit at a time.
Each process joins torchrun's group: NCCL on its own GPU when there is one, gloo on CPU.
Run without torchrun, it trains in one process with no process group.
"""

from __future__ import annotations

import argparse
import os
import re
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
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


def setup() -> tuple[torch.device, int, int]:
    """Join torchrun's process group (when launched by torchrun); this rank's device, rank, world size."""
    if "RANK" not in os.environ:  # plain `python train_torchrun.py`: one process, no group
        return torch.device("cuda" if torch.cuda.is_available() else "cpu"), 0, 1
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=5))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(minutes=5))
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


def latest_checkpoint(root: Path) -> tuple[Path, int] | None:
    """The newest complete `step-N` folder (DCP writes `.metadata` last)."""
    found = [(int(m.group(1)), d) for d in root.glob("step-*")
             if (m := re.fullmatch(r"step-(\d+)", d.name)) and (d / ".metadata").exists()]  # fmt: skip
    return (max(found)[1], max(found)[0]) if found else None


def checkpoint_state(opt: vo.AdamW, sched, step: int) -> dict:
    """What a checkpoint holds: this rank's pieces of the model's parameters and of the
    optimizer state (views of its shards, no copies; the optimizer's part carries the param
    groups' hyperparameters, which the scheduler changes), and the scheduler's state."""
    return {
        "model": opt.sharded_model_state_dict(),
        "optim": opt.sharded_state_dict(),
        "sched": sched.state_dict(),
        "step": step,
    }


def save(path: Path, opt: vo.AdamW, sched, step: int) -> None:
    """Collective: each rank writes only its own pieces."""
    dcp.save(checkpoint_state(opt, sched, step), checkpoint_id=path)


def load(path: Path, opt: vo.AdamW, sched) -> int:
    """Collective, at any world size: read this rank's pieces of the model and optimizer into
    its shards and restore the schedule; returns the step the checkpoint was saved at."""
    state = checkpoint_state(opt, sched, 0)
    dcp.load(state, checkpoint_id=path)
    opt.load_sharded_model_state_dict(state["model"])
    opt.load_sharded_state_dict(state["optim"])
    sched.load_state_dict(state["sched"])
    return state["step"]


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
    args = p.parse_args()

    device, rank, world = setup()
    try:
        # Every rank is initialised from rank 0's random state, so the seed only needs to be
        # set here for the initial weights to be reproducible.
        torch.manual_seed(args.seed)
        with torch.device("meta"):  # no memory: each unit is materialised, then sharded, in turn
            model = Model(args.dim, args.layers)
        opt = vo.AdamW(
            model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
            shard_modules=[*model.layers, model], device=device,
        )  # fmt: skip
        warmup = 10
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
        n_params = sum(p.numel() for p in model.parameters())
        start = 0
        found = latest_checkpoint(args.checkpoint_dir) if args.checkpoint_dir else None
        if found is not None:
            start = load(found[0], opt, sched)
        if rank == 0:
            print(f"{n_params:,} parameters in {len(opt.units)} units on {world} rank(s), {device.type}; "
                  + (f"resumed from {found[0]}" if found else "from scratch"), flush=True)  # fmt: skip

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
                    print(f"step {done}: loss {mean:.4f} (mean over all ranks' tokens), grad norm "
                          f"{norm.item():.3f}, lr {sched.get_last_lr()[0]:.2e}", flush=True)  # fmt: skip
            if args.checkpoint_dir and (done % args.save_every == 0 or done == args.steps):
                save(args.checkpoint_dir / f"step-{done}", opt, sched, done)
                if rank == 0:
                    print(f"saved {args.checkpoint_dir / f'step-{done}'}", flush=True)

        weights = model.state_dict()  # collective: full tensors, gathered unit by unit
        if rank == 0:
            fingerprint = sum(v.double().abs().sum().item() for v in weights.values())
            memory = opt.memory_stats()
            print(f"done at step {args.steps}; weights fingerprint {fingerprint!r}; held on rank 0: "
                  + ", ".join(f"{k} {v / 2**10:.0f} KiB" for k, v in memory.items()), flush=True)  # fmt: skip
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
