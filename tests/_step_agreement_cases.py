"""Which parameters step, as in torch (tests/units/test_step_agreement.py): a model whose
parameters are used by some ranks on some steps only (`side`), by none (`unused`) or frozen for a
while (`freeze_schedule`), each rank's loss, the library's and torch's groups over it, and torch's
optimizers fed the mean gradient as the reference."""

from __future__ import annotations

import torch
from _reference import mean_grad_reference

STEPS = 6
# Each covers twice the noise floor of summing the ranks' gradients in another order (gloo's
# ring does on W >= 3), measured by tests/test_references.py; Muon's is one flipped bf16
# rounding of a Newton-Schulz output (2**-8 of an update of size ~lr * 0.2 * sqrt(n)).
TOL = {"adamw": dict(rtol=1e-5, atol=1e-6), "muon": dict(rtol=0, atol=2e-4)}
LR = dict(muon=0.02, adam=0.01)


class PartlyUsedNet(torch.nn.Module):
    """`side` is used only by rank 0 on even steps; `unused` never."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 4)
        self.side, self.unused = torch.nn.Linear(8, 4), torch.nn.Linear(4, 4)

    def forward(self, x, side: bool):
        h = torch.tanh(self.a(x))
        return self.b(h) + self.side(h) if side else self.b(h)


def loss(model, t, rank):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * t + rank)).to(model.a.weight.dtype)
    return model(x, side=rank == 0 and t % 2 == 0).square().mean()


def freeze_schedule(model, t):
    if t == 2:
        model.b.weight.requires_grad_(False)  # frozen after construction: takes no step
    if t == 4:
        model.b.weight.requires_grad_(True)


def groups(model, kind):
    if kind == "adamw":
        return [{"params": list(model.parameters()), "lr": LR["adam"], "weight_decay": 0.1}]
    mats = [p for p in model.parameters() if p.ndim == 2]
    vecs = [p for p in model.parameters() if p.ndim == 1]
    return [
        {"params": mats, "lr": LR["muon"], "weight_decay": 0.1},
        {"params": vecs, "lr": LR["adam"], "weight_decay": 0.1, "use_muon": False},
    ]


def reference(kind, world, steps=STEPS, reversed_order=False):
    """torch.optim.AdamW (or torch.optim.Muon + AdamW) on the mean gradient of `world` ranks: the
    parameters after `steps`, and the state by the parameter's position in the groups."""
    model = PartlyUsedNet()
    param_groups = groups(model, kind)
    if kind == "adamw":
        opts = [torch.optim.AdamW(param_groups)]
    else:
        opts = [
            torch.optim.Muon(param_groups[0]["params"], lr=LR["muon"], weight_decay=0.1),
            torch.optim.AdamW(param_groups[1]["params"], lr=LR["adam"], betas=(0.9, 0.95), weight_decay=0.1),
        ]
    for t in range(steps):
        freeze_schedule(model, t)
        backward = lambda r, t=t: loss(model, t, r).backward()
        mean_grad_reference(model.parameters(), world, backward, reversed_order)
        for o in opts:
            o.step()
    position = {id(p): i for i, p in enumerate(p for g in param_groups for p in g["params"])}
    state = {position[id(p)]: s for o in opts for p, s in o.state.items()}
    return [p.detach() for p in model.parameters()], state
