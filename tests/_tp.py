"""The tensor-parallel tests' model, plan and data: a seeded Llama-like block under torch's TP plan
(dp x tp gloo meshes), its batches and loss, the one-process mean gradient over the data-parallel
ranks and torch.optim.AdamW's run on it, the loop that trains the block, and whole tensors out of
DTensor state dicts. Also the block's sequence-parallel form (attention and MLP as modules of their
own) and a block wide enough for 8-bit state."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from _reference import mean_grad_reference
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

DIM, HIDDEN, HEAD, STEPS, BATCH, SEQ = 16, 32, 4, 3, 2, 5
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MUON = dict(lr=0.02, weight_decay=0.1)
MUON_ADAM = dict(lr=0.01, weight_decay=0.05)  # the AdamW group (norms) beside Muon's matrices
PLAN = {
    **{name: ColwiseParallel() for name in ("wq", "wk", "wv", "w1", "w3")},
    **{name: RowwiseParallel() for name in ("wo", "w2")},
}
PROJECTIONS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


class LlamaBlock(nn.Module):
    """A Llama-like block: attention over heads of `HEAD` features, a SwiGLU MLP; under TP
    each rank computes its own heads and hidden features (the views read the local width)."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(DIM), nn.LayerNorm(DIM)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (w(h).view(b, t, -1, HEAD).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(att.transpose(1, 2).reshape(b, t, -1))
        h = self.norm2(x)
        return x + self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h))


def build(block: type[nn.Module] | None = None) -> nn.Module:
    """The block (`block`: another with the same norms, as `SequenceParallelBlock`) under seed 0,
    its norms away from their init so that their gradients matter."""
    torch.manual_seed(0)
    model = (block or LlamaBlock)()
    with torch.no_grad():
        for norm in (model.norm1, model.norm2):
            norm.weight.uniform_(0.5, 1.5)
        model.norm2.bias.uniform_(-0.1, 0.1)
    return model


def batch(step: int, dp_rank: int, seq: int = SEQ, dim: int = DIM) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank `dp_rank`'s inputs and targets at `step` (every TP rank of it the same)."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randn(BATCH, seq, dim, generator=g), torch.randn(BATCH, seq, dim, generator=g)


def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def mean_grad(model: nn.Module, step: int, dp: int, seq: int = SEQ) -> None:
    """One process: `model`'s gradients, the mean over `dp` data-parallel ranks' batches of `step`."""
    mean_grad_reference(model.parameters(), dp, lambda r: loss(model, *batch(step, r, seq)).backward())


def adamw_reference(dp: int = 2, steps: int = STEPS, clip=None, clip_value=None, grads: bool = False) -> dict:
    """One process, the unparallelised model, torch.optim.AdamW on the mean gradient over the
    dp ranks' batches (clipped to norm `clip`: then each step's norm before clipping too, as
    `norm{t}`; or to `clip_value`), and with `grads` the first step's mean gradients as `grad.{name}`."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    extra = {}
    for t in range(steps):
        mean_grad(model, t, dp)
        if t == 0 and grads:
            extra.update({f"grad.{n}": p.grad.clone() for n, p in model.named_parameters()})
        if clip is not None:
            extra[f"norm{t}"] = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        opt.step()
    return {**{k: v.detach().clone() for k, v in model.state_dict().items()}, **extra}


def train(model: nn.Module, opt, dp_rank: int, steps: Iterable[int], stat: str | None = None) -> list:
    """`opt` trains `model` on data-parallel rank `dp_rank`'s batch of each step in `steps`; with
    `stat`, that entry of `opt.step_stats` after each step (else nothing)."""
    seen = []
    for t in steps:
        loss(model, *batch(t, dp_rank)).backward()
        opt.step()
        opt.zero_grad()
        if stat is not None:
            seen.append(opt.step_stats[stat])
    return seen


def mesh(dp: int = 2, tp: int = 2) -> DeviceMesh:
    """The world as a (dp, tp) mesh."""
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def replicated_mesh(shape: tuple[int, int, int]) -> tuple[DeviceMesh, int]:
    """The world as a (dp_replicate, dp_shard, tp) mesh of `shape`, and this rank's data-parallel
    rank over both data-parallel dimensions."""
    world = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    replica, shard = world.get_coordinate()[:2]
    return world, replica * shape[1] + shard


def at_layout(
    dp: int,
    tp: int,
    optimizer: Callable[..., torch.optim.Optimizer],
    weights: dict | None = None,
    parallelize: Callable[[nn.Module, DeviceMesh], nn.Module] | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """The block at (dp, tp), `weights` loaded first: a plain model at tp=1 (every rank a data-parallel
    rank), else under `parallelize(model, tp_mesh)` (torch's PLAN by default); its optimizer
    `optimizer(params, **mesh)` (mesh= the data-parallel mesh under TP); and this rank's dp rank."""
    model = build()
    if weights is not None:
        model.load_state_dict(weights)
    if tp == 1:
        return model, optimizer(model.parameters()), torch.distributed.get_rank()
    world = mesh(dp, tp)
    model = parallelize(model, world["tp"]) if parallelize else parallelize_module(model, world["tp"], PLAN)
    return model, optimizer(model.parameters(), mesh=world["dp"]), world["dp"].get_local_rank()


def full(state: dict) -> dict[str, torch.Tensor]:
    """A state dict's values, DTensors made whole, copied."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def placements(model: nn.Module) -> dict[str, tuple | None]:
    """Each parameter's DTensor placements (None for a plain tensor)."""
    return {n: tuple(p.placements) if isinstance(p, DTensor) else None for n, p in model.named_parameters()}


# --- a block wide enough for 8-bit state ---------------------------------------------------------

# Its 64 x 64 TP shards reach QUANT_MIN_NUMEL (4096) elements, under which state stays in fp32
# (the Llama block's shards are all smaller).
WIDE, WIDE_HIDDEN = 64, 128
WIDE_PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.RMSNorm(WIDE)
        self.up = nn.Linear(WIDE, WIDE_HIDDEN, bias=False)
        self.down = nn.Linear(WIDE_HIDDEN, WIDE, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.silu(self.up(self.norm(x))))


# --- sequence parallelism: the block with its residual stream cut over TP -----------------------

SP_SEQ = 6  # the sequence, cut in two by SP_PLAN's TP size
SP_TP = 2
_GATHER = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
SP_PLAN = {
    "norm1": SequenceParallel(),
    "norm2": SequenceParallel(),
    "attn": _GATHER,
    "mlp": _GATHER,
    **{f"attn.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")},
    **{f"mlp.{n}": ColwiseParallel() for n in ("w1", "w3")},
    "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
    "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
}


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, h):
        b, t, _ = h.shape
        q, k, v = (w(h).view(b, t, -1, HEAD).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(att.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, h):
        return self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h))


class SequenceParallelBlock(nn.Module):
    """`LlamaBlock` with attention and MLP as modules of their own, for PrepareModuleInput (the same
    parameters, drawn in the same order: built alike, the two hold the same values); under SP_PLAN
    its residual stream is each TP rank's sequence shard."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(DIM), nn.LayerNorm(DIM)
        self.attn, self.mlp = Attention(), MLP()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def train_sequence_parallel(
    model: nn.Module, opt, world: DeviceMesh, steps: Iterable[int], clip=None
) -> None:
    """`opt` trains `model` (under SP_PLAN on `world["tp"]`) on each step's batch of this rank's dp
    rank, each TP rank on its sequence shard; with `clip`, torch's clip_grad_norm_ before each step."""
    dp, tp = world["dp"].get_local_rank(), world["tp"].get_local_rank()
    cut = slice(tp * SP_SEQ // SP_TP, (tp + 1) * SP_SEQ // SP_TP)  # this TP rank's sequence shard
    for t in steps:
        x, y = (z[:, cut] for z in batch(t, dp, SP_SEQ))
        # each TP rank's loss over its shard; their sum over TP is the whole mean squared error
        (loss(model, x, y) / SP_TP).backward()
        if clip is not None:  # torch's own: replicated norms (Partial grads summed over TP) count once
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
