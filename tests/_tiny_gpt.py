"""A small GPT-like model with tied embeddings, and deterministic per-rank batches."""

import torch
from _reference import mean_grad_reference
from torch import nn
from torch.nn import functional as F

VOCAB, DIM, SEQ = 37, 16, 6


class GPTBlock(nn.Module):
    def __init__(self, dim: int = DIM):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, 3 * dim, bias=False)  # a key bias would get only rounding noise
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        q, k, v = self.attn(self.norm(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlp(x)


class TinyGPT(nn.Module):
    def __init__(self, layers: int = 3, dim: int = DIM, checkpoint: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(GPTBlock(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.checkpoint = checkpoint

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return self.head(self.norm(x))


def build(seed: int = 0, **kwargs) -> TinyGPT:
    torch.manual_seed(seed)
    model = TinyGPT(**kwargs)
    with torch.no_grad():  # give norms non-trivial weights so their gradients matter
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.add_(torch.randn_like(m.weight) * 0.1)
    return model


def batch(step: int, rank: int, micro: int = 0, size: int = 3):
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    tokens = torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(model, inputs, targets):
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def train(model, opt, steps, rank: int, stat: str | None = None, clip: float | None = None) -> list:
    """`opt` trains `model` on this rank's batch of each step number in `steps` (with `clip`, the
    library's `opt.clip_grad_norm_(clip)` before each step); with `stat`, that entry of
    `opt.step_stats` after each step (else nothing)."""
    seen = []
    for t in steps:
        loss_fn(model, *batch(t, rank)).backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
        if stat is not None:
            seen.append(opt.step_stats[stat])
    return seen


def world_grads(model, step: int, world: int, micro: int = 1, reversed_order: bool = False) -> None:
    """Set `model`'s gradients to the mean over `world` ranks of each rank's gradient of
    `step` (its `micro` micro-batches accumulated, each loss divided by `micro` as a rank
    does), reduced as the library reduces it (`_reference.mean_grad_reference`)."""

    def rank_backward(r: int) -> None:
        for m in range(micro):
            (loss_fn(model, *batch(step, r, m)) / micro).backward()

    mean_grad_reference(model.parameters(), world, rank_backward, reversed_order)
