"""Checkpoints: torch's full-tensor format and a sharded format for torch.distributed.checkpoint.

`state_dict()` gathers each seg's flat state once (onto every rank, or onto one) and
hands out full tensors per parameter under torch's names, so it loads at any world size
and into torch itself. It and `load_state_dict()` run inside torch's own methods, so the
optimizer's state-dict hooks fire as for any `torch.optim` optimizer.
`sharded_state_dict()` instead describes each rank's own pieces (`shard.dcp.DcpPiece`),
so DCP writes only local data and reshards on load.
"""

from __future__ import annotations

import copy
import math

import torch

from ..shard.collectives import Comm, all_gather_flat, full_tensor, redistribute
from ..shard.spec import RaggedShard
from ..units.unit import LOW_PRECISION
from . import lowbit

_SQRT = ("exp_avg_sq",)  # stored as sqrt(v) when 8-bit
MASTER = "master"  # the fp32 master of a bf16/fp16 parameter, in both state dict formats


def _step_count(state: dict, index: int) -> int:
    """A parameter's step count from its saved state; without one (torch.optim.Muon keeps
    none), state present means it stepped at least once."""
    if "step" not in state:
        return 1
    step = torch.as_tensor(state["step"])
    step = float(step) if step.numel() == 1 else math.nan
    if not (math.isfinite(step) and step >= 0 and step == int(step)):
        raise ValueError(f"parameter {index}: 'step' is {step}, not a count of steps")
    return max(int(step), 1)


class _Gather:
    """Where `state_dict()` assembles full tensors: on every rank (all-gather) or only on
    `to_rank` (a gather: the other ranks receive and allocate nothing), optionally on CPU."""

    def __init__(self, comm: Comm, to_rank: int | None, cpu_offload: bool):
        if to_rank is not None and not (isinstance(to_rank, int) and 0 <= to_rank < comm.world_size):
            raise ValueError(
                f"to_rank must be a rank of the optimizer's process group, 0..{comm.world_size - 1}; "
                f"got {to_rank!r}"
            )
        self.comm, self.to_rank, self.cpu_offload = comm, to_rank, cpu_offload
        self.receives = to_rank is None or to_rank == comm.rank

    def __call__(self, local: torch.Tensor, counts: list[int] | None = None) -> torch.Tensor | None:
        """Every rank's flat `local` (`counts[r]` elements on rank r; equal if None) in rank
        order, on the receiving ranks; None elsewhere."""
        world = self.comm.world_size
        if counts is None and self.to_rank is None:
            full = all_gather_flat(local, self.comm)
        else:
            counts = tuple(counts) if counts is not None else (local.numel(),) * world
            shape, placement = (sum(counts),), RaggedShard((0,), counts)
            if self.to_rank is None:
                full, _ = full_tensor(local, shape, placement, self.comm)
            else:
                owner = RaggedShard.owned(self.to_rank, world)
                full, _ = redistribute(local, shape, placement, owner, self.comm)
        if not self.receives:
            return None
        return full.cpu() if self.cpu_offload else full


class CheckpointMixin:
    """state_dict / load_state_dict / sharded_state_dict for `ShardedOptimizer`."""

    # --- hooks a subclass may extend ---------------------------------------------

    def _param_state(self, seg, i: int, flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """torch-format state of parameter `i` of `seg` from the gathered flat state."""
        shape = tuple(seg.params[i].shape)
        start, size = seg.flat_offset(i), seg.layout.sizes[i]
        out = {"step": torch.tensor(float(seg.steps[i]))}
        for name, full in flat.items():
            out[name] = full[start : start + size].view(shape).clone()
        return out

    def _expected_state(self, seg, i: int) -> dict[str, tuple[int, ...]]:
        """The state keys a parameter must carry on load, with their shapes."""
        shape = tuple(seg.params[i].shape)
        out = {name: shape for name in self._export_names(seg)}
        return out if self._stepless(seg) else {"step": (), **out}

    def _stepless(self, seg) -> bool:
        """Whether the seg's math ignores the step count (torch then keeps none)."""
        return False

    def _export_names(self, seg) -> list[str]:
        return seg.state_names

    def _export_locals(self, seg) -> dict[str, torch.Tensor]:
        """Local flat state in fp32 under torch's names, one element per local-slice element.

        fp32 state is returned as itself (so loading writes it in place); bf16 or 8-bit
        state is decoded into copies, and `_commit_locals` encodes them back.
        """
        kind = self._kind(seg)
        return {n: lowbit.decode(seg.state, n, kind, sqrt=n in _SQRT) for n in self._export_names(seg)}

    def _commit_locals(self, seg, local: dict[str, torch.Tensor]) -> None:
        """Store values written into `_export_locals`' tensors back into the state."""
        kind = self._kind(seg)
        for name, x in local.items():
            lowbit.encode_(seg.state, name, kind, x, sqrt=name in _SQRT)

    # --- full format --------------------------------------------------------------

    def state_dict(self, *, to_rank: int | None = None, cpu_offload: bool = False) -> dict:
        """torch.optim format with full tensors and torch's state names.

        Collective: every rank of the optimizer's group must call it. By default every
        rank receives everything; with `to_rank=r` the state is gathered to group rank
        `r` only and the other ranks get `{"state": {}, "param_groups": [...]}`;
        `cpu_offload=True` puts the full tensors in CPU memory. Runs inside
        `torch.optim.Optimizer.state_dict`, so state-dict hooks fire as in torch.

        A parameter that never stepped has no entry, as in torch. bf16/fp16 parameters
        also carry their fp32 master under `MASTER`, a key torch.optim ignores.
        """
        gather = _Gather(self._comm, to_rank, cpu_offload)
        hook = self.register_state_dict_post_hook(lambda opt, sd: opt._fill_state(sd, gather), prepend=True)
        try:
            return super().state_dict()
        finally:
            hook.remove()

    @torch.no_grad()
    def _fill_state(self, state_dict: dict, gather: _Gather) -> None:
        """Put the full per-parameter state into torch's packed `state_dict` (the collective part)."""
        state = {}
        for seg in self._segments:
            flat = {name: gather(t, seg.counts) for name, t in self._export_locals(seg).items()}
            if seg.master is not None:
                flat[MASTER] = gather(seg.master, seg.counts)
            if not gather.receives:
                continue
            for i, index in enumerate(seg.indices):
                if seg.steps[i] > 0:
                    state[index] = self._param_state(seg, i, flat)
        state_dict["state"] = state

    def _validate_groups(self, saved: list[dict]) -> None:
        """Saved param groups must match ours in number, sizes and state-shaping keys."""
        if len(saved) != len(self.param_groups):
            raise ValueError(
                f"state dict has {len(saved)} param groups, the optimizer has {len(self.param_groups)}"
            )
        for gi, (s, g) in enumerate(zip(saved, self.param_groups)):
            if len(s["params"]) != len(g["params"]):
                raise ValueError(
                    f"param group {gi}: state dict has {len(s['params'])} params, "
                    f"optimizer has {len(g['params'])}"
                )
            for key in self._structural:
                if key in s and s[key] != g.get(key):
                    raise ValueError(
                        f"param group {gi}: state dict has {key}={s[key]!r}, the optimizer {key}="
                        f"{g.get(key)!r}; it shapes the state, so build the optimizer with {key}={s[key]!r}"
                    )

    def _install_groups(self, saved: list[dict]) -> None:
        """Take the saved hyperparameters (learning rates a scheduler set included)."""
        for g, s in zip(self.param_groups, saved):
            g.update({k: copy.deepcopy(v) for k, v in s.items() if k not in ("params", "param_names")})

    def _validate(self, state_dict: dict) -> dict[int, dict]:
        """Check everything that shapes state before anything changes; return the state
        by param index."""
        if not isinstance(state_dict, dict) or "param_groups" not in state_dict or "state" not in state_dict:
            raise ValueError("optimizer state dict must have 'state' and 'param_groups'")
        saved = state_dict["param_groups"]
        self._validate_groups(saved)
        order = [i for s in saved for i in s["params"]]
        if len(set(order)) != len(order):
            raise ValueError("state dict lists a parameter in more than one place")
        position = {saved_id: pos for pos, saved_id in enumerate(order)}
        unknown = [k for k in state_dict["state"] if k not in position]
        if unknown:
            raise ValueError(f"state dict has state for parameters {unknown} that no param group lists")
        by_index = {position[k]: v for k, v in state_dict["state"].items()}
        for seg in self._segments:
            present = [i for i, index in enumerate(seg.indices) if index in by_index]
            for i in present:
                index, st = seg.indices[i], by_index[seg.indices[i]]
                expected = self._expected_state(seg, i)
                if MASTER in st and seg.master is not None:  # optional; ignored without a master
                    expected[MASTER] = tuple(seg.params[i].shape)
                for name, shape in expected.items():
                    if name not in st:
                        raise ValueError(f"parameter {index}: state dict lacks '{name}'")
                    got = tuple(torch.as_tensor(st[name]).shape)
                    if got != shape:
                        raise ValueError(f"parameter {index}: '{name}' has shape {got}, expected {shape}")
                _step_count(st, index)  # a count of steps, or refused
        return by_index

    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch-format state (ours or torch's, any world size); refuses anything that
        does not fit before modifying anything.

        Runs inside `torch.optim.Optimizer.load_state_dict` (so its hooks fire and a load
        pre-hook may return a new dict): the loading is a pre-hook appended last, which
        sees the final dict and hands torch an empty `state` to install.
        """

        def load(opt, final: dict) -> dict:
            opt._load_state(final)
            return {**final, "state": {}}

        hook = self.register_load_state_dict_pre_hook(load)
        try:
            super().load_state_dict(state_dict)
        finally:
            hook.remove()

    def __setstate__(self, state: dict) -> None:
        """torch's `load_state_dict` installs the loaded param groups through here: update
        ours in place, since the segments hold references to them."""
        groups = state.get("param_groups")
        if groups is not None and getattr(self, "_segments", None) is not None:
            for g, new in zip(self.param_groups, groups):
                g.update(new)
            state = {k: v for k, v in state.items() if k != "param_groups"}
        super().__setstate__(state)

    @torch.no_grad()
    def _load_state(self, state_dict: dict) -> None:
        by_index = self._validate(state_dict)
        self._install_groups(state_dict["param_groups"])
        for seg in self._segments:
            present = [i for i, index in enumerate(seg.indices) if index in by_index]
            seg.steps = [_step_count(by_index[i], i) if i in by_index else 0 for i in seg.indices]
            local = self._export_locals(seg)
            for t in local.values():
                t.zero_()
            for i in present:
                self._load_param_state(seg, i, by_index[seg.indices[i]], local)
            self._commit_locals(seg, local)
            if seg.master is not None:
                self._load_masters(seg, [i for i in present if MASTER in by_index[seg.indices[i]]], by_index)

    @staticmethod
    def _load_masters(seg, members: list[int], by_index: dict) -> None:
        """Take the saved fp32 masters where they round to the parameter's current value;
        elsewhere the parameter was written after they were saved, and it wins."""
        if not members:
            return
        seg.unit.refresh_shard()
        saved = torch.zeros_like(seg.master)
        taken = torch.zeros(seg.master.numel(), dtype=torch.bool, device=seg.master.device)
        for i in members:
            CheckpointMixin._load_slice(seg, i, by_index[seg.indices[i]][MASTER], saved)
            lo, hi = seg.local_range(i)
            taken[lo:hi] = True
        dtype = seg.unit.orig_dtype
        keep = taken & (saved.to(dtype) == seg.master.to(dtype))
        seg.master[keep] = saved[keep]

    def _load_param_state(self, seg, i: int, state: dict, local: dict[str, torch.Tensor]) -> None:
        for name, flat in local.items():
            self._load_slice(seg, i, state[name], flat)

    @staticmethod
    def _load_slice(seg, i: int, full, flat: torch.Tensor) -> None:
        """Write this rank's piece of parameter `i`'s full tensor `full` into the local `flat`."""
        start, stop = seg.tensor_range(i)
        lo, hi = seg.local_range(i)
        flat[lo:hi].copy_(torch.as_tensor(full).reshape(-1)[start:stop])

    # --- sharded format (torch.distributed.checkpoint) ----------------------------

    def _piece(self, seg, i: int, name: str):
        """This rank's piece of parameter `i`'s state `name` (or its fp32 "master") for DCP:
        a view of fp32 state, or a reader that decodes low-bit state when DCP writes it."""
        from ..shard.dcp import dcp_piece

        shape = tuple(seg.params[i].shape)
        start, stop = seg.tensor_range(i)
        lo, hi = seg.local_range(i)
        if name == MASTER:
            return dcp_piece(shape, start, stop, seg.master[lo:hi])
        kind, sqrt = self._kind(seg), name in _SQRT
        if kind == "fp32":
            return dcp_piece(shape, start, stop, seg.state[name][lo:hi])

        def read(a: int, b: int) -> torch.Tensor:
            return lowbit.decode_range(seg.state, name, kind, lo + a, lo + b, sqrt=sqrt)

        device = seg.local_params.device
        return dcp_piece(shape, start, stop, read=read, dtype=torch.float32, device=device)

    def sharded_state_dict(self) -> dict:
        """This rank's pieces of the state, keyed by parameter index, for DCP (no copies).

        Pass it to `torch.distributed.checkpoint.save`; to restore, build the optimizer
        (any world size), call `dcp.load` on a fresh `sharded_state_dict()` and then
        `load_sharded_state_dict` with it. fp32 state is handed as views; bf16 and 8-bit
        state is decoded chunk by chunk only while DCP writes it. The param groups'
        hyperparameters ride along (a scheduler's learning rates come back). Not collective
        itself.
        """
        state = {}
        for seg in self._segments:
            names = self._export_names(seg) + ([MASTER] if seg.master is not None else [])
            for i, index in enumerate(seg.indices):
                entry = {"step": torch.tensor(float(seg.steps[i]))}
                entry.update({name: self._piece(seg, i, name) for name in names})
                state[str(index)] = entry
        groups, start = [], 0
        for g in self.param_groups:
            entry = {k: copy.deepcopy(v) for k, v in g.items() if k not in ("params", "param_names")}
            groups.append({**entry, "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_sharded_state_dict(self, state_dict: dict) -> None:
        """Finish a DCP load (collective): fp32 state and masters were filled in place;
        buffers DCP decoded into are encoded into the low-bit state and dropped."""
        from ..shard.dcp import DcpPiece

        entries = state_dict["state"]
        groups = state_dict.get("param_groups")
        if groups is not None:
            self._validate_groups(groups)
        for seg in self._segments:
            for index in seg.indices:
                for name in self._export_names(seg):
                    if not isinstance(entries[str(index)].get(name), DcpPiece):
                        raise TypeError(
                            f"parameter {index}: '{name}' is not a piece from sharded_state_dict(); "
                            "pass the dict it returned, after dcp.load"
                        )
        if groups is not None:
            self._install_groups(groups)
        for seg in self._segments:
            seg.steps = [int(float(entries[str(index)]["step"])) for index in seg.indices]
            loaded = {}
            for name in self._export_names(seg):
                for i, index in enumerate(seg.indices):
                    buf = entries[str(index)][name].take_loaded()
                    if buf is not None:
                        loaded[name, i] = buf
            if loaded:
                local = self._export_locals(seg)
                for (name, i), buf in loaded.items():
                    lo, hi = seg.local_range(i)
                    local[name][lo:hi].copy_(buf)
                self._commit_locals(seg, {n: local[n] for n, _ in loaded})
        self._publish([u for u in self._units if u.orig_dtype in LOW_PRECISION])
