"""`muon_param_groups`: which parameters Muon orthogonalizes and which take AdamW steps."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch

_HEAD_NAMES = ("lm_head", "head", "output", "classifier", "fc")
_EMBEDDINGS = (torch.nn.Embedding, torch.nn.EmbeddingBag)


def muon_param_groups(
    model: torch.nn.Module,
    *,
    exclude: Iterable[torch.nn.Module | torch.Tensor | str] = (),
    adamw_lr: float | None = None,
    adamw_betas: tuple[float, float] | None = None,
    adamw_weight_decay: float | None = None,
    **muon_kwargs,
) -> list[dict]:
    """Split `model`'s trainable parameters into a Muon group and an AdamW group (`use_muon=False`).

    AdamW takes embeddings (and a head tied to one), everything with fewer than two
    dimensions, biases (stacked per-expert biases included) and whatever `exclude` names:
    modules (all their parameters), parameters, or the qualified names of either
    (`"lm_head"`, `"2.weight"`). Every other matrix goes to Muon, the output layer included
    unless it is excluded; a warning names each Linear that looks like an output layer yet
    goes to Muon (named like one, the model's last Linear, or with as many outputs as an
    embedding has rows, or a vocabulary-sized `out_features`).

    Only the hyperparameters given are set: `muon_kwargs` (`lr`, `weight_decay`,
    `momentum`, ...) on the Muon group, `adamw_*` on the AdamW group. Everything else
    comes from the optimizer, e.g. `vo.Muon(groups, lr=0.02, weight_decay=0.1)` sets both
    groups' `lr` and `weight_decay`, and its `betas` the AdamW group's.
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    named = dict(model.named_parameters(remove_duplicate=False))
    own = {id(p) for p in named.values()}
    adam_ids = set()
    for item in [exclude] if isinstance(exclude, str | torch.nn.Module | torch.Tensor) else exclude:
        if isinstance(item, str):
            if item not in modules and item not in named:
                raise ValueError(f"exclude: the model has no module or parameter named {item!r}")
            item = modules.get(item, named.get(item))
        if isinstance(item, torch.nn.Module):
            ids = {id(p) for p in item.parameters()}
        elif isinstance(item, torch.Tensor):
            ids = {id(item)}
        else:
            raise TypeError(f"exclude takes modules, parameters or names; got {type(item).__name__}")
        if not ids & own:
            raise ValueError(f"exclude: {type(item).__name__} holds no parameter of the model")
        adam_ids |= ids
    for module in model.modules():
        if isinstance(module, _EMBEDDINGS):
            adam_ids.update(id(p) for p in module.parameters(recurse=False))
    muon, adam = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        aux = id(p) in adam_ids or p.ndim < 2 or name.rsplit(".", 1)[-1].endswith("bias")
        (adam if aux else muon).append(p)
    heads = _likely_heads(model, {id(p) for p in muon})
    if heads:
        warnings.warn(
            f"muon_param_groups: {'; '.join(heads)} looks like an output layer but goes to Muon; "
            "pass it in exclude= to give it AdamW steps (or filter this warning if Muon is meant)",
            stacklevel=2,
        )
    adam_group = {"params": adam, "use_muon": False}
    for key, value in (("lr", adamw_lr), ("betas", adamw_betas), ("weight_decay", adamw_weight_decay)):
        if value is not None:
            adam_group[key] = value
    return [{**muon_kwargs, "params": muon, "use_muon": True}, adam_group]


def _likely_heads(model: torch.nn.Module, muon_ids: set[int]) -> list[str]:
    """'name (why)' for each Linear in `muon_ids` that looks like an output layer."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    # rows of vocabulary-like embeddings (more rows than columns; not, say, positions)
    embeddings = [e for e in model.modules() if isinstance(e, _EMBEDDINGS)]
    vocab = {e.num_embeddings for e in embeddings if e.num_embeddings > e.embedding_dim}
    out = []
    for k, (name, m) in enumerate(linears):
        if id(m.weight) not in muon_ids:
            continue
        widens = m.out_features > m.in_features
        why = [
            reason
            for reason, hit in (
                ("named like one", name.rsplit(".", 1)[-1] in _HEAD_NAMES),
                ("the model's last Linear", k == len(linears) - 1),
                ("out_features equals an embedding's rows", widens and m.out_features in vocab),
                ("vocabulary-sized out_features", m.out_features >= max(1024, 8 * m.in_features)),
            )
            if hit
        ]
        if why:
            out.append(f"'{name or type(model).__name__}' ({', '.join(why)})")
    return out
