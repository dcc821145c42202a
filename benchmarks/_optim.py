"""Optimizer settings the training benchmarks share, and Muon's split of a GPT's parameters.

    vo.AdamW(model.parameters(), **ADAMW)
    vo.Muon(muon_groups(model))                  # hidden matrices -> Muon, the rest -> AdamW
    names = muon_names(model)                    # the Muon group's parameter names, for a peer's split
    torch.optim.Muon(hidden, **MUON); torch.optim.AdamW(rest, **MUON_ADAMW)
"""

from __future__ import annotations

from torch import nn

import vescale_optim as vo

__all__ = ["ADAMW", "MUON", "MUON_ADAMW", "muon_groups", "muon_names"]

ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5)
MUON_ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)  # Muon's AdamW group


def muon_groups(model: nn.Module) -> list[dict]:
    """`vo.muon_param_groups` of a GPT (`benchmarks._gpt`): its head goes to AdamW."""
    adamw = dict(adamw_lr=MUON_ADAMW["lr"], adamw_betas=MUON_ADAMW["betas"],
                 adamw_weight_decay=MUON_ADAMW["weight_decay"])  # fmt: skip
    return vo.muon_param_groups(model, **MUON, exclude=[model.head], **adamw)


def muon_names(model: nn.Module) -> set[str]:
    """Names of the parameters `muon_groups` puts in the Muon group."""
    ids = {id(p) for p in muon_groups(model)[0]["params"]}
    return {n for n, p in model.named_parameters() if id(p) in ids}
