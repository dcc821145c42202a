"""A Hugging Face Llama, fully sharded, trained with Muon, checkpointed, and saved as a
Hugging Face folder.

    torchrun --nproc-per-node 2 examples/hf_llama.py --steps 40 --checkpoint-dir ckpt --out hf
    torchrun --nproc-per-node 2 examples/hf_llama.py --steps 80 --checkpoint-dir ckpt --out hf  # from 40
    python -c "import transformers; print(transformers.AutoModelForCausalLM.from_pretrained('hf'))"

The model is a small `LlamaForCausalLM` built from a `LlamaConfig` (no download) on the meta
device. Every decoder layer, and the model itself (embeddings, final norm, head), is a unit
of `shard_modules`: between steps each rank holds only its shard of the parameters,
gradients and optimizer state (ZeRO-3). The units are materialised one at a time by
transformers' own `model._init_weights` (`param_init_fn`), rotary `inv_freq` included.

`vo.muon_param_groups` gives the attention and MLP matrices to Muon and the embeddings
(tied with the head), the norms and anything excluded to AdamW. A `vo.CheckpointManager`
saves the model, optimizer, schedule and random states every `--save-every` steps into
atomic `step-N` folders, and the run resumes from the newest one. At the end the weights
are gathered to rank 0 (a collective call) and rank 0 writes `--out` with `save_pretrained`:
`model.save_pretrained(out)` on rank 0 alone would call the collective `model.state_dict()`
there only and wait for the other ranks forever.

The data is learnable and needs no download: each sequence starts at a random token and
follows a fixed random successor of each token, so the loss falls from ln(vocab) toward 0.
Run without torchrun, it trains in one process with no process group (gloo on CPU, NCCL
with one GPU per process under torchrun).
"""

from __future__ import annotations

import argparse
import hashlib
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import vescale_optim as vo


def setup(timeout: timedelta) -> tuple[torch.device, int, int]:
    """Join torchrun's process group (when launched by torchrun); this rank's device, rank, world size.

    `vo.init_distributed` joins it under keys of this restart attempt only, so a run that
    `torchrun --max-restarts` restarts meets again (NCCL on cuda:LOCAL_RANK, gloo on CPU).
    `timeout` bounds the process group's waits and, on gloo, the optimizer's too."""
    on_gloo = not torch.cuda.is_available()
    device = vo.init_distributed(timeout=timeout, collective_timeout=timeout if on_gloo else None)
    if not dist.is_initialized():  # plain `python hf_llama.py`: one process, no group
        return device, 0, 1
    return device, dist.get_rank(), dist.get_world_size()


def config(args) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def batch(step: int, rank: int, args, device: torch.device) -> torch.Tensor:
    """This rank's sequences of step `step`: a random first token, then each token's fixed successor."""
    successor = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(args.seed))
    g = torch.Generator().manual_seed((args.seed * 1_000_003 + step) * 1_009 + rank)
    tokens = [torch.randint(0, args.vocab, (args.batch_size,), generator=g)]
    for _ in range(args.seq_len - 1):
        tokens.append(successor[tokens[-1]])
    return torch.stack(tokens, dim=1).to(device)


def mean_over_ranks(x: torch.Tensor, world: int) -> float:
    x = x.detach().float().reshape(1).clone()
    if world > 1:
        dist.all_reduce(x)  # every rank has as many tokens: the mean of the ranks' means
    return x.item() / world


def fingerprint(weights: dict) -> str:
    """Equal for equal weights, bit for bit."""
    data = b"".join(v.float().cpu().numpy().tobytes() for v in weights.values())
    return hashlib.sha256(data).hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="train until this step (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (default: %(default)s)")
    p.add_argument("--intermediate", type=int, default=176, help="MLP size (default: %(default)s)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default: %(default)s)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default: %(default)s)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--lr", type=float, default=0.02, help="Muon's peak learning rate (default: %(default)s)")
    p.add_argument("--adamw-lr", type=float, default=3e-3, help="the AdamW group's (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="initial weights and data (default: %(default)s)")
    p.add_argument("--log-every", type=int, default=10, help="steps between lines (default: %(default)s)")
    p.add_argument("--checkpoint-dir", type=Path, help="save step-N folders here; resume from the latest")
    p.add_argument("--save-every", type=int, default=20, help="steps between saves (default: %(default)s)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("hf_llama"),
        help="the Hugging Face folder written at the end (default: %(default)s)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=60,
        help="seconds a collective may wait for the other ranks before failing (default: %(default)s)",
    )
    args = p.parse_args()

    device, rank, world = setup(timedelta(seconds=args.timeout))
    try:
        # Every rank is initialised from rank 0's random state: the seed matters there only.
        torch.manual_seed(args.seed)
        with torch.device("meta"):  # no memory: each unit is materialised, then sharded, in turn
            model = LlamaForCausalLM(config(args))
        groups = vo.muon_param_groups(model, exclude=["lm_head"], adamw_lr=args.adamw_lr)  # head: AdamW
        opt = vo.Muon(
            groups,
            lr=args.lr,
            weight_decay=0.1,
            shard_modules=[*model.model.layers, model],
            device=device,
            param_init_fn=model._init_weights,  # transformers' initialisation, one unit at a time
        )
        warmup = 10
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
        manager, loaded = None, None
        if args.checkpoint_dir:  # keeps the newest 3; every call of it is collective
            manager = vo.CheckpointManager(args.checkpoint_dir, model, opt, sched)
            loaded = manager.load()  # the newest complete checkpoint, or None
        start = loaded.step if loaded else 0
        if rank == 0:
            n_params = sum(p.numel() for p in model.parameters())
            origin = f"resumed from {loaded.path}" if loaded else "from scratch"
            where = f"{len(opt.units)} units on {world} rank(s), {device.type}"
            print(f"{n_params:,} parameters in {where}; {origin}", flush=True)

        model.train()
        for step in range(start, args.steps):
            tokens = batch(step, rank, args, device)
            loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss  # labels shift inside
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
                path = manager.save(done)
                if rank == 0:
                    print(f"saved {path}", flush=True)
        if manager:
            manager.close()

        # Collective: every rank sends its shards, rank 0 alone receives the full (CPU) tensors.
        # `model.state_dict()` works too (every rank then holds the whole model).
        weights = opt.full_model_state_dict(to_rank=0)
        if rank == 0:
            print(
                f"done at step {args.steps}; weights fingerprint {fingerprint(weights)}; writing {args.out}",
                flush=True,
            )
            model.save_pretrained(args.out, state_dict=weights)  # never without state_dict= here
            print(f"wrote {args.out}", flush=True)  # (save_pretrained empties the dict it is given)
        if world > 1:
            dist.barrier()  # the folder is complete before any rank goes on
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
