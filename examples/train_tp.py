"""Tensor and data parallelism together under torchrun: torch's TP plan, vo.AdamW or vo.Muon.

    torchrun --nproc-per-node 4 examples/train_tp.py --tp 2 --optimizer muon --checkpoint-dir ckpt
    torchrun --nproc-per-node 8 examples/train_tp.py --tp 2 --steps 80 --checkpoint-dir ckpt

The ranks form a (dp, tp) device mesh. Each block of a small Llama-like model (attention
wq/wk/wv/wo, a SwiGLU MLP w1/w2/w3, RMSNorm) is tensor-parallelised with torch's own
`parallelize_module` on world["tp"] (ColwiseParallel wq/wk/wv/w1/w3, RowwiseParallel wo/w2:
each TP rank computes its own heads and hidden features). The optimizer gets the
data-parallel dimension, `mesh=world["dp"]`, as `fully_shard` would, and shards each TP
rank's local parameters over it, one unit per block (ZeRO-3). With `--optimizer muon` each
full matrix (all its TP shards) is orthogonalized exactly once in the dp x tp world; the
embedding, the head and the norms, left out of the plan, take AdamW.

A `vescale_optim.CheckpointManager` saves into `step-N` folders and the run resumes from the
newest one, exactly: a resumed run ends with the weights of one that never stopped.
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import vescale_optim as vo

VOCAB = 256
HEAD = 8  # features per attention head
PLAN = {
    **{name: ColwiseParallel() for name in ("wq", "wk", "wv", "w1", "w3")},
    **{name: RowwiseParallel() for name in ("wo", "w2")},
}


class Block(nn.Module):
    """Pre-norm attention and SwiGLU MLP. The views read the local width, so under TP each
    rank runs its own heads and hidden features; wo and w2 sum the ranks' parts."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(dim, 4 * dim, bias=False)
        self.w2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (w(h).view(b, t, -1, HEAD).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(att.transpose(1, 2).reshape(b, t, -1))
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Model(nn.Module):
    """Token embedding, blocks, final norm and a head over the same vocabulary."""

    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build_optimizer(model: Model, name: str, mesh, lr: float) -> torch.optim.Optimizer:
    """`name` ("adamw" or "muon") over `model`'s parameters, sharded over `mesh` (the
    data-parallel mesh), a unit per block and one for the rest (ZeRO-3)."""
    units = [*model.layers, model]
    if name == "adamw":
        return vo.AdamW(
            model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, mesh=mesh, shard_modules=units
        )
    # the TP-cut matrices take Muon; the embedding, head and norms (plain tensors) AdamW
    cut = [p for p in model.parameters() if isinstance(p, DTensor)]
    rest = [p for p in model.parameters() if not isinstance(p, DTensor)]
    groups = [{"params": cut}, {"params": rest, "use_muon": False, "lr": lr, "weight_decay": 0.0}]
    return vo.Muon(groups, lr=0.02, weight_decay=0.1, mesh=mesh, shard_modules=units)


def batch(step: int, dp_rank: int, args, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of data-parallel rank `dp_rank` at `step` (the same on each of its TP ranks):
    random tokens, and as targets a fixed permutation of them."""
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(args.seed))
    g = torch.Generator().manual_seed((args.seed * 1_000_003 + step) * 1_009 + dp_rank)
    tokens = torch.randint(0, VOCAB, (args.batch_size, args.seq_len), generator=g)
    return tokens.to(device), perm[tokens].to(device)


def fingerprint(model: nn.Module) -> str:
    """A hash of the whole weights (collective: each DTensor's full tensor)."""
    state = model.state_dict()  # DTensors with their TP placements, gathered over dp
    full = [v.full_tensor() if isinstance(v, DTensor) else v for v in state.values()]
    data = b"".join(v.detach().float().cpu().numpy().tobytes() for v in full)
    return hashlib.sha256(data).hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw", help="(default: %(default)s)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default: %(default)s)")
    p.add_argument("--steps", type=int, default=20, help="train until this step (default: %(default)s)")
    p.add_argument("--dim", type=int, default=64, help="model width (default: %(default)s)")
    p.add_argument("--layers", type=int, default=2, help="blocks (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per dp rank (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak learning rate (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="initial weights and data (default: %(default)s)")
    p.add_argument("--log-every", type=int, default=10, help="steps between lines (default: %(default)s)")
    p.add_argument("--checkpoint-dir", type=Path, help="save step-N folders here; resume from the latest")
    p.add_argument("--save-every", type=int, default=10, help="steps between saves (default: %(default)s)")
    p.add_argument(
        "--timeout",
        type=float,
        default=60,
        help="seconds a collective may wait for the other ranks before failing (default: %(default)s)",
    )
    args = p.parse_args()

    on_gloo = not torch.cuda.is_available()
    timeout = timedelta(seconds=args.timeout)
    device = vo.init_distributed(timeout=timeout, collective_timeout=timeout if on_gloo else None)
    if not dist.is_initialized():
        p.error("run it under torchrun, with a multiple of --tp ranks")
    try:
        world_size, rank = dist.get_world_size(), dist.get_rank()
        if world_size % args.tp:
            raise SystemExit(f"{world_size} ranks do not split into tp={args.tp}")
        world = init_device_mesh(device.type, (world_size // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(args.seed)  # the same weights on every rank before the plan cuts them
        model = Model(args.dim, args.layers).to(device)
        for block in model.layers:
            parallelize_module(block, world["tp"], PLAN)
        opt = build_optimizer(model, args.optimizer, world["dp"], args.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        manager, loaded = None, None
        if args.checkpoint_dir:  # every call of it is collective
            manager = vo.CheckpointManager(args.checkpoint_dir, model, opt, sched)
            loaded = manager.load()  # the newest complete checkpoint, or None
        start = loaded.step if loaded else 0
        if rank == 0:
            origin = f"resumed from {loaded.path}" if loaded else "from scratch"
            print(
                f"{args.optimizer} on dp{world_size // args.tp} x tp{args.tp}, {device.type}; {origin}",
                flush=True,
            )

        dp_rank = world["dp"].get_local_rank()
        for step in range(start, args.steps):
            x, y = batch(step, dp_rank, args, device)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            # torch's own clipping: the whole model's norm (TP shards summed over tp, plain ones once)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            sched.step()
            done = step + 1
            if done % args.log_every == 0 or done == args.steps:
                mean = loss.detach().reshape(1).clone()
                dist.all_reduce(mean, group=world["dp"].get_group())  # TP ranks hold the same loss
                if rank == 0:
                    print(
                        f"step {done}: loss {mean.item() / world['dp'].size():.4f} (mean over dp ranks), "
                        f"grad norm {norm.item():.3f}",
                        flush=True,
                    )
            if manager and (done % args.save_every == 0 or done == args.steps):
                path = manager.save(done)
                if rank == 0:
                    print(f"saved {path}", flush=True)
        if manager:
            manager.close()
        stats = dict(opt.step_stats) if args.optimizer == "muon" else {}
        printed = fingerprint(model)
        if rank == 0:
            ns = f"Newton-Schulz on rank 0: {stats.get('ns_matrices')} matrices; " if stats else ""
            memory = ", ".join(f"{k} {v / 2**10:.0f} KiB" for k, v in opt.memory_stats().items())
            print(
                f"done at step {args.steps}; weights fingerprint {printed}; {ns}held on rank 0: {memory}",
                flush=True,
            )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
