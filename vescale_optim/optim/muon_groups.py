"""Muon's param groups: `muon_param_groups` (which parameters Muon orthogonalizes and which take
AdamW steps) and the checks of a group's keys (`check_muon_group`, `check_blocks`)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from numbers import Real

import torch

from ..kernels.newton_schulz import ns_schedule
from ._checks import check_adamw_group, check_at_least, check_lr
from ._muon_math import ADJUST_LR_FNS as _ADJUST
from ._muon_math import group_blocks

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
    adam_ids = _excluded(model, exclude)
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


def _excluded(model: torch.nn.Module, exclude) -> set[int]:
    """The ids of the parameters `exclude` names (modules, parameters, or their qualified names);
    ValueError for a name the model lacks or an item holding none of its parameters."""
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
    return adam_ids


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


def check_muon_group(group: dict) -> None:
    """Raise ValueError for a hyperparameter out of range in a Muon param group (or the
    defaults); a group with `use_muon=False` is checked as AdamW's (which refuses Muon's own
    keys: `normuon`, `split_sizes`, `num_heads`)."""
    if not isinstance(group.get("use_muon", True), bool):
        raise ValueError(f"use_muon must be True or False; got {group['use_muon']!r}")
    if not group.get("use_muon", True):
        check_adamw_group(group)
        return
    check_lr(group["lr"], "Learning rate should be >= 0 but is: {}")
    if not 0.0 <= group["momentum"] < 1.0:
        raise ValueError(f"momentum should be >= 0 and < 1 but is: {group['momentum']}")
    check_at_least(group["weight_decay"], 0.0, "weight decay should be >= 0 but is: {}")
    check_at_least(group["eps"], 0.0, "Invalid epsilon value: {}")
    fn, steps, coefficients = group["adjust_lr_fn"], group["ns_steps"], group["ns_coefficients"]
    if fn not in _ADJUST:
        raise ValueError(f"Adjust learning rate function {fn} is not supported; expected one of {_ADJUST}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"ns_steps must be an integer >= 1; got {steps!r}")
    if isinstance(coefficients, str):
        ns_schedule(coefficients, steps)  # a name it knows, or ValueError naming the known ones
    elif not (
        isinstance(coefficients, tuple | list)
        and len(coefficients) == 3
        and all(isinstance(c, Real) for c in coefficients)
    ):
        try:
            ns_schedule(coefficients, steps)
        except ValueError:
            raise ValueError(
                "Coefficients must be a tuple of exactly 3 values, a sequence of such triples (one per "
                f"Newton–Schulz step) or the name 'polar_express'; got {coefficients!r}"
            ) from None
    if not isinstance(group.get("normuon", False), bool):
        raise ValueError(f"normuon must be True or False; got {group['normuon']!r}")
    beta2 = group.get("normuon_beta2", 0.95)
    if isinstance(beta2, bool) or not isinstance(beta2, Real) or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"normuon_beta2 should be >= 0 and < 1 but is: {beta2!r}")


def check_blocks(gi: int, group: dict) -> None:
    """Each parameter of a Muon group cut into its blocks (`split_sizes` / `num_heads` fit its
    rows), else ValueError naming the group and the parameter."""
    if not group.get("use_muon", True) or (
        group.get("split_sizes") is None and group.get("num_heads") is None
    ):
        return
    names = group.get("param_names")
    for j, p in enumerate(group["params"]):
        try:
            group_blocks(tuple(p.shape), group)
        except ValueError as e:
            name = f"'{names[j]}' " if names else ""
            raise ValueError(
                f"param group {gi}, parameter {name}#{j} of shape {tuple(p.shape)}: {e}"
            ) from None
