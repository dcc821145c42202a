"""Pipeline and data parallelism together under torchrun: torch's pipeline schedules, one
vo.AdamW, vo.Muon or vo.Shampoo per stage, checkpoints that resume at another pipeline degree.

    torchrun --nproc-per-node 4 examples/train_pp.py --pp 2 --dp 2 --optimizer muon --checkpoint-dir ckpt
    torchrun --nproc-per-node 4 examples/train_pp.py --pp 1 --dp 4 --optimizer muon --checkpoint-dir ckpt \\
        --steps 40 --resume    # goes on from pp2 x dp2's newest checkpoint, without pipelining

The ranks form a (pp, dp) device mesh. Each pipeline stage is built the torchtitan way: the
whole model with the modules other stages own deleted, so its parameter names stay the whole
model's (`layers.3.qkv.weight` on every layout). Torch's `PipelineStage` and `ScheduleGPipe` or
`Schedule1F1B` run each step's `--microbatches` micro-batches through the stages; with `--pp 1`
there is no pipelining and the model runs the micro-batches one by one. Each stage has its own
optimizer over its data-parallel ranks, `mesh=world["dp"]`, fully sharded (ZeRO-3: a unit per
block and one for the rest of the stage). A step's gradient is the mean over the dp ranks of
the mean over micro-batches, whatever the layout: the data of a step is one global batch of
`--batch-size` sequences, cut into dp shares and those into micro-batches.

A `vescale_optim.CheckpointManager` gets this rank's stage and its optimizer as lists
(`[part]`, `[opt]`), as torchtitan's checkpointer does: every stage writes its own parameters
and optimizer state, keyed by parameter name, into one checkpoint that loads at any other
(pp, dp) layout. `--resume` goes on from the newest checkpoint in `--checkpoint-dir`.

What "resumes exactly" means here, and how it is checked. A layout is also an order of
floating-point additions (dp ranks summed in another order, micro-batches of other sizes),
so a pp1 x dp4 run does not retrace a pp2 x dp2 one bit for bit; it is not meant to. Exact are:
- the load: the run prints a *state fingerprint* whenever it saves and once it has loaded, a
  hash of everything training reads, by parameter name and independent of the layout (every
  parameter, every optimizer state tensor and hyperparameter, the step and the LR schedule's
  position). The fingerprint a pp1 x dp4 run prints after loading pp2 x dp2's step-4 equals
  the one pp2 x dp2 printed when it saved step-4, or a piece of the state was lost;
- the continuation: a resumed run is a run of its own layout from the loaded state, so a run
  of that layout resumed again from one of its own later checkpoints ends with the same losses
  and weights (`weights fingerprint`), bit for bit, as the run that went on without stopping.
tests/integration/test_pp_example.py checks both, saving at pp2 x dp2 and resuming at pp1 x dp4
and at pp4 x dp1.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import vescale_optim as vo

VOCAB = 256
HEAD = 8  # features per attention head
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class Block(nn.Module):
    """Pre-norm causal attention and MLP."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, -1, HEAD).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(att.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    """Embedding, blocks by number (an `nn.ModuleDict`, so deleting some keeps the others'
    names), final norm and head. A stage lacks some of them: `forward` runs what it holds."""

    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim) for i in range(layers)})
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers.values():
            h = layer(h)
        return self.head(self.norm(h)) if self.head is not None else h


def stage_of(model: Model, pp: int, stage: int) -> Model:
    """`model` (changed in place) as pipeline stage `stage` of `pp`: the blocks of the other
    stages deleted, the embedding kept by the first stage only, the norm and head by the last."""
    per = len(model.layers) // pp
    for name in list(model.layers):
        if not stage * per <= int(name) < (stage + 1) * per:
            del model.layers[name]
    if stage > 0:
        model.embed = None
    if stage < pp - 1:
        model.norm = model.head = None
    return model


def build_optimizer(part: Model, name: str, mesh, lr: float, microbatches: int) -> vo.ShardedOptimizer:
    """`name`'s optimizer over one stage, sharded over `mesh` (the stage's data-parallel
    ranks), a unit per block and one for the rest of the stage (ZeRO-3), its gradients reduced
    once per step, in the last micro-batch's backward. Muon takes the blocks' matrices; the
    embedding, head, norms and biases take AdamW."""
    units = dict(mesh=mesh, shard_modules=[*part.layers.values(), part], microbatches=microbatches)
    if name == "adamw":
        return vo.AdamW(part.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, **units)
    if name == "shampoo":
        return vo.Shampoo(part.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, **units)
    hidden = [p for p in part.layers.parameters() if p.ndim == 2]
    rest = [p for p in part.parameters() if all(p is not h for h in hidden)]
    groups = [{"params": hidden}, {"params": rest, "use_muon": False, "lr": lr, "weight_decay": 0.0}]
    return vo.Muon(groups, lr=0.02, weight_decay=0.1, **units)


def batch(step: int, dp_rank: int, dp: int, args, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Dp rank `dp_rank`'s share of step `step`'s global batch (the same whatever the layout):
    random tokens, and as targets a fixed permutation of them."""
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(args.seed))
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    tokens = torch.randint(0, VOCAB, (args.batch_size, args.seq_len), generator=g).chunk(dp)[dp_rank]
    return tokens.to(device), perm[tokens].to(device)


def _digest(value) -> str:
    if isinstance(value, torch.Tensor):
        raw = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        value = (str(value.dtype), tuple(value.shape), hashlib.sha256(raw).hexdigest())
    return hashlib.sha256(repr(value).encode()).hexdigest()


def fingerprints(part: Model, opt, sched, done: int) -> tuple[str, str]:
    """(weights, state): hashes of the whole model's parameters, and of those with every
    optimizer state tensor and hyperparameter by parameter name, the step and the LR
    schedule's position. The same for the same values at any layout. Collective: each stage
    gathers its whole tensors over its dp ranks, then every rank's hashes meet."""
    weights = opt.full_model_state_dict(part)
    saved = opt.state_dict()  # torch's format, whole tensors, by index in param-group order
    names = {id(p): n for n, p in part.named_parameters()}
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    mine = {f"model {n}": _digest(v) for n, v in weights.items()}
    for group in saved["param_groups"]:
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        for i in group["params"]:
            entry = {**hyper, **saved["state"].get(i, {})}
            mine[f"optim {order[i]}"] = _digest([(k, _digest(entry[k])) for k in sorted(entry)])
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    merged: dict[str, str] = {}
    for hashes in every:
        for key, h in hashes.items():
            if merged.setdefault(key, h) != h:
                raise RuntimeError(f"the ranks of a stage hold different values of {key}")
    items = sorted(merged.items())
    weights_hash = _digest([kv for kv in items if kv[0].startswith("model ")])
    return weights_hash[:16], _digest([items, done, sched.last_epoch])[:16]


def forward_backward(part: Model, schedule, pp_rank: int, pp: int, m: int, x, y) -> torch.Tensor | None:
    """One step's forward and backward over `m` micro-batches; the mean loss on the last
    stage (None on the others). Both ways the gradient is that of the mean over micro-batches
    (torch's schedules divide it by `m`)."""
    if schedule is None:  # no pipelining
        total = 0.0
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            loss = F.cross_entropy(part(xm).flatten(0, 1), ym.flatten()) / m
            loss.backward()
            total = total + loss.detach()
        return total
    if pp_rank == 0:
        schedule.step(x)
        return None
    if pp_rank < pp - 1:
        schedule.step()
        return None
    losses: list[torch.Tensor] = []
    schedule.step(target=y, losses=losses)  # each micro-batch's loss
    return torch.stack(losses).mean().detach()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (default: %(default)s)")
    p.add_argument("--dp", type=int, help="data-parallel ranks per stage (default: world size / pp)")
    p.add_argument(
        "--optimizer", choices=["adamw", "muon", "shampoo"], default="adamw", help="(default: %(default)s)"
    )
    p.add_argument(
        "--schedule", choices=list(SCHEDULES), default="1f1b", help="with pp > 1 (default: %(default)s)"
    )
    p.add_argument("--microbatches", type=int, default=4, help="per dp rank and step (default: %(default)s)")
    p.add_argument("--steps", type=int, default=20, help="train until this step (default: %(default)s)")
    p.add_argument("--dim", type=int, default=64, help="model width (default: %(default)s)")
    p.add_argument("--layers", type=int, default=4, help="blocks, a multiple of --pp (default: %(default)s)")
    p.add_argument(
        "--batch-size", type=int, default=32, help="sequences per step, all dp ranks (default: %(default)s)"
    )
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default: %(default)s)")
    p.add_argument(
        "--lr",
        type=float,
        default=3e-3,
        help="AdamW's and Shampoo's peak learning rate (default: %(default)s)",
    )
    p.add_argument(
        "--max-norm",
        type=float,
        default=1.0,
        help="clip the whole model's gradient norm (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="initial weights and data (default: %(default)s)")
    p.add_argument("--log-every", type=int, default=10, help="steps between lines (default: %(default)s)")
    p.add_argument("--checkpoint-dir", type=Path, help="save step-N folders here")
    p.add_argument("--save-every", type=int, default=10, help="steps between saves (default: %(default)s)")
    p.add_argument(
        "--resume", action="store_true", help="go on from the newest checkpoint in --checkpoint-dir"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=60,
        help="seconds a collective may wait for the other ranks before failing (default: %(default)s)",
    )
    return p.parse_args()


def check_layout(args, world_size: int) -> int:
    """The dp size; a SystemExit naming what does not fit."""
    dp = args.dp or world_size // args.pp
    if args.pp * dp != world_size:
        raise SystemExit(f"--pp {args.pp} x --dp {dp} is not the world size {world_size}")
    if args.layers % args.pp:
        raise SystemExit(f"--layers {args.layers} do not split into --pp {args.pp} stages")
    if args.batch_size % (dp * args.microbatches):
        raise SystemExit(
            f"--batch-size {args.batch_size} does not split into dp {dp} x {args.microbatches} micro-batches"
        )
    if args.pp > 1 and args.schedule == "1f1b" and args.microbatches < args.pp:
        raise SystemExit(f"1F1B needs at least --pp {args.pp} micro-batches (or --schedule gpipe)")
    if args.resume and not args.checkpoint_dir:
        raise SystemExit("--resume needs --checkpoint-dir")
    return dp


def train(args, device: torch.device) -> None:
    """Build this rank's stage, its optimizer and schedule; train, log, save (collective)."""
    rank, dp = dist.get_rank(), check_layout(args, dist.get_world_size())
    world = init_device_mesh(device.type, (args.pp, dp), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = world["pp"].get_local_rank(), world["dp"].get_local_rank()
    # the whole model drawn on every rank, so that every layout starts from the same weights
    # (torchtitan builds it on the meta device and initialises each stage's part)
    torch.manual_seed(args.seed)
    part = stage_of(Model(args.dim, args.layers).to(device), args.pp, pp_rank)
    opt = build_optimizer(part, args.optimizer, world["dp"], args.lr, args.microbatches)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    schedule = None
    if args.pp > 1:
        stage = PipelineStage(part, pp_rank, args.pp, device, group=world["pp"].get_group())
        schedule = SCHEDULES[args.schedule](stage, args.microbatches, loss_fn=loss_fn)
    manager, loaded = None, None
    if args.checkpoint_dir:  # every call of it is collective
        manager = vo.CheckpointManager(args.checkpoint_dir, [part], [opt], sched)
        if not args.resume and manager.steps():
            raise SystemExit(f"{args.checkpoint_dir} holds checkpoints: pass --resume, or another directory")
        loaded = manager.load() if args.resume else None
    start = loaded.step if loaded else 0
    how = f"{args.schedule}, {args.microbatches} micro-batches" if args.pp > 1 else "no pipelining"
    origin = f"resumed from {loaded.path}" if start else "from scratch"
    state = f"; state fingerprint {fingerprints(part, opt, sched, start)[1]}" if start else ""
    if rank == 0:
        print(
            f"{args.optimizer} on pp{args.pp} x dp{dp} ({how}), {device.type}; {origin}{state}",
            flush=True,
        )

    for step in range(start, args.steps):
        x, y = batch(step, dp_rank, dp, args, device)
        loss = forward_backward(part, schedule, pp_rank, args.pp, args.microbatches, x, y)
        opt.clip_grad_norm_(args.max_norm, pp_mesh=world["pp"])  # the whole model's norm, every stage
        opt.step()  # the stage's gradients, averaged over its dp ranks, update its shards
        opt.zero_grad()
        sched.step()
        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            # the last stage's loss, averaged over its dp ranks, to rank 0 (on the first stage)
            mean = torch.zeros(1, device=device) if loss is None else loss.reshape(1).float().clone()
            dist.all_reduce(mean)
            if rank == 0:
                print(f"step {done}: loss {mean.item() / dp:.9g} (mean over dp ranks)", flush=True)
        if manager and (done % args.save_every == 0 or done == args.steps):
            path = manager.save(done)
            printed = fingerprints(part, opt, sched, done)[1]
            if rank == 0:
                print(f"saved {path}; state fingerprint {printed}", flush=True)
    if manager:
        manager.close()
    stats = dict(opt.step_stats) if args.optimizer == "muon" else {}
    weights = fingerprints(part, opt, sched, args.steps)[0]
    if rank == 0:
        ns = f"Newton-Schulz on rank 0: {stats.get('ns_matrices')} matrices; " if stats else ""
        memory = ", ".join(f"{k} {v / 2**10:.0f} KiB" for k, v in opt.memory_stats().items())
        print(
            f"done at step {args.steps}; weights fingerprint {weights}; {ns}held on rank 0: {memory}",
            flush=True,
        )
    dist.barrier()  # no rank leaves while a peer's collective over it is in flight


def main() -> None:
    args = parse()
    on_gloo = not torch.cuda.is_available()
    timeout = timedelta(seconds=args.timeout)
    device = vo.init_distributed(timeout=timeout, collective_timeout=timeout if on_gloo else None)
    if not dist.is_initialized():
        raise SystemExit("run it under torchrun, with --pp x --dp ranks")
    try:
        train(args, device)
    finally:
        # the optimizer's hooks form reference cycles: free them, and the process groups they
        # hold, while the group is up (left to interpreter exit, gloo's teardown may abort)
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
