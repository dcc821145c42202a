"""Models, data, optimizers and a world of one for `benchmarks/gpu_check.py`.

`Net` is a small pre-norm residual MLP language model: an embedding, optionally a rotary
embedding (a module holding only a buffer, `inv_freq`, computed in `reset_parameters()`),
`n_blocks` blocks (LayerNorm, Linear up, GELU, Linear down, dropout), a final norm and a
head. Units: every block, and the model for the rest (`shard_modules=[*model.blocks, model]`).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import sys
import tempfile
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._gpu_stages import ROOT

VOCAB = 256
TIMEOUT_S = 60  # every collective of a stage: the process group's timeout (and, on gloo, the library's)

ADAMW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
MUON_AUX = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)  # the AdamW group of vo.Muon
# Roots in float64 from two steps of gradients, as tests/units/test_fsdp.py. epsilon 1e-6, not the
# default 1e-12: the factors are fp32, so their eigenvalues below ~1e-7 of the largest are
# rounding noise, which a tiny epsilon lets the inverse fourth root amplify (differently in two
# correct implementations: one fused baddbmm here, a multiply and an add in the reference).
SHAMPOO = dict(
    lr=1e-2, max_preconditioner_dim=32, precondition_frequency=2, epsilon=1e-6, root_dtype=torch.float64
)
KINDS = ("adamw32", "adamw8", "muon", "shampoo")


class Rotary(nn.Module):
    """Rotary position embedding: no parameters, one non-persistent buffer made in `reset_parameters()`."""

    def __init__(self, dim: int, base: float = 10_000.0):
        super().__init__()
        self.dim, self.base = dim, base
        self.register_buffer("inv_freq", torch.empty(dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            steps = torch.arange(0, self.dim, 2, dtype=torch.float32, device=self.inv_freq.device)
            self.inv_freq.copy_(1.0 / self.base ** (steps / self.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.arange(x.shape[-2], dtype=torch.float32, device=x.device)
        freqs = torch.outer(t, self.inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, dim: int, dropout: float = 0.0):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, dim: int, n_blocks: int, dropout: float = 0.0, rotary: bool = True):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.rotary = Rotary(dim) if rotary else None
        self.blocks = nn.ModuleList(Block(dim, dropout) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.rotary is not None:
            x = self.rotary(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(dim: int, n_blocks: int, device: torch.device, seed: int = 0, **kw) -> Net:
    """`Net` built normally on `device` under `seed`, norms given non-trivial weights."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Net(dim, n_blocks, **kw)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.add_(0.1 * torch.randn_like(m.weight))
    return model


def batch(step: int, size: tuple[int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s tokens and next-token targets, the same on every device."""
    b, t = size
    tokens = torch.randint(0, VOCAB, (b, t + 1), generator=torch.Generator().manual_seed(1_000 + step))
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def train(model: nn.Module, opts: list, steps: range, size: tuple[int, int], device: torch.device) -> list:
    """`opts` train `model` on the batches of `steps`; the losses (tensors, nothing read back)."""
    losses = []
    for t in steps:
        loss = loss_of(model, *batch(t, size, device))
        loss.backward()
        for opt in opts:
            opt.step()
        for opt in opts:
            opt.zero_grad() if hasattr(opt, "zero_grad") else model.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


def shard_kw(model: Net, sharding: str) -> dict:
    return {"shard_modules": [*model.blocks, model]} if sharding == "zero3" else {}


def make_ours(kind: str, model: Net, sharding: str, **kw):
    import vescale_optim as vo

    kw = {**shard_kw(model, sharding), **kw}
    if kind in ("adamw32", "adamw8"):
        return vo.AdamW(model.parameters(), **ADAMW, state_bits=32 if kind == "adamw32" else 8, **kw)
    if kind == "muon":
        groups = vo.muon_param_groups(
            model, exclude=[model.head], adamw_lr=MUON_AUX["lr"], adamw_weight_decay=MUON_AUX["weight_decay"]
        )
        return vo.Muon(groups, **MUON, betas=MUON_AUX["betas"], **kw)
    if kind == "shampoo":
        return vo.Shampoo(model.parameters(), **SHAMPOO, **kw)
    raise ValueError(kind)


def make_reference(kind: str, model: Net) -> list:
    """torch.optim.AdamW, torch.optim.Muon (+ AdamW for the rest) or the plain Shampoo of
    tests/_shampoo_reference.py, on the same split as ours."""
    import vescale_optim as vo

    if kind in ("adamw32", "adamw8"):
        return [torch.optim.AdamW(model.parameters(), **ADAMW)]
    if kind == "muon":
        muon, rest = vo.muon_param_groups(model, exclude=[model.head])
        return [torch.optim.Muon(muon["params"], **MUON), torch.optim.AdamW(rest["params"], **MUON_AUX)]
    if kind == "shampoo":
        sys.path.insert(0, str(ROOT / "tests"))
        from _shampoo_reference import ReferenceShampoo

        return [
            _OnDevice(ReferenceShampoo(list(model.parameters()), **SHAMPOO), next(model.parameters()).device)
        ]
    raise ValueError(kind)


class _OnDevice:
    """The reference Shampoo makes its factors with plain `torch.zeros`: make them on the model's device."""

    def __init__(self, opt, device: torch.device):
        self.opt, self.device = opt, device

    def step(self) -> None:
        with torch.device(self.device):
            self.opt.step()


def muon_matrices(model: Net) -> int:
    """How many matrices `vo.muon_param_groups` gives Muon here (a stack's slices count one each)."""
    import vescale_optim as vo

    muon, _ = vo.muon_param_groups(model, exclude=[model.head])
    return sum(math.prod(p.shape[:-2]) for p in muon["params"])


def muon_max_adjusted_lr(model: Net) -> float:
    """The largest learning rate torch.optim.Muon applies to a matrix here (`adjust_lr_fn=None`:
    lr * sqrt(max(1, rows / cols)))."""
    import vescale_optim as vo

    muon, _ = vo.muon_param_groups(model, exclude=[model.head])
    return max(MUON["lr"] * math.sqrt(max(1.0, p.shape[0] / p.shape[1])) for p in muon["params"])


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` as fp32 CPU tensors (collective with `shard_modules`)."""
    return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}


def max_diff(got: dict, want: dict) -> tuple[float, str]:
    """The largest |got - want| over every entry, and where (NaN anywhere counts as inf)."""
    if got.keys() != want.keys():
        raise AssertionError(f"keys differ: {sorted(set(got) ^ set(want))}")
    worst, where = 0.0, ""
    for k in want:
        d = (got[k].float() - want[k].float()).abs()
        value = math.inf if bool(torch.isnan(d).any()) else float(d.max()) if d.numel() else 0.0
        if value >= worst:
            worst, where = value, k
    return worst, where


def fresh_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def device_for(mode: str) -> torch.device:
    return torch.device("cuda", 0) if mode == "gpu" else torch.device("cpu")


@contextlib.contextmanager
def world_of_one(device: torch.device) -> Iterator[None]:
    """A process group of this process alone (file store in a temporary folder): NCCL bound to
    `device` on CUDA, gloo on CPU, with `VESCALE_OPTIM_FORCE_COLLECTIVES=1`, so the library
    issues its collectives anyway (on CUDA: NCCL's asynchronous work and the side streams).
    Every collective is bounded: the group's timeout, and on gloo `set_collective_timeout`
    too (on NCCL a bounded wait blocks the host, which the sync checks would count)."""
    import torch.distributed as dist

    import vescale_optim as vo

    os.environ["VESCALE_OPTIM_FORCE_COLLECTIVES"] = "1"
    with tempfile.TemporaryDirectory(prefix="gpu_check_store_") as folder:
        kw = dict(
            init_method=f"file://{folder}/store", rank=0, world_size=1, timeout=timedelta(seconds=TIMEOUT_S)
        )
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device, **kw)
        else:
            dist.init_process_group("gloo", **kw)
            vo.set_collective_timeout(TIMEOUT_S)
        try:
            yield
        finally:
            vo.set_collective_timeout(None)
            dist.destroy_process_group()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
