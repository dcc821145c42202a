"""`python -m vescale_optim.demo`: train a byte-level GPT on a local world of ranks.

Spawns `--world-size` CPU ranks joined by gloo (or trains in this process for
`--world-size 1`); under torchrun each process joins the torchrun group instead.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import fields

from .launch import launch
from .optimizers import OPTIMIZERS
from .train import TrainConfig


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, int]:
    """The run's `TrainConfig` and the number of ranks to spawn."""
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m vescale_optim.demo", description=__doc__)
    p.add_argument("--world-size", type=int, default=4, help="ranks to spawn (ignored under torchrun)")
    p.add_argument(
        "--optimizer",
        choices=[*OPTIMIZERS, "all"],
        default=d.optimizer,
        help="'all' trains each registered optimizer from the same initial weights",
    )
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--out", default=d.out, help="folder for summary.json and loss.png")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--d-model", type=int, default=d.d_model)
    p.add_argument("--n-layers", type=int, default=d.n_layers)
    p.add_argument("--n-heads", type=int, default=d.n_heads)
    p.add_argument("--lr", type=float, default=d.lr, help="peak LR (default: each optimizer's own)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="linear warmup steps before the cosine")
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="global gradient-norm clip")
    p.add_argument("--val-tokens", type=int, default=d.val_tokens, help="validation tokens scored at the end")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    args = p.parse_args(argv)
    if args.world_size < 1:
        p.error("--world-size must be at least 1")
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    return cfg, args.world_size


def main(argv: list[str] | None = None) -> None:
    launch_time = time.time()
    cfg, world_size = parse_args(argv)
    launch(cfg, world_size, launch_time)


if __name__ == "__main__":
    main()
