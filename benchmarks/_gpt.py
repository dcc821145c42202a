"""A small GPT-like model, learnable random batches and a local gloo launcher for benchmarks.

    model = shaped_gpt(shape)                    # of a benchmark's shape dict (batch and seq left out)
    model = build_gpt()                          # ~34 M parameters: vocab 8192, d 512, 8 layers
    x, y = random_batch(2, 64, 8192, seed=0)     # token ids [2, 64] and next-token targets
    loss = gpt_loss(DDP(model), x, y)            # model.loss(x, y), through a wrapper
    results = launch(fn, 4, arg1, arg2)          # fn(rank, world, arg1, arg2) on every rank

The model is the demo's pre-norm decoder (`vescale_optim.demo.model.GPT`) at benchmark sizes,
seeded (the same weights in every process); `model.blocks` is an `nn.ModuleList`, so wrappers can
shard per block. `random_batch` draws sequences a model can learn (each token a fixed affine map of
the previous one, with a little noise), so a working optimizer lowers the loss within a few steps.
`launch` starts a fresh gloo world of `world_size` ranks, `max(1, cpus // world_size)` intra-op
threads each, and returns their results by rank with `.threads` (what each rank's
`torch.get_num_threads()` said): every call its own processes, so per-process peaks don't mix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from vescale_optim.demo.model import GPT, GPTConfig
from vescale_optim.local_world import run_local, threads_per_rank

# What the peers import on first use, imported once by the fork server instead of by every rank of
# every world: `torch._dynamo` (DDP and FSDP2 pull it in; it takes seconds) is named here only to be
# imported early, no benchmark reads or patches anything in it.
PEERS = ["torch._dynamo", "torch.nn.parallel", "vescale_optim"]
PEERS += [f"torch.distributed.{m}" for m in ("fsdp", "tensor", "optim", "checkpoint")]


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build_gpt(
    vocab: int = 8192,
    d_model: int = 512,
    n_layers: int = 8,
    n_heads: int = 8,
    seq_len: int = 256,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> GPT:
    """A seeded GPT-like model (the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(
            GPTConfig(vocab_size=vocab, seq_len=seq_len, d_model=d_model, n_layers=n_layers, n_heads=n_heads)
        )
    return model.to(dtype=dtype, device=device)


def shaped_gpt(shape: dict, **kwargs: Any) -> GPT:
    """`build_gpt` of a benchmark's shape (`vocab`, `d_model`, `n_layers`, `n_heads`, `seq_len`; its
    batch keys are not the model's), with `kwargs` (`seed`, `dtype`, `device`)."""
    return build_gpt(*(shape[k] for k in ("vocab", "d_model", "n_layers", "n_heads", "seq_len")), **kwargs)


def gpt_loss(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`GPT.loss` (mean cross-entropy) through `module`: the GPT, or a wrapper that calls it (DDP)."""
    return F.cross_entropy(module(x).flatten(0, 1).float(), y.flatten())


def random_batch(
    batch: int, seq: int, vocab: int, seed: int, noise: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids `[batch, seq]` and next-token targets `[batch, seq]`, both int64.

    Each sequence starts at a random token; the next token is `(5 * prev + 3) % vocab`,
    replaced by a uniformly random one with probability `noise`. Deterministic in `seed`."""
    gen = torch.Generator().manual_seed(seed)
    toks = torch.empty(batch, seq + 1, dtype=torch.long)
    toks[:, 0] = torch.randint(vocab, (batch,), generator=gen)
    rand = torch.randint(vocab, (batch, seq), generator=gen)
    flip = torch.rand(batch, seq, generator=gen) < noise
    for t in range(seq):
        nxt = (5 * toks[:, t] + 3) % vocab
        toks[:, t + 1] = torch.where(flip[:, t], rand[:, t], nxt)
    return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()


class Ranks(list):
    """Per-rank results, in rank order, with each rank's `torch.get_num_threads()` (`threads`)."""

    threads: list[int]


def _ranked(fn: Callable, args: tuple) -> tuple[int, Any]:
    result = fn(dist.get_rank(), dist.get_world_size(), *args)
    return torch.get_num_threads(), result


def launch(
    fn: Callable[..., Any], world_size: int, *args: Any, preload: Sequence = (), timeout=3600.0
) -> Ranks:
    """Run `fn(rank, world_size, *args)` on a fresh local gloo world; return its results by rank.

    `fn` must be picklable (a module-level function) and its result too. The world is
    `vescale_optim.local_world.run_local`'s: ranks forked from a server that imported torch,
    this module, `PEERS` and `preload` once (only the first world of a process starts it), a
    rank that raises fails the call with its traceback, and a call longer than `timeout`
    seconds kills the world and raises `TimeoutError`."""
    threads, preload = threads_per_rank(world_size), [__name__, *PEERS, *preload]
    world = dict(timeout=timeout, threads=threads, preload=preload, collective_timeout=900.0)
    out = run_local(_ranked, world_size, fn, args, **world)
    results = Ranks(r for _, r in out)
    results.threads = [t for t, _ in out]
    return results
