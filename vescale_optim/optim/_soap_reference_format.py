"""SOAP's torch-format state dict in the reference implementation's layout, and back.

The state is kept (and saved through DCP and `vo.CheckpointManager`) as one tensor per key: `GG_k` and
`Q_k` for each rotated dimension k, and `step` counting the steps the parameter took. The authors'
SOAP keeps per parameter `GG` and `Q` as lists over the dimensions of the parameter's view (`[]` for
one that is not rotated), `step` counting Adam steps (0 after the first step, which only builds the
preconditioner), and `precondition_frequency` and `shampoo_beta`. `to_reference` turns
`state_dict()`'s entries into that layout (a post hook of `SOAP.state_dict`), `from_reference` turns
either layout into ours (a pre hook of `SOAP.load_state_dict`), so state dicts move between the two.
"""

from __future__ import annotations

import torch

from ._soap_math import Plan, shampoo_beta

LISTS = ("GG", "Q")
FROM_GROUP = ("precondition_frequency", "shampoo_beta")


def _by_key(state_dict: dict) -> tuple[dict, dict]:
    """Each state key's position among the parameters (the order the saved param groups list them:
    indices in ours, names in torch's flattened dicts) and its param group."""
    groups = state_dict.get("param_groups", ())
    order = [key for g in groups for key in g.get("params", ())]
    return {key: i for i, key in enumerate(order)}, {key: g for g in groups for key in g.get("params", ())}


def to_reference(state_dict: dict, plans: dict[int, Plan]) -> None:
    """In place: every entry of `state_dict["state"]` (ours) in the reference's layout; `plans` by the
    parameter's position in the param groups."""
    position, groups = _by_key(state_dict)
    for key, entry in state_dict["state"].items():
        plan, group = plans[position[key]], groups[key]
        for name in LISTS:
            entry[name] = [
                entry.pop(f"{name}_{k}") if d is not None else [] for k, d in enumerate(plan.sides)
            ]
        step = entry["step"]
        entry["step"] = torch.clamp(torch.as_tensor(step, dtype=torch.get_default_dtype()) - 1, min=0)
        entry["precondition_frequency"] = group["precondition_frequency"]
        entry["shampoo_beta"] = shampoo_beta(group)


def from_reference(state_dict: dict, plans: dict[int, Plan]) -> dict:
    """`state_dict` with every entry in the reference's layout (one with `GG` and `Q` lists) turned into
    ours; entries already in ours, and everything else, as they are. Refuses lists that do not fit the
    parameter's view. The dict passed in is not modified."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict):
        return state_dict  # not a state dict: the load refuses it by name
    state, changed = {}, False
    position, _ = _by_key(state_dict)
    for index, entry in state_dict["state"].items():
        if not (isinstance(entry, dict) and all(isinstance(entry.get(n), (list, tuple)) for n in LISTS)):
            state[index] = entry
            continue
        plan, changed = plans.get(position.get(index)), True
        out = {k: v for k, v in entry.items() if k not in LISTS + FROM_GROUP}
        for name in LISTS:
            found = entry[name]
            if plan is None or len(found) != len(plan.sides):
                raise ValueError(
                    f"parameter {index}: '{name}' lists {len(found)} factor(s); the parameter's view has "
                    f"{None if plan is None else len(plan.sides)} dimension(s) (max_precond_dim, merge_dims, "
                    "precondition_1d and data_format shape it)"
                )
            for k, (t, d) in enumerate(zip(found, plan.sides)):
                if d is None and len(t):
                    raise ValueError(
                        f"parameter {index}: '{name}'[{k}] is given, but dimension {k} is not rotated"
                    )
                if d is not None:
                    out[f"{name}_{k}"] = t
        out["step"] = torch.as_tensor(entry["step"], dtype=torch.get_default_dtype()) + 1
        state[index] = out
    return {**state_dict, "state": state} if changed else state_dict
