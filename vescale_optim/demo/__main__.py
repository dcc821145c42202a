"""`python -m vescale_optim.demo`: train a byte-level GPT on a local world of ranks, with AdamW and
Muon from the same initial weights (by default), and plot their losses against step and wall time.

Spawns `--world-size` CPU ranks joined by gloo (or trains in this process for
`--world-size 1`); under torchrun each process joins the torchrun group instead.
By default every block and the model are units of `shard_modules` (ZeRO-3);
`--zero 2` keeps the parameters whole on every rank. With `--checkpoint-dir` the run
saves checkpoints, and with `--resume` continues from the newest complete one, so that
`torchrun --max-restarts N ... --resume` restarts a failed run where it left off.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import fields

from .config import TrainConfig
from .launch import launch
from .optimizers import DEFAULT_OPTIMIZERS, MUON_VARIANTS, OPTIMIZERS, PARAM_DTYPES, optimizer_names


def build_parser() -> argparse.ArgumentParser:
    """The command line; every option's help shows its default."""
    d = TrainConfig()
    p = argparse.ArgumentParser(
        prog="python -m vescale_optim.demo",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for add_options in (_what_runs, _model_and_batches, _training, _checkpoints):
        add_options(p.add_argument, d)
    return p


def _what_runs(add: Callable, d: TrainConfig) -> None:
    """The world, the optimizers, the sharding and precision, how long, where the report goes."""
    add("--world-size", type=int, default=4, help="ranks to spawn (ignored under torchrun)")
    add(
        "--optimizer",
        "--optimizers",
        metavar="NAME[,NAME...]",
        default=d.optimizer,
        help=f"one of {', '.join(OPTIMIZERS)}, several separated by commas, or 'all'; each trains from the "
        f"same initial weights (default %(default)s: {','.join(DEFAULT_OPTIMIZERS)}, or adamw alone with "
        "--checkpoint-dir)",
    )
    add(
        "--muon-variant",
        choices=list(MUON_VARIANTS),
        default=d.muon_variant,
        help="what 'muon' runs: torch's Newton–Schulz coefficients, Polar Express (ns_coefficients="
        "'polar_express') or NorMuon (normuon=True)",
    )
    add(
        "--zero",
        type=int,
        choices=[2, 3],
        default=d.zero,
        help="3: shard_modules = every block + the model (parameters, gradients and state sharded, "
        "each block gathered for its forward and backward); 2: parameters whole on every rank, "
        "gradients and state sharded",
    )
    add(
        "--param-dtype",
        choices=list(PARAM_DTYPES),
        default=d.param_dtype,
        help="dtype of the gathered parameters and the compute (the optimizers' param_dtype; shards, "
        "fp32 masters, state and the gradient reduction stay fp32) (default %(default)s: bf16 on CUDA, "
        "fp32 on the CPU)",
    )
    add("--steps", type=int, default=d.steps, help="optimizer steps")
    add("--out", default=d.out, help="folder for summary.json and loss.png (loss vs step and vs wall time)")


def _model_and_batches(add: Callable, d: TrainConfig) -> None:
    """The batches and the model's shape."""
    add("--batch-size", type=int, default=d.batch_size, help="sequences per rank per step")
    add("--seq-len", type=int, default=d.seq_len, help="tokens (bytes) per sequence")
    add("--d-model", type=int, default=d.d_model, help="model width")
    add("--n-layers", type=int, default=d.n_layers, help="transformer blocks")
    add("--n-heads", type=int, default=d.n_heads, help="attention heads")


def _training(add: Callable, d: TrainConfig) -> None:
    """The schedule, clipping, validation, seed and progress bar."""
    add(
        "--lr",
        type=float,
        default=d.lr,
        help="peak LR (default %(default)s: each optimizer's own (adamw 3e-3; muon 0.02 for matrices, 3e-3 "
        "for the rest; shampoo 3e-3; soap 1e-2))",
    )
    add("--warmup", type=int, default=d.warmup, help="linear warmup steps before the cosine")
    add("--grad-clip", type=float, default=d.grad_clip, help="global gradient-norm clip")
    add("--val-tokens", type=int, default=d.val_tokens, help="validation tokens scored at the end")
    add("--seed", type=int, default=d.seed, help="initial weights and batches")
    add("--progress", action=argparse.BooleanOptionalAction, default=d.progress, help="rank 0's progress bar")


def _checkpoints(add: Callable, d: TrainConfig) -> None:
    """Saving, resuming, and how long a collective may wait."""
    add(
        "--checkpoint-dir",
        metavar="DIR",
        default=d.checkpoint_dir,
        help="save checkpoints into DIR/step-N (of one optimizer)",
    )
    add(
        "--checkpoint-every",
        metavar="N",
        type=int,
        default=d.checkpoint_every,
        help="steps between checkpoints (and one at the last step)",
    )
    add(
        "--resume",
        action="store_true",
        default=d.resume,
        help="continue from the newest complete checkpoint in --checkpoint-dir, if there is one",
    )
    add(
        "--timeout",
        metavar="SECONDS",
        type=float,
        default=d.timeout,
        help="seconds a collective may wait for the other ranks before failing with an error that "
        "names it (the process group's timeout; on gloo also vescale_optim.set_collective_timeout)",
    )


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, int]:
    """The run's `TrainConfig` and the number of ranks to spawn."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.world_size < 1:
        p.error("--world-size must be at least 1")
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)})
    try:
        optimizer_names(cfg)
    except ValueError as e:
        p.error(str(e))
    if cfg.timeout <= 0:
        p.error("--timeout must be positive")
    return cfg, args.world_size


def main(argv: list[str] | None = None) -> None:
    launch_time = time.time()
    cfg, world_size = parse_args(argv)
    launch(cfg, world_size, launch_time)


if __name__ == "__main__":
    main()
