"""The optimizer's sharded state dict for `torch.distributed.checkpoint`, keyed by parameter name.

`opt.sharded_state_dict(model)` is this rank's pieces of the state in the flat layout that
torch's `get_optimizer_state_dict` gives with `flatten_optimizer_state_dict=True`:

    state.<fqn>.step, state.<fqn>.exp_avg, ...   each parameter's state (`master`: its fp32
                                                  master; owned tensors on the rank owning them)
    param_groups.<fqn>.lr, ...                    each hyperparameter of the parameter's group

Keys name parameters, not their positions in the optimizer. So pipeline stages, each an
optimizer over its own parameters whose names are the whole model's (the torchtitan way: a
stage is the model with the modules it does not own deleted), write disjoint keys into one
checkpoint, hyperparameters included, and a load at another pipeline degree, another
data-parallel size or without pipelining finds each parameter's state by its name.

The names (`param_names`): `model.named_parameters()`'s when a model is given, else the
param groups' `param_names` (an optimizer built over `model.named_parameters()`), else those
of the runtime's root module (the outermost of `shard_modules`).

Checkpoints written before names (state keyed by parameter index, `state.<i>.<name>`, and the
param groups as one list of index lists) still load: `sharded_state_dict(keys="index")` is a
dict of that layout for `dcp.load` to fill, and `load_sharded_state_dict` reads either.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from ..shard.dcp import DcpPiece, dcp_piece
from ..units.segment import Segment
from ..units.tensor_parallel import local_shape, tp_box
from .state_dict import MASTER, StateIO

STATE, GROUPS = "state", "param_groups"
KEYS = ("fqn", "index")  # the two layouts: by parameter name, and by index (checkpoints of old)
_NOT_HYPER = ("params", "param_names")


def param_names(param_groups: list[dict], root: nn.Module | None, model: nn.Module | None) -> list[str]:
    """Each parameter's fully qualified name, in param-group order: `model`'s names when given,
    else the param groups' `param_names`, else `root`'s (the runtime's outermost module)."""
    params = [p for g in param_groups for p in g["params"]]
    if model is None and all("param_names" in g for g in param_groups):
        names = [n for g in param_groups for n in g["param_names"]]
    else:
        source = model if model is not None else root
        if source is None:
            raise ValueError(
                "the optimizer does not know its parameters' names (no shard_modules, and its param "
                "groups have no param_names): pass the model, e.g. opt.sharded_state_dict(model=model), "
                "or build the optimizer over model.named_parameters()"
            )
        by_id: dict[int, str] = {}
        for name, p in source.named_parameters():
            by_id.setdefault(id(p), name)
        missing = [f"#{i} (shape {tuple(p.shape)})" for i, p in enumerate(params) if id(p) not in by_id]
        if missing:
            what = "the model passed" if model is not None else "the outermost of shard_modules"
            raise ValueError(f"{what} does not hold parameters {missing[:5]} of the optimizer: pass model=")
        names = [by_id[id(p)] for p in params]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"the optimizer holds more than one parameter named {twice[:5]}")
    return names


def _piece(seg: Segment, i: int, name: str):
    """This rank's piece of parameter `i`'s state `name` (or its fp32 "master") for DCP:
    a view of state kept exactly, or a reader that decodes other state when DCP writes it."""
    shape = local_shape(seg.params[i])
    whole, origin = tp_box(seg.params[i])  # a DTensor's local shard: its place in the whole
    box = dict(origin=origin, whole=whole)
    start, stop = seg.tensor_range(i)
    lo, hi = seg.local_range(i)
    if name == MASTER:
        return dcp_piece(shape, start, stop, seg.master[lo:hi], **box)
    if seg.codec.exact:
        return dcp_piece(shape, start, stop, seg.read(name)[lo:hi], **box)

    def read(a: int, z: int) -> torch.Tensor:
        return seg.read_range(name, lo + a, lo + z)

    device = seg.local_params.device
    return dcp_piece(shape, start, stop, read=read, dtype=torch.float32, device=device, **box)


def _entries(io: StateIO) -> dict[int, dict]:
    """This rank's state for DCP per parameter index (no copies): fp32 state as views,
    low-bit state as readers, owned tensors themselves (low-bit ones decoded) on their owner."""
    entries = {}
    for seg in io.segments:
        names = seg.state_names + ([MASTER] if seg.master is not None else [])
        for i, (index, per_param) in enumerate(zip(seg.indices, io.owned(seg))):
            entry = {"step": torch.tensor(float(seg.steps[i]))}
            entry.update({name: _piece(seg, i, name) for name in names})
            entry.update({o.key: o.values() for o in per_param if o.tensor is not None})
            entries[index] = entry
    return entries


def _hyper(group: dict) -> dict:
    return {k: copy.deepcopy(v) for k, v in group.items() if k not in _NOT_HYPER}


def sharded(io: StateIO, names: Sequence[str] | None) -> dict:
    """This rank's pieces of the state for DCP, keyed by parameter name (`names`), or by index
    in the old layout when `names` is None."""
    entries = _entries(io)
    if names is None:
        groups, start = [], 0
        for g in io.param_groups:
            groups.append({**_hyper(g), "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        return {STATE: {str(index): entry for index, entry in entries.items()}, GROUPS: groups}
    out = {f"{STATE}.{names[index]}.{key}": v for index, entry in entries.items() for key, v in entry.items()}
    at = 0
    for g in io.param_groups:
        for name in names[at : at + len(g["params"])]:
            out.update({f"{GROUPS}.{name}.{k}": v for k, v in _hyper(g).items()})
        at += len(g["params"])
    return out


def is_by_index(state_dict: dict) -> bool:
    """Whether `state_dict` has the old layout (state by parameter index, groups as a list)."""
    return isinstance(state_dict.get(STATE), dict)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return bool(a == b)


def saved_groups(io: StateIO, state_dict: dict, names: Sequence[str]) -> list[dict]:
    """The hyperparameters `state_dict` (by name, filled by `dcp.load`) holds for each of our
    param groups; refuses, before anything changes, a group whose parameters were saved with
    different values, or one whose saved state-shaping keys differ from ours."""
    out, at = [], 0
    for gi, g in enumerate(io.param_groups):
        members = names[at : at + len(g["params"])]
        at += len(g["params"])
        saved: dict = {}
        for key in _hyper(g):
            for name in members:
                flat = f"{GROUPS}.{name}.{key}"
                if flat not in state_dict:
                    raise ValueError(
                        f"the state dict has no {flat!r}: pass the dict sharded_state_dict() returned "
                        "(with the same model), after dcp.load"
                    )
                value = state_dict[flat]
                if key not in saved:
                    saved[key], first = value, name
                elif not _same(saved[key], value):
                    raise ValueError(
                        f"param group {gi}: its parameters {first!r} and {name!r} were saved with {key}="
                        f"{saved[key]!r} and {value!r}; build the param groups as they were saved"
                    )
        out.append(saved)
    io.validate_groups([{**s, "params": g["params"]} for s, g in zip(out, io.param_groups)])
    return out


def _check_pieces(io: StateIO, entries: dict[int, dict]) -> None:
    for seg in io.segments:
        for index in seg.indices:
            for name in seg.state_names:
                if not isinstance(entries[index].get(name), DcpPiece):
                    raise TypeError(
                        f"parameter {index}: '{name}' is not a piece from sharded_state_dict(); "
                        "pass the dict it returned, after dcp.load"
                    )


def _by_name(io: StateIO, state_dict: dict, names: Sequence[str]) -> dict[int, dict]:
    """Each parameter's entry of a dict keyed by name, as the index layout holds it."""
    entries = {}
    for seg in io.segments:
        for index, per_param in zip(seg.indices, io.owned(seg)):
            at = f"{STATE}.{names[index]}."
            keys = ["step", *seg.state_names, MASTER, *(o.key for o in per_param)]
            entries[index] = {k: state_dict[at + k] for k in keys if at + k in state_dict}
            if "step" not in entries[index]:
                raise ValueError(
                    f"the state dict has no {at + 'step'!r}: pass the dict sharded_state_dict() returned "
                    "(with the same model), after dcp.load"
                )
    return entries


def validate(
    io: StateIO, state_dict: dict, names: Sequence[str] | None
) -> tuple[dict[int, dict], list[dict] | None]:
    """Check a loaded dict of either layout before anything changes: (each parameter's
    entry by index, the param groups' saved hyperparameters or None when it has none)."""
    if is_by_index(state_dict):
        groups = state_dict.get(GROUPS)
        if groups is not None:
            io.validate_groups(groups)
        entries = {index: entry for index, entry in ((int(k), v) for k, v in state_dict[STATE].items())}
        missing = [index for seg in io.segments for index in seg.indices if index not in entries]
        if missing:
            raise ValueError(f"the state dict has no state for parameters {missing[:5]}")
    else:
        if names is None:
            raise ValueError("a state dict keyed by parameter name needs the names: pass model=")
        entries = _by_name(io, state_dict, names)
        groups = saved_groups(io, state_dict, names)
    _check_pieces(io, entries)
    return entries, groups


@torch.no_grad()
def load(io: StateIO, entries: dict[int, dict], groups: list[dict] | None) -> None:
    """Finish a DCP load into `sharded`'s dict (either layout), as `validate` read it: fp32 state,
    masters and owned tensors were filled in place; buffers DCP decoded into are encoded into the
    low-bit state and dropped, and so are low-bit owned tensors' decoded copies."""
    if groups is not None:
        for g, saved in zip(io.param_groups, groups):
            g.update({k: copy.deepcopy(v) for k, v in saved.items() if k not in _NOT_HYPER})
    for seg in io.segments:
        seg.set_steps([int(float(entries[index]["step"])) for index in seg.indices])
        loaded = {}
        for name in seg.state_names:
            for i, index in enumerate(seg.indices):
                buf = entries[index][name].take_loaded()
                if buf is not None:
                    loaded[name, i] = buf
        if loaded:
            local = io._locals(seg)
            for (name, i), buf in loaded.items():
                lo, hi = seg.local_range(i)
                local[name][lo:hi].copy_(buf)
            io._commit(seg, {n: local[n] for n, _ in loaded})
        for index, per_param in zip(seg.indices, io.owned(seg)):
            for o in per_param:
                if o.coded is not None and o.tensor is not None:
                    o.assign_(torch.as_tensor(entries[index][o.key]))
    io.publish()


class ShardedStateDict:
    """The optimizer's DCP face, mixed into `base.ShardedOptimizer` (its `_io`, `runtime`,
    `param_groups`, `state` and `_follow_swapped`)."""

    def _names(self, model: nn.Module | None) -> list[str]:
        return param_names(self.param_groups, self.runtime.root, model)

    def sharded_state_dict(self, model: nn.Module | None = None, *, keys: str = "fqn") -> dict:
        """This rank's pieces of the state for DCP (no copies), keyed by parameter name:
        `state.<fqn>.<name>` and `param_groups.<fqn>.<hyperparameter>`, as torch's flattened
        optimizer state dicts are. Names are `model`'s (`named_parameters()`), else the param
        groups' `param_names`, else the outermost of `shard_modules`'s; with none of them a
        ValueError asks for `model`.

        Pass it to `torch.distributed.checkpoint.save`; pipeline stages' dicts merge into one
        checkpoint. To restore, build the optimizer (any world size, any pipeline degree), call
        `dcp.load` on a fresh `sharded_state_dict(model)` and then `load_sharded_state_dict`
        with it. fp32 state is handed as views; bf16 and 8-bit state is decoded chunk by chunk
        only while DCP writes it. The hyperparameters ride along (a scheduler's learning rates
        come back). `keys="index"` gives the layout of checkpoints written before names (state
        by parameter index), to load those. Not collective itself."""
        if keys not in KEYS:
            raise ValueError(f"keys must be one of {KEYS}, not {keys!r}")
        self._follow_swapped()
        return sharded(self._io, self._names(model) if keys == "fqn" else None)

    def validate_sharded_state_dict(self, state_dict: dict, model: nn.Module | None = None) -> None:
        """Raise ValueError or TypeError unless `state_dict` (`sharded_state_dict(model)`'s dict,
        filled by `dcp.load`) fits this optimizer: its param groups' saved hyperparameters
        agree within each group and in every state-shaping key. Changes nothing."""
        self._follow_swapped()
        validate(self._io, state_dict, None if is_by_index(state_dict) else self._names(model))

    def load_sharded_state_dict(self, state_dict: dict, model: nn.Module | None = None) -> None:
        """Finish a DCP load (collective) into `sharded_state_dict(model)`'s dict, either
        layout: fp32 state and masters were filled in place; buffers DCP decoded into are
        encoded into the low-bit state and dropped. Refuses a dict that does not fit before
        changing anything."""
        self._follow_swapped()
        names = None if is_by_index(state_dict) else self._names(model)
        entries, groups = validate(self._io, state_dict, names)
        self._used = True
        load(self._io, entries, groups)
        self.state.changed()
