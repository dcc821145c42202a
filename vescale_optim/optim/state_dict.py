"""The optimizer's state dict: torch's full-tensor format and a sharded format for DCP.

`StateIO.fill` gathers each segment's flat state once (onto every rank, or onto one) and
hands out full tensors per parameter under torch's names, so a state dict loads at any
world size and into torch itself. Extra per-parameter state that lives whole on one
rank of the world (Shampoo's factors and roots: `Owned`) is declared by the optimizer
and rides the same path: gathered from its owners, validated by shape, loaded on the
rank that owns it now. The sharded format for DCP, each rank's own pieces keyed by parameter
name, is `sharded_state`'s.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..shard.collectives import Comm, all_gather_flat, full_tensor, redistribute
from ..shard.redistribution import owner_offsets
from ..shard.spec import RaggedShard
from ..units.segment import Segment
from ..units.tensor_parallel import check_same_shard, is_dtensor, local_shape, tp_full, tp_slice

MASTER = "master"  # the fp32 master of a bf16/fp16 parameter, in both state dict formats


class Coded(Protocol):
    """How an owned tensor is stored when not as its values (`state_tiers.Kept`)."""

    def decode(self) -> torch.Tensor: ...
    def encode_(self, x: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class Owned:
    """A state tensor of one parameter kept whole on one rank of the world: `key` in the
    parameter's state, its `shape`, the world rank that holds it and, on that rank, the
    tensor itself (None elsewhere): what it stores, its values unless `coded` (a low-bit
    tier: int8 codes and scales), which then decodes and encodes them."""

    key: str
    shape: tuple[int, ...]
    owner: int
    tensor: torch.Tensor | None
    coded: Coded | None = None

    def values(self) -> torch.Tensor:
        """The values (on the owner): the tensor itself, or a decoded fp32 copy."""
        return self.tensor if self.coded is None else self.coded.decode().view(self.shape)

    def assign_(self, x: torch.Tensor) -> None:
        """Store `x` as the values (on the owner); a no-op for the tensor itself."""
        if self.coded is not None:
            self.coded.encode_(x)
        elif x is not self.tensor:
            self.tensor.copy_(x)


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


class Gather:
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

    def __call__(self, local: torch.Tensor, counts: Sequence[int] | None = None) -> torch.Tensor | None:
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


class StateIO:
    """Moves the state of `segments` between the shards and the two state-dict formats.

    `param_groups` is the optimizer's own list; `structural` the param-group keys that
    shape the state; `stepless(seg)` whether a segment's math ignores step counts (torch
    then saves none); `owned(seg)` the `Owned` tensors of each of its parameters (the
    same keys, shapes and owners on every rank); `comm` the shard group, `world` every rank
    (owned tensors are gathered from it when it is wider: `replicas`, FSDP2's shards), `owned_world`
    the group whose ranks owners are when wider still (Shampoo's dp x tp world under TP); `publish()`
    refreshes the parameters kept whole after the masters were loaded in place.
    """

    def __init__(
        self,
        segments: Sequence[Segment],
        param_groups: list[dict],
        structural: Sequence[str],
        *,
        comm: Comm,
        world: Comm,
        replicas: int,
        stepless: Callable[[Segment], bool],
        owned: Callable[[Segment], list[list[Owned]]],
        publish: Callable[[], None],
    ):
        self.segments, self.param_groups, self.structural = list(segments), param_groups, tuple(structural)
        self.comm, self.world, self.replicas = comm, world, replicas
        self.stepless, self.owned, self.publish, self.owned_world = stepless, owned, publish, None

    # --- flat state under torch's names --------------------------------------------------

    @staticmethod
    def _locals(seg: Segment) -> dict[str, torch.Tensor]:
        """Local flat state decoded under torch's names, one element per local-slice element.

        State its tier keeps exactly is returned as itself (so loading writes it in place);
        other state is decoded into copies (by the segment's codec, from its `StateSpec`s),
        and `_commit` encodes them back."""
        return {n: seg.read(n) for n in seg.state_names}

    @staticmethod
    def _commit(seg: Segment, local: dict[str, torch.Tensor]) -> None:
        """Store values written into `_locals`' tensors back into the state."""
        for name, x in local.items():
            seg.store(name, x)

    def _expected(self, seg: Segment, i: int, owned: list[Owned]) -> dict[str, tuple[int, ...]]:
        """The state keys parameter `i` must carry on load, with their shapes."""
        shape = tuple(seg.params[i].shape)  # a DTensor's: the whole tensor's (state dicts hold it whole)
        out = {name: shape for name in seg.state_names}
        out.update({o.key: o.shape for o in owned})
        return out if self.stepless(seg) else {"step": (), **out}

    # --- full format ---------------------------------------------------------------------------

    def _gather_owned(self, seg: Segment, owned: list[list[Owned]], gather: Gather):
        """Every owned tensor of `seg` as a flat full tensor, `{(param, key): tensor}`, on the
        receiving ranks (gathered from their owners; None elsewhere)."""
        flat = [o for per_param in owned for o in per_param]
        if not flat:
            return {}
        owners = self.owned_world or self.world
        if self.replicas > 1 or owners is not gather.comm:  # owned state lives once: gather it from all
            full_gather = Gather(owners, None, gather.cpu_offload)
        else:
            full_gather = gather
        world = full_gather.comm.world_size
        numels = [math.prod(o.shape) for o in flat]
        offsets, totals = owner_offsets(numels, [o.owner for o in flat], world)
        mine = [o.values().reshape(-1) for o in flat if o.owner == owners.rank]
        like = seg.local_params
        local = torch.cat(mine) if mine else like.new_zeros(0)
        full = full_gather(local, totals)
        if full is None or not gather.receives:
            return None
        starts = [sum(totals[:r]) for r in range(world)]
        out, k = {}, 0
        for i, per_param in enumerate(owned):
            for o in per_param:
                at = starts[o.owner] + offsets[k]
                out[i, o.key] = full[at : at + numels[k]].view(o.shape).clone()
                k += 1
        return out

    @torch.no_grad()
    def fill(self, state_dict: dict, gather: Gather) -> None:
        """Put the full per-parameter state into torch's packed `state_dict` (collective).
        A parameter that never stepped has no entry, as in torch."""
        state, tp = {}, {}
        # a DTensor parameter's state is gathered whole over its TP ranks after the data-parallel
        # gathers (then moved to the CPU), in parameter order: the same on all of them
        tp_model = any(is_dtensor(p) for seg in self.segments for p in seg.params)
        local = Gather(gather.comm, gather.to_rank, False) if tp_model else gather
        for seg in self.segments:
            flat = {name: local(t, seg.counts) for name, t in self._locals(seg).items()}
            if seg.master is not None:
                flat[MASTER] = local(seg.master, seg.counts)
            extra = self._gather_owned(seg, self.owned(seg), gather)
            if not gather.receives:
                continue
            for i, index in enumerate(seg.indices):
                if seg.steps[i] == 0:
                    continue
                shape = local_shape(seg.params[i])
                start, size = seg.flat_offset(i), seg.layout.sizes[i]
                entry = {"step": torch.tensor(float(seg.steps[i]))}
                for name, full in flat.items():
                    entry[name] = full[start : start + size].view(shape).clone()
                entry.update({key: t for (j, key), t in extra.items() if j == i})
                state[index] = entry
                if is_dtensor(seg.params[i]):  # its shard's state made whole (owned state is already)
                    tp[index] = seg.params[i], list(flat)
        for index, (p, names) in sorted(tp.items()):
            state[index].update({n: tp_full(p, state[index][n]) for n in names})
        for entry in state.values() if local is not gather and gather.cpu_offload else ():
            entry.update({k: v.cpu() for k, v in entry.items()})
        state_dict["state"] = state

    def validate_groups(self, saved: list[dict]) -> None:
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
            for key in self.structural:
                if key in s and s[key] != g.get(key):
                    raise ValueError(
                        f"param group {gi}: state dict has {key}={s[key]!r}, the optimizer {key}="
                        f"{g.get(key)!r}; it shapes the state, so build the optimizer with {key}={s[key]!r}"
                    )

    def install_groups(self, saved: list[dict]) -> None:
        """Take the saved hyperparameters (learning rates a scheduler set included)."""
        for g, s in zip(self.param_groups, saved):
            g.update({k: copy.deepcopy(v) for k, v in s.items() if k not in ("params", "param_names")})

    def _validate(self, state_dict: dict, owned: dict[int, list[list[Owned]]]) -> dict[int, dict]:
        """Check everything that shapes state before anything changes; return the state
        by param index."""
        if not isinstance(state_dict, dict) or "param_groups" not in state_dict or "state" not in state_dict:
            raise ValueError("optimizer state dict must have 'state' and 'param_groups'")
        saved = state_dict["param_groups"]
        self.validate_groups(saved)
        order = [i for s in saved for i in s["params"]]
        if len(set(order)) != len(order):
            raise ValueError("state dict lists a parameter in more than one place")
        position = {saved_id: pos for pos, saved_id in enumerate(order)}
        unknown = [k for k in state_dict["state"] if k not in position]
        if unknown:
            raise ValueError(f"state dict has state for parameters {unknown} that no param group lists")
        by_index = {position[k]: v for k, v in state_dict["state"].items()}
        for seg in self.segments:
            for i, index in enumerate(seg.indices):
                if index not in by_index:
                    continue
                st = by_index[index]
                expected = self._expected(seg, i, owned[id(seg)][i])
                if MASTER in st and seg.master is not None:  # optional; ignored without a master
                    expected[MASTER] = tuple(seg.params[i].shape)
                for name, shape in expected.items():
                    if name not in st:
                        raise ValueError(f"parameter {index}: state dict lacks '{name}'")
                    check_same_shard(seg.params[i], st[name], f"parameter {index}: '{name}'")
                    got = tuple(torch.as_tensor(st[name]).shape)
                    if got != shape:
                        raise ValueError(f"parameter {index}: '{name}' has shape {got}, expected {shape}")
                _step_count(st, index)  # a count of steps, or refused
        return by_index

    @torch.no_grad()
    def load(self, state_dict: dict) -> None:
        """Load torch-format state (ours or torch's, any world size); refuses anything that
        does not fit before modifying anything. A parameter without state starts afresh."""
        owned = {id(seg): self.owned(seg) for seg in self.segments}
        by_index = self._validate(state_dict, owned)
        self.install_groups(state_dict["param_groups"])
        for seg in self.segments:
            present = [i for i, index in enumerate(seg.indices) if index in by_index]
            seg.set_steps([_step_count(by_index[i], i) if i in by_index else 0 for i in seg.indices])
            local = self._locals(seg)
            for t in local.values():
                t.zero_()
            for i in present:
                for name, flat in local.items():
                    self._load_slice(seg, i, by_index[seg.indices[i]][name], flat)
            self._commit(seg, local)
            for i, per_param in enumerate(owned[id(seg)]):
                for o in per_param:
                    if o.tensor is None:
                        continue
                    if i in present:
                        o.assign_(torch.as_tensor(by_index[seg.indices[i]][o.key]).to(o.tensor.device))
                    else:
                        o.assign_(torch.zeros(o.shape, device=o.tensor.device))
            if seg.master is not None:
                self._load_masters(seg, [i for i in present if MASTER in by_index[seg.indices[i]]], by_index)

    @classmethod
    def _load_masters(cls, seg: Segment, members: list[int], by_index: dict) -> None:
        """Take the saved fp32 masters where they round to the parameter's current value;
        elsewhere the parameter was written after they were saved, and it wins."""
        if not members:
            return
        seg.unit.refresh_shard()
        saved = torch.zeros_like(seg.master)
        taken = torch.zeros(seg.master.numel(), dtype=torch.bool, device=seg.master.device)
        for i in members:
            cls._load_slice(seg, i, by_index[seg.indices[i]][MASTER], saved)
            lo, hi = seg.local_range(i)
            taken[lo:hi] = True
        dtype = seg.unit.orig_dtype
        keep = taken & (saved.to(dtype) == seg.master.to(dtype))
        seg.master[keep] = saved[keep]

    @staticmethod
    def _load_slice(seg: Segment, i: int, full, flat: torch.Tensor) -> None:
        """Write this rank's piece of parameter `i`'s full tensor `full` into the local `flat`."""
        start, stop = seg.tensor_range(i)
        lo, hi = seg.local_range(i)
        p = seg.params[i]
        if is_dtensor(full):  # of p's mesh and placements (checked): its local tensor is p's shard
            full = full.to_local()
        elif is_dtensor(p):  # the whole tensor: this TP rank's shard of it
            full = tp_slice(p, torch.as_tensor(full).to(flat.device))
        flat[lo:hi].copy_(torch.as_tensor(full).reshape(-1)[start:stop])
