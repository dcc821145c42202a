"""What the wrapped-framework launch scripts share (and test_frameworks.py, which imports this as
`wrapped._common`): the tiny model and its data, the optimizers compared (the library's and torch's,
built the same way), and rank 0's result file."""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

STEPS = 6
LR, WD = 1e-2, 0.01
BATCH = 4  # rows per rank and step
ROWS = STEPS * 2 * BATCH  # 2 ranks: every row is used once, each rank its own
OPTS = ["torch", "torch_muon", "vo_adamw", "vo_muon"]


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 3, generator=g)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).square().mean() * 50  # large: clipping at 0.5 acts


class TrainerModel(nn.Module):
    """`net()` as HF `Trainer` expects a model: keyword inputs, a dict with the loss (test_frameworks.py
    trains it in one process, hf_trainer.py on two ranks)."""

    def __init__(self):
        super().__init__()
        self.net = net()

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": loss(out, labels), "logits": out}


def lightning_module(opt: str):
    """`net()` as a Lightning module: `loss` its training step, `optimizers(opt, module)` its
    optimizer (test_frameworks.py trains it in one process, lightning_ddp.py on two ranks). Lightning
    is imported here, when asked for: the other scripts run without it."""
    import lightning as L

    class NetModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net()

        def training_step(self, batch, i):
            x, y = batch
            return loss(self.net(x), y)

        def configure_optimizers(self):
            (optimizer,) = optimizers(opt, self)
            return optimizer

    return NetModule()


class Rows(torch.utils.data.Dataset):
    """The rows of inputs `x` and targets `y` as Trainer reads them: `{"x": ..., "labels": ...}`."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


def optimizers(kind: str, model: nn.Module) -> list[torch.optim.Optimizer]:
    """`kind`'s optimizers over `model`: torch's AdamW, or torch's Muon for the matrices with
    AdamW for the biases under the betas and eps the library's Muon gives its AdamW groups, or
    the library's AdamW or Muon (one optimizer, the biases in a `use_muon=False` group)."""
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    if kind == "torch":
        return [torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)]
    if kind == "torch_muon":
        return [
            torch.optim.Muon(matrices, lr=LR, weight_decay=WD),
            torch.optim.AdamW(rest, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=WD),
        ]
    import vescale_optim as vo

    if kind == "vo_adamw":
        return [vo.AdamW(model.parameters(), lr=LR, weight_decay=WD)]
    assert kind == "vo_muon", kind
    return [vo.Muon([{"params": matrices}, {"params": rest, "use_muon": False}], lr=LR, weight_decay=WD)]


def parser(opts: list[str] = OPTS) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--opt", choices=opts, required=True)
    p.add_argument("--out", required=True, help="where rank 0 writes its parameters (torch.save)")
    return p


def save(path: str, params: list[torch.Tensor], grad_norms: list[float] | None = None, opt=None) -> None:
    """Rank 0's result, written by rank 0 (every rank calls this: it is collective), with
    `sharded_over(opt)`."""
    over = sharded_over(getattr(opt, "optimizer", opt))  # accelerate's wrapper holds the optimizer
    if not dist.is_initialized() or dist.get_rank() == 0:
        result = {"params": [p.clone() for p in params], "grad_norms": grad_norms, "sharded_over": over}
        torch.save(result, path)


def sharded_over(opt) -> int | None:
    """How many ranks hold a part of the library's optimizer `opt`'s state, where the parts add up to
    the full state once (1 where each rank holds all of it; None for torch's optimizers): so that a
    run that fell back to one process cannot pass for sharded. Collective."""
    if not hasattr(opt, "local_state_numel"):
        return None
    full = opt.state_dict()["state"].values()
    full = sum(t.numel() for st in full for t in st.values() if isinstance(t, torch.Tensor) and t.ndim > 0)
    ps = [p for g in opt.param_groups for p in g["params"] if p in opt.state]
    held = sum(t.numel() for p in ps for t in opt.state[p].values() if t.ndim > 0)  # this rank's pieces
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, held)
    return sum(n > 0 for n in parts) if sum(parts) == full else 1


def leave() -> None:
    """End the rank once every rank is here, without torch's teardown at exit: the frameworks
    leave the process group standing, and gloo's teardown then aborts ('terminate called without
    an active exception') or hangs (DDP's reducer, freed last, joins gloo's run loop, which waits
    for the interpreter lock) in about half of the runs of torch's own AdamW here."""
    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
