"""`opt.state`: torch's per-parameter state, shown as this rank's pieces of the sharded state.

torch's optimizers keep `opt.state[p]`, a dict of tensors under torch's names, and code around
them reads it: `len(opt.state)`, `opt.state.values()`, torch's `get_optimizer_state_dict` (which
runs a step with zero gradients when `opt.state` is empty, and unflattens a flat state dict by
the names in `opt.state[p]`). A sharded optimizer keeps its state in the segments' flat buffers
(and Shampoo's factors, NorMuon's `v`, whole on their owners); `LocalState` shows each
parameter's piece of it under the keys of its `state_dict()` entry, fp32 state as views of that
memory (no copies). The optimizer says when steps changed (`changed()`); entries are rebuilt
lazily, at the next read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, ItemsView, KeysView, Sequence, ValuesView
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from ..units.segment import Segment
from ..units.tensor_parallel import local_numel, local_shape
from .state_dict import MASTER, Owned


@dataclass
class _Pieces:
    """One parameter's entry: the views of its state, decoders for state kept in bf16 or 8 bits
    (called at each read: nothing decoded is kept), and each key's `flat_range`, in key order."""

    views: dict[str, torch.Tensor] = field(default_factory=dict)
    decoders: dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)

    def add(
        self,
        name: str,
        cut: tuple[int, int],
        view: torch.Tensor | None = None,
        decode: Callable[[], torch.Tensor] | None = None,
    ) -> None:
        if view is not None:
            self.views[name] = view
        else:
            self.decoders[name] = decode
        self.ranges[name] = cut

    def entry(self) -> dict[str, torch.Tensor]:
        """The whole entry: views as they are, the other state decoded now."""
        return {k: self.views[k] if k in self.views else self.decoders[k]() for k in self.ranges}


class LocalState(dict):
    """`opt.state` of a sharded optimizer: `{param: {name: tensor}}`, an entry for every
    parameter that has stepped (as in torch), with the keys of its `state_dict()["state"]` entry
    (`step`, torch's state names, `master` for bf16/fp16 parameters, Shampoo's tile factors and
    roots, NorMuon's `variance_neuron*`), each value this rank's piece:

    - the whole tensor in its own shape where this rank holds all of it (always, in one
      process); else a 1-D tensor of this rank's elements `[start, stop)` of the flattened tensor,
      `flat_range(p, name)`, empty where it holds none. Element-wise state and masters are cut
      like the parameter; state kept whole on one rank (Shampoo's, NorMuon's) is whole on its
      owner and empty elsewhere. A DTensor parameter's pieces are of its local (TP) shard.
    - fp32 state is a view of the optimizer's own memory: it follows every step, and in-place
      writes change the state. bf16 and 8-bit state is decoded into fp32 copies at each read
      of `opt.state[p]`: nothing is kept, and writing into them changes nothing.
    - `step` is a 0-d tensor of torch's default dtype on the CPU, as torch keeps it, updated in
      place by every step once `opt.state` was read (a copy of the count: writing it changes
      nothing).

    Read-only otherwise: assigning or deleting entries raises TypeError (the state changes
    through `load_state_dict`, `load_sharded_state_dict` or `vo.CheckpointManager`). A missing
    key reads as `{}`, as torch's `defaultdict` gives, without adding it. Not collective.
    """

    def __init__(self, segments: Sequence[Segment], owned: Callable[[Segment], list[list[Owned]]]):
        super().__init__()
        self._segments, self._owned = list(segments), owned
        params = [(seg, i) for seg in self._segments for i in range(len(seg.params))]
        self._where = {id(seg.params[i]): (seg, i, k) for k, (seg, i) in enumerate(params)}
        self._steps: torch.Tensor | None = None  # every parameter's step count, in `_where`'s order
        self._pieces: dict[int, _Pieces] = {}  # by id(param), built at its first read
        self._owned_of: dict[int, list[list[Owned]]] = {}  # by id(segment): its owned tensors, asked once
        self._stale, self._read, self._hidden = True, False, False

    # --- what the optimizer calls ---------------------------------------------------------

    def changed(self) -> None:
        """Steps changed (a step, a load): rebuild the entries at the next read; step tensors
        handed out follow at once."""
        self._stale = True
        if self._read:
            self._refresh_steps()

    def hide(self, hidden: bool) -> None:
        """Show no entries while torch's `Optimizer.state_dict` packs `opt.state` (the
        optimizer's own post hook replaces that part with the full state): nothing is decoded."""
        self._hidden = hidden

    def held(self) -> list[torch.Tensor]:
        """The tensors it holds of its own (for `local_state_bytes`): the step counts, once read."""
        return [] if self._steps is None else [self._steps]

    def flat_range(self, p: torch.Tensor, name: str) -> tuple[int, int]:
        """Which elements of the flattened tensor `opt.state[p][name]` holds, as `[start, stop)`:
        of `state_dict()`'s full tensor (for a DTensor parameter's element-wise state and master,
        of its local shard's); `(0, numel)` for what this rank holds whole (`step` included),
        `(0, 0)` where it holds none. Known before the parameter steps."""
        ranges = self._pieces_of(p).ranges
        if name not in ranges:
            raise KeyError(f"{name!r} is not a state of this parameter; it has {list(ranges)}")
        return ranges[name]

    # --- the entries ----------------------------------------------------------------------

    def _counts(self) -> torch.Tensor:
        """The tensor the `step` views are of, made at the first read (an unread optimizer holds none)."""
        if self._steps is None:
            self._steps = torch.zeros(len(self._where))
        return self._steps

    def _refresh_steps(self) -> None:
        counts = [float(s) for seg in self._segments for s in seg.steps]
        self._counts().copy_(torch.tensor(counts, dtype=self._counts().dtype))

    def _sync(self) -> None:
        """An entry for every parameter that has stepped, each a new dict of its views."""
        self._read = True
        if not self._stale:
            return
        self._refresh_steps()
        dict.clear(self)
        for seg in self._segments:
            for i, p in enumerate(seg.params):
                if seg.steps[i]:
                    dict.__setitem__(self, p, dict(self._pieces_of(p).views))
        self._stale = False

    def _pieces_of(self, p: torch.Tensor) -> _Pieces:
        if id(p) not in self._where:
            raise KeyError("not a parameter of this optimizer")
        if id(p) not in self._pieces:
            self._pieces[id(p)] = self._build(*self._where[id(p)])
        return self._pieces[id(p)]

    def _build(self, seg: Segment, i: int, k: int) -> _Pieces:
        """Parameter `i` of `seg`'s pieces, in the key order of `StateIO.fill`."""
        p, out = seg.params[i], _Pieces()
        start, stop = seg.tensor_range(i)
        cut = (start, stop) if stop > start else (0, 0)
        lo, hi = seg.local_range(i)
        whole = cut == (0, local_numel(p))
        shaped = (lambda x: x.view(local_shape(p))) if whole else (lambda x: x)
        out.add("step", (0, 1), view=self._counts()[k])
        for name in seg.state_names:
            if seg.codec.exact:  # the stored tensor is the state itself
                out.add(name, cut, view=shaped(seg.read(name)[lo:hi]))
            else:
                out.add(name, cut, decode=lambda name=name: shaped(seg.read_range(name, lo, hi)))
        if seg.master is not None:
            out.add(MASTER, cut, view=shaped(seg.master[lo:hi]))
        if id(seg) not in self._owned_of:
            self._owned_of[id(seg)] = self._owned(seg)
        for o in self._owned_of[id(seg)][i]:
            n = math.prod(o.shape)
            if o.tensor is None:  # another rank owns it
                out.add(o.key, (0, 0), view=seg.local_params.new_zeros(0))
            elif o.coded is None:
                out.add(o.key, (0, n), view=o.tensor.view(o.shape))
            else:
                out.add(o.key, (0, n), decode=o.values)
        return out

    # --- reading, as a dict ---------------------------------------------------------------

    def _shown(self) -> bool:
        self._sync()
        return not self._hidden

    def __getitem__(self, p: Any) -> dict[str, torch.Tensor]:
        if not (self._shown() and dict.__contains__(self, p)):
            return {}  # what torch's defaultdict gives a parameter without state (not kept here)
        pieces = self._pieces[id(p)]
        return pieces.entry() if pieces.decoders else dict.__getitem__(self, p)

    def __iter__(self):
        return dict.__iter__(self) if self._shown() else iter(())

    def __len__(self) -> int:
        return dict.__len__(self) if self._shown() else 0

    def __contains__(self, p: object) -> bool:
        return self._shown() and dict.__contains__(self, p)

    def get(self, p: Any, default: Any = None) -> Any:
        return self[p] if self._shown() and dict.__contains__(self, p) else default

    def keys(self) -> KeysView:
        return KeysView(self)

    def values(self) -> ValuesView:
        return ValuesView(self)

    def items(self) -> ItemsView:
        return ItemsView(self)

    def copy(self) -> dict:
        """A plain dict of the entries as they are now."""
        return dict(self.items())

    def __eq__(self, other: object) -> bool:
        return self.copy() == other

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.copy()!r})"

    def __reduce__(self):
        return dict, (self.copy(),)  # pickled and deep-copied as a plain dict

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(
            "opt.state shows the sharded optimizer's own state and is read-only: load state with "
            "opt.load_state_dict(), opt.load_sharded_state_dict() or vo.CheckpointManager, or write "
            "into its fp32 tensors in place"
        )

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse


class StateAttribute:
    """The `state` attribute of a sharded optimizer: its `LocalState`. torch's constructor first
    assigns a `defaultdict(dict)`, kept until the optimizer assigns its `LocalState`; anything
    assigned after is refused by name (`opt.state = defaultdict(dict)` would not reset the state)."""

    def __get__(self, opt: Any, owner: type | None = None) -> Any:
        if opt is None:
            return self
        found = opt.__dict__.get("_local_state")
        return found if found is not None else opt.__dict__.get("_early_state", {})

    def __set__(self, opt: Any, value: Any) -> None:
        if "_local_state" in opt.__dict__:
            raise TypeError(
                f"{type(opt).__name__}.state shows the sharded state and cannot be replaced; to "
                "start afresh build a new optimizer, to load state use opt.load_state_dict()"
            )
        if isinstance(value, LocalState):
            opt.__dict__.pop("_early_state", None)
            opt.__dict__["_local_state"] = value
        else:
            opt.__dict__["_early_state"] = value

    @staticmethod
    def forget(opt: Any) -> None:
        """Drop `opt`'s `LocalState` before it is laid out anew over swapped parameters (it held no
        state yet), so that the new layout's can be assigned."""
        opt.__dict__.pop("_local_state", None)


# --- torch's state-dict machinery, with the sharded state ---------------------------------------


def through_torch_state_dict(
    opt: Any, fill: Callable[[dict], None], torch_state_dict: Callable[[], dict]
) -> dict:
    """`torch.optim.Optimizer.state_dict` (`torch_state_dict`), whose hooks fire as for any torch
    optimizer, with `fill` (putting the full state into the dict) as its first post hook. torch
    packs `opt.state` first: it is hidden meanwhile, so nothing is decoded for a part `fill` replaces."""

    def first(o: Any, state_dict: dict) -> None:
        opt.state.hide(False)  # the other post hooks see it
        fill(state_dict)
        state_dict["param_groups"] = [
            {k: _named(v) for k, v in g.items()} for g in state_dict["param_groups"]
        ]

    hide = opt.register_state_dict_pre_hook(lambda o: opt.state.hide(True))  # the last pre hook
    fill_first = opt.register_state_dict_post_hook(first, prepend=True)
    try:
        return torch_state_dict()
    finally:
        opt.state.hide(False)
        hide.remove()
        fill_first.remove()


def through_torch_load(
    opt: Any, load: Callable[[dict], None], torch_load: Callable[[dict], None], state_dict: dict
) -> None:
    """`torch.optim.Optimizer.load_state_dict` (`torch_load`), its hooks firing (a load pre hook may
    return a new dict), with `load` as a pre hook appended last: it loads the final dict and hands
    torch an empty `state` to install (`opt.state` stays the optimizer's). A dtype saved by its
    name is a dtype again where the optimizer's group holds one."""

    def last(o: Any, final: dict) -> dict:
        if isinstance(final, dict) and isinstance(final.get("param_groups"), list):
            final = {**final, "param_groups": _dtypes_back(final["param_groups"], opt.param_groups)}
        load(final)
        opt.state.changed()
        return {**final, "state": {}}

    hook = opt.register_load_state_dict_pre_hook(last)
    try:
        torch_load(state_dict)
    finally:
        hook.remove()


def _named(value: Any) -> Any:
    """A torch.dtype in a param group (Shampoo's `root_dtype`) by its name, `"torch.float32"`:
    torch's state-dict utilities (`get_optimizer_state_dict(..., full_state_dict=True)`) refuse dtypes."""
    return str(value) if isinstance(value, torch.dtype) else value


def _dtypes_back(saved: list, ours: list[dict]) -> list:
    """`saved` param groups with a dtype's name turned back into the dtype where `ours` holds a dtype
    (a name that is none stays, for the group's checks to refuse)."""

    def back(name: Any, now: Any) -> Any:
        if not (isinstance(now, torch.dtype) and isinstance(name, str)):
            return name
        found = getattr(torch, name.removeprefix("torch."), None)
        return found if isinstance(found, torch.dtype) else name

    pairs = zip(saved, ours)
    converted = [{k: back(v, g.get(k)) for k, v in s.items()} if isinstance(s, dict) else s for s, g in pairs]
    return converted + saved[len(converted) :]


__all__ = ["LocalState", "StateAttribute", "through_torch_load", "through_torch_state_dict"]
