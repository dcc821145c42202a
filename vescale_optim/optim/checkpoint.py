"""Checkpoints: torch's full-tensor format and a sharded format for torch.distributed.checkpoint.

`state_dict()` gathers each bucket's flat state once and hands out full tensors per
parameter under torch's names, so it loads at any world size and into torch itself.
`sharded_state_dict()` instead describes each rank's own pieces (as the rectangular
boxes of its flat range), so DCP writes only local data and reshards on load.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist

from ..shard.collectives import all_gather_flat
from ..shard.spec import flat_range_boxes
from . import lowbit

_SQRT = ("exp_avg_sq",)  # stored as sqrt(v) when 8-bit
MASTER = "master"  # the fp32 master of a bf16/fp16 parameter, in torch-format state dicts


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


class CheckpointMixin:
    """state_dict / load_state_dict / sharded_state_dict for `ShardedOptimizer`."""

    # --- hooks a subclass may extend ---------------------------------------------

    def _param_state(self, bucket, i: int, flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """torch-format state of parameter `i` of `bucket` from the gathered flat state."""
        layout, shape = bucket.layout, tuple(bucket.params[i].shape)
        start, size = layout.offsets[i], layout.sizes[i]
        out = {"step": torch.tensor(float(bucket.steps[i]))}
        for name, full in flat.items():
            out[name] = full[start : start + size].view(shape).clone()
        return out

    def _expected_state(self, bucket, i: int) -> dict[str, tuple[int, ...]]:
        """The state keys a parameter must carry on load, with their shapes."""
        shape = tuple(bucket.params[i].shape)
        out = {name: shape for name in self._export_names(bucket)}
        return out if self._stepless(bucket) else {"step": (), **out}

    def _stepless(self, bucket) -> bool:
        """Whether the bucket's math ignores the step count (torch then keeps none)."""
        return False

    def _export_names(self, bucket) -> list[str]:
        return bucket.state_names

    def _export_locals(self, bucket) -> dict[str, torch.Tensor]:
        """Local flat state in fp32 under torch's names, one element per local-slice element.

        fp32 state is returned as itself (so loading writes it in place); bf16 or 8-bit
        state is decoded into copies, and `_commit_locals` encodes them back.
        """
        kind = self._kind(bucket)
        return {n: lowbit.decode(bucket.state, n, kind, sqrt=n in _SQRT) for n in self._export_names(bucket)}

    def _commit_locals(self, bucket, local: dict[str, torch.Tensor]) -> None:
        """Store values written into `_export_locals`' tensors back into the state."""
        kind = self._kind(bucket)
        for name, x in local.items():
            lowbit.encode_(bucket.state, name, kind, x, sqrt=name in _SQRT)

    # --- full format --------------------------------------------------------------

    def _group_entries(self) -> list[dict]:
        groups, start = [], 0
        for g in self.param_groups:
            entry = {k: v for k, v in g.items() if k != "params"}
            entry["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(entry)
        return groups

    @torch.no_grad()
    def state_dict(self) -> dict:
        """torch.optim format with full tensors and torch's state names (collective).

        A parameter that never stepped has no entry, as in torch. bf16/fp16 parameters
        also carry their fp32 master under `MASTER`, which torch.optim ignores.
        """
        state = {}
        for b in self._buckets:
            flat = {name: all_gather_flat(t, self._comm) for name, t in self._export_locals(b).items()}
            if b.master is not None:
                flat[MASTER] = all_gather_flat(b.master, self._comm)
            for i, index in enumerate(b.indices):
                if b.steps[i] > 0:
                    state[index] = self._param_state(b, i, flat)
        return {"state": state, "param_groups": self._group_entries()}

    def _validate(self, state_dict: dict) -> dict[int, dict]:
        """Check everything that shapes state before anything changes; return the state
        by param index."""
        if not isinstance(state_dict, dict) or "param_groups" not in state_dict or "state" not in state_dict:
            raise ValueError("optimizer state dict must have 'state' and 'param_groups'")
        saved = state_dict["param_groups"]
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
        order = [i for s in saved for i in s["params"]]
        if len(set(order)) != len(order):
            raise ValueError("state dict lists a parameter in more than one place")
        position = {saved_id: pos for pos, saved_id in enumerate(order)}
        unknown = [k for k in state_dict["state"] if k not in position]
        if unknown:
            raise ValueError(f"state dict has state for parameters {unknown} that no param group lists")
        by_index = {position[k]: v for k, v in state_dict["state"].items()}
        for b in self._buckets:
            present = [i for i, index in enumerate(b.indices) if index in by_index]
            steps = set()
            for i in present:
                index, st = b.indices[i], by_index[b.indices[i]]
                expected = self._expected_state(b, i)
                if MASTER in st and b.master is not None:  # optional; ignored without a master
                    expected[MASTER] = tuple(b.params[i].shape)
                for name, shape in expected.items():
                    if name not in st:
                        raise ValueError(f"parameter {index}: state dict lacks '{name}'")
                    got = tuple(torch.as_tensor(st[name]).shape)
                    if got != shape:
                        raise ValueError(f"parameter {index}: '{name}' has shape {got}, expected {shape}")
                steps.add(_step_count(st, index))
            if self._whole_buckets and present and (len(present) != len(b.indices) or len(steps) > 1):
                raise ValueError(
                    f"parameters {b.indices} share a bucket whose parameters step together, but the state "
                    f"dict has state for {[b.indices[i] for i in present]} with steps {sorted(steps)}"
                )
        return by_index

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch-format state (ours or torch's, any world size); refuses anything that
        does not fit before modifying anything."""
        by_index = self._validate(state_dict)
        for g, s in zip(self.param_groups, state_dict["param_groups"]):
            g.update({k: copy.deepcopy(v) for k, v in s.items() if k not in ("params", "param_names")})
        for b in self._buckets:
            present = [i for i, index in enumerate(b.indices) if index in by_index]
            b.steps = [_step_count(by_index[index], index) if index in by_index else 0 for index in b.indices]
            local = self._export_locals(b)
            for t in local.values():
                t.zero_()
            for i in present:
                self._load_param_state(b, i, by_index[b.indices[i]], local)
            self._commit_locals(b, local)
            if b.master is not None:
                b.master.copy_(b.pbuf.local)
                for i in present:
                    if MASTER in by_index[b.indices[i]]:
                        self._load_slice(b, i, by_index[b.indices[i]][MASTER], b.master)

    def _load_param_state(self, bucket, i: int, state: dict, local: dict[str, torch.Tensor]) -> None:
        for name, flat in local.items():
            self._load_slice(bucket, i, state[name], flat)

    @staticmethod
    def _load_slice(bucket, i: int, full, flat: torch.Tensor) -> None:
        """Write this rank's piece of parameter `i`'s full tensor `full` into the local `flat`."""
        start, stop = bucket.pbuf.tensor_range(i)
        lo, hi = bucket.pbuf.local_range(i)
        flat[lo:hi].copy_(torch.as_tensor(full).reshape(-1)[start:stop])

    # --- sharded format (torch.distributed.checkpoint) ----------------------------

    def _sharded(self, bucket, i: int, local: torch.Tensor):
        """Rank-local piece of parameter `i`'s state `local` as a DCP-writable tensor."""
        shape = tuple(bucket.params[i].shape)
        lo, hi = bucket.pbuf.local_range(i)
        if not self._comm.distributed:
            return local[lo:hi].view(shape)
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
        from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

        layout, world = bucket.layout, self._comm.world_size
        ranks = [dist.get_global_rank(self._comm.group, r) if self._comm.group else r for r in range(world)]
        device = local.device.type
        metas, mine = [], []
        for r in range(world):
            a, b = layout.rank_range(i, r)
            start = a - layout.offsets[i]
            pos = start
            for off, size in flat_range_boxes(shape, start, b - layout.offsets[i]):
                n = int(torch.Size(size).numel())
                md = ShardMetadata(list(off), list(size), f"rank:{ranks[r]}/{device}")
                metas.append(md)
                if r == self._comm.rank:
                    view = local[lo + pos - start : lo + pos - start + n].view(size)
                    mine.append(Shard(view, md))
                pos += n
        props = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False)
        meta = ShardedTensorMetadata(metas, torch.Size(shape), props)
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            mine, meta, process_group=self._comm.group
        )

    def sharded_state_dict(self) -> dict:
        """State whose tensors are views of this rank's pieces, keyed by parameter index.

        Pass it to `torch.distributed.checkpoint.save`; to restore, build the optimizer
        (any world size), call `dcp.load` on a fresh `sharded_state_dict()` and then
        `load_sharded_state_dict` with it.
        """
        state = {}
        self._staged = {}
        for k, b in enumerate(self._buckets):
            tensors = self._staged[k] = self._export_locals(b)
            if b.master is not None:
                tensors["master"] = b.master
            for i, index in enumerate(b.indices):
                entry = {"step": torch.tensor(float(b.steps[i]))}
                for name, local in tensors.items():
                    entry[name] = self._sharded(b, i, local)
                state[str(index)] = entry
        return {"state": state}

    @torch.no_grad()
    def load_sharded_state_dict(self, state_dict: dict) -> None:
        """Finish a DCP load: tensors were filled in place; restore steps and masters."""
        for k, b in enumerate(self._buckets):
            steps = [int(float(state_dict["state"][str(index)]["step"])) for index in b.indices]
            if self._whole_buckets and len(set(steps)) != 1:
                raise ValueError(f"parameters {b.indices} share a bucket but have steps {sorted(set(steps))}")
            b.steps = steps
            staged = getattr(self, "_staged", {}).get(k)
            if staged is None:
                raise RuntimeError("call sharded_state_dict() before load_sharded_state_dict()")
            self._commit_locals(b, {n: t for n, t in staged.items() if n != "master"})
            if b.master is not None:
                b.pbuf.local.copy_(b.master)
        self._gather_params()
