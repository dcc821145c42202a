"""`model.state_dict()` and `model.load_state_dict()` for a model whose units are sharded.

Between steps a sharded unit's parameters hold no memory, so the module hooks here make
`state_dict()` return full tensors gathered unit by unit from the shards (in the
parameters' original dtype, full precision), and make `load_state_dict()` write each
rank's piece of the given tensors into its shards. Both are collective for sharded units.
On CUDA each unit's gathered tensors move to CPU as soon as they are gathered, so saving
never holds more than one unit's full parameters on the GPU; `ModelState.to_rank(r)`
gathers them to one rank only (the others get none of the sharded units' parameters).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from ..shard.collectives import all_gather_into_, redistribute
from ..shard.spec import RaggedShard
from .tensor_parallel import like, local, local_shape, tp_box
from .unit import State, Unit


def _keys(module: nn.Module, prefix: str, unit: Unit) -> list[tuple[str, int]]:
    """(state-dict key, parameter index in `unit`) for every name the unit's parameters
    have under `module` (a tied parameter has several)."""
    index = {id(p): i for i, p in enumerate(unit.params)}
    out = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in index:
            out.append((prefix + name, index[id(p)]))
    return out


def gather_full(unit: Unit, to_rank: int | None = None) -> torch.Tensor | None:
    """The unit's whole flat parameter buffer in the original dtype on the CPU, gathered
    from the shards (a new tensor; collective), on every rank or on `to_rank` only (None
    elsewhere)."""
    what = f"unit {unit.name}'s parameters for the state dict"
    if to_rank is None:
        full = torch.empty(unit.layout.numel, dtype=unit.shard.dtype, device=unit.device)
        all_gather_into_(full, unit.shard, unit.comm, what=what)
    else:
        world = unit.comm.world_size
        pieces, owner = RaggedShard((0,), (1,) * world), RaggedShard.owned(to_rank, world)
        full, _ = redistribute(unit.shard, (unit.layout.numel,), pieces, owner, unit.comm)
        if unit.comm.rank != to_rank:
            return None
        full = full.reshape(-1)
    return full.to("cpu", unit.orig_dtype)  # on CUDA a blocking copy: this unit's GPU copy goes now


def sharded_model_state(units: Sequence[Unit], names: dict[int, str]) -> dict:
    """`{name: DcpPiece}` of every unit parameter: this rank's piece of it in its unit's
    shard (full precision), as a view for `torch.distributed.checkpoint` to save from and
    load into. `names` maps `id(parameter)` to its state-dict key. A DTensor parameter's piece
    carries its global shape and offsets (its TP shard's place in the whole, with the ragged
    range inside that shard), so a checkpoint reshards across TP layouts too."""
    from ..shard.dcp import dcp_piece

    out = {}
    for unit in units:
        for i, p in enumerate(unit.params):
            start, stop = unit.full.tensor_range(i)
            lo, hi = unit.full.local_range(i)
            whole, origin = tp_box(p)  # a DTensor's local shard: placed in the whole tensor
            out[names[id(p)]] = dcp_piece(
                local_shape(p), start, stop, unit.shard[lo:hi], origin=origin, whole=whole
            )
    return out


class ModelState:
    """Registers the state-dict hooks on each sharded unit's module."""

    def __init__(self, units: Sequence[Unit], modules: Sequence[nn.Module | None]):
        self.handles = []
        for unit, module in zip(units, modules):
            if module is None or not unit.sharded:
                continue
            self.handles += [
                module.register_state_dict_post_hook(self._saved(unit)),
                module.register_load_state_dict_pre_hook(self._loading(unit)),
                module.register_load_state_dict_post_hook(self._loaded(unit)),
            ]
        self._incoming: dict[int, dict[int, torch.Tensor]] = {}
        self._to_rank: int | None = None
        self._was_gathered: dict[int, bool] = {}  # by unit index, while a load is under way

    @contextlib.contextmanager
    def to_rank(self, rank: int | None) -> Iterator[None]:
        """`model.state_dict()` inside gathers the sharded units' parameters to `rank` only."""
        previous, self._to_rank = self._to_rank, rank
        try:
            yield
        finally:
            self._to_rank = previous

    def _saved(self, unit: Unit):
        def hook(module, state_dict, prefix, local_metadata):
            keys = _keys(module, prefix, unit)
            if not keys:
                return
            full = gather_full(unit, self._to_rank)
            for key, i in keys:
                if key not in state_dict:
                    continue
                if full is None:
                    del state_dict[key]
                    continue
                p, start = unit.params[i], unit.layout.offsets[i]  # (a DTensor's: its local tensor)
                state_dict[key] = like(p, full[start : start + unit.layout.sizes[i]].view(local_shape(p)))

        return hook

    def _loading(self, unit: Unit):
        def hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
            if local_metadata.get("assign_to_params_buffers", False):
                raise ValueError("load_state_dict(assign=True) would replace the sharded parameters")
            incoming = {}
            for key, i in _keys(module, prefix, unit):
                value = state_dict.get(key)
                if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(unit.params[i].shape):
                    incoming.setdefault(i, value)
            self._incoming[unit.index] = incoming
            gathered = self._was_gathered[unit.index] = unit.state is not State.RESHARDED
            if gathered:
                unit.wait_unshard()
            else:
                unit.open_empty()  # somewhere for torch's own copy to land

        return hook

    def _loaded(self, unit: Unit):
        def hook(module, incompatible_keys):
            incoming = self._incoming.pop(unit.index, {})
            with torch.no_grad():
                for i, value in incoming.items():
                    unit.write_piece(i, local(value.detach()))
            if self._was_gathered.pop(unit.index, False):
                unit.regather()
            else:
                unit.reshard()

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
