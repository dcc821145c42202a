"""A small GPT-like model, learnable random batches and a local gloo launcher for benchmarks.

    model = build_gpt()                          # ~34 M parameters: vocab 8192, d 512, 8 layers
    param_count(model)                           # 33.8 M
    x, y = random_batch(2, 64, 8192, seed=0)     # token ids [2, 64] and next-token targets
    loss = model.loss(x, y)                      # mean cross-entropy
    results = launch(fn, 4, arg1, arg2)          # fn(rank, world, arg1, arg2) on every rank

The model is the demo's pre-norm decoder (`vescale_optim.demo.model.GPT`) at benchmark
sizes: token + learned position embeddings, `n_layers` blocks of [LayerNorm, causal
self-attention, LayerNorm, GELU MLP 4x], a final LayerNorm and an untied head.
`model.blocks` is an `nn.ModuleList`, so FSDP-style wrappers can shard per block.
Construction is seeded: the same arguments give the same weights in every process.

`random_batch` draws sequences that a model can learn (each token is a fixed affine map of
the previous one, with a little noise), so a working optimizer lowers the loss within a few
steps and a broken one shows.

`launch` starts `world_size` processes with `torch.multiprocessing` (forkserver), each with
`max(1, cpus // world_size)` intra-op threads (cpus = those this process may run on), a gloo
process group from a file store, and returns `[fn(0, world, *args), ..., fn(W-1, ...)]`.
Every call is a fresh set of processes, so per-process measurements (peak RSS) don't mix.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from vescale_optim.demo.model import GPT, GPTConfig

__all__ = ["GPT", "build_gpt", "cpus", "launch", "param_count", "random_batch", "threads_per_rank"]


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


def cpus() -> int:
    """CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_per_rank(world_size: int) -> int:
    return max(1, cpus() // world_size)


def _worker(rank: int, fn: Callable, world: int, tmp: str, args: tuple) -> None:
    torch.set_num_threads(threads_per_rank(world))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(tmp, 'store')}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=900),
    )
    try:
        result = fn(rank, world, *args)
        with open(os.path.join(tmp, f"result{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    start_method: str = "forkserver",
    preload: Sequence[str] = (),
) -> list:
    """Run `fn(rank, world_size, *args)` on a fresh local gloo world; return its results by rank.

    `fn` must be picklable (a module-level function) and its result too.

    The default start method, forkserver, imports torch once in a clean server process
    and forks every rank from it, which saves seconds per rank over spawn when importing
    torch is slow; the ranks are still fresh processes. `preload` names more modules for the
    server to import (e.g. `torch._dynamo`, which DDP and FSDP2 import on first use and which
    takes seconds); it only counts before the server starts, i.e. at the first launch."""
    if start_method == "forkserver":
        mp.set_forkserver_preload(["torch", "torch.distributed", __name__, *preload])
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker, args=(fn, world_size, tmp, args), nprocs=world_size, join=True, start_method=start_method
        )
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"result{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
