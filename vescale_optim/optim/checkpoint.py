"""Checkpoints: torch's full-tensor format and a sharded format for torch.distributed.checkpoint.

`state_dict()` gathers each bucket's flat state once and hands out full tensors per
parameter under torch's names, so it loads at any world size and into torch itself.
`sharded_state_dict()` instead describes each rank's own pieces (as the rectangular
boxes of its flat range), so DCP writes only local data and reshards on load.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from ..shard.collectives import all_gather_flat
from ..shard.spec import flat_range_boxes
from . import lowbit

_SQRT = ("exp_avg_sq",)  # stored as sqrt(v) when 8-bit


class CheckpointMixin:
    """state_dict / load_state_dict / sharded_state_dict for `ShardedOptimizer`."""

    # --- hooks a subclass may extend ---------------------------------------------

    def _param_state(self, bucket, i: int, flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """torch-format state of parameter `i` of `bucket` from the gathered flat state."""
        layout, shape = bucket.layout, tuple(bucket.params[i].shape)
        start, size = layout.offsets[i], layout.sizes[i]
        out = {"step": torch.tensor(float(bucket.step))}
        for name, full in flat.items():
            out[name] = full[start : start + size].view(shape).clone()
        return out

    def _expected_state(self, bucket, i: int) -> dict[str, tuple[int, ...]]:
        """The state keys a parameter must carry on load, with their shapes."""
        shape = tuple(bucket.params[i].shape)
        return {name: shape for name in self._export_names(bucket)}

    def _export_names(self, bucket) -> list[str]:
        return self._state_names(bucket)

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
        """torch.optim format with full tensors and torch's state names (collective)."""
        state = {}
        for b in self._buckets:
            flat = {name: all_gather_flat(t, self._comm) for name, t in self._export_locals(b).items()}
            if b.step == 0:
                continue
            for i, index in enumerate(b.indices):
                state[index] = self._param_state(b, i, flat)
        return {"state": state, "param_groups": self._group_entries()}

    def _validate(self, state_dict: dict) -> dict[int, dict]:
        """Check everything before anything changes; return the state by param index."""
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
        order = [i for s in saved for i in s["params"]]
        position = {saved_id: pos for pos, saved_id in enumerate(order)}
        by_index = {position[k]: v for k, v in state_dict["state"].items() if k in position}
        for b in self._buckets:
            present = [i for i, index in enumerate(b.indices) if index in by_index]
            if present and len(present) != len(b.indices):
                missing = [b.indices[i] for i in range(len(b.indices)) if i not in present]
                raise ValueError(f"state dict lacks state for parameters {missing} but has it for others")
            steps = set()
            for i in present:
                index, st = b.indices[i], by_index[b.indices[i]]
                for name, shape in self._expected_state(b, i).items():
                    if name not in st:
                        raise ValueError(f"parameter {index}: state dict lacks '{name}'")
                    got = tuple(torch.as_tensor(st[name]).shape)
                    if got != shape:
                        raise ValueError(f"parameter {index}: '{name}' has shape {got}, expected {shape}")
                steps.add(float(st.get("step", 0)))
            if len(steps) > 1:
                raise ValueError(
                    f"parameters {b.indices} share a bucket but have different steps {sorted(steps)}; "
                    "they must have been stepped together"
                )
        return by_index

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch-format state (ours or torch's, any world size); refuses bad shapes
        before modifying anything."""
        by_index = self._validate(state_dict)
        for g, s in zip(self.param_groups, state_dict["param_groups"]):
            g.update({k: copy.deepcopy(v) for k, v in s.items() if k not in ("params", "param_names")})
        for b in self._buckets:
            if b.master is not None:
                b.master.copy_(b.pbuf.local)
            if b.indices[0] not in by_index:
                b.step = 0
                for t in b.state.values():
                    t.zero_()
                continue
            b.step = int(float(by_index[b.indices[0]].get("step", 0)))
            local = self._export_locals(b)
            for i, index in enumerate(b.indices):
                self._load_param_state(b, i, by_index[index], local)
            self._commit_locals(b, local)

    def _load_param_state(self, bucket, i: int, state: dict, local: dict[str, torch.Tensor]) -> None:
        start, stop = bucket.pbuf.tensor_range(i)
        lo, hi = bucket.pbuf.local_range(i)
        for name, flat in local.items():
            full = torch.as_tensor(state[name]).reshape(-1)
            flat[lo:hi].copy_(full[start:stop])

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
                entry = {"step": torch.tensor(float(b.step))}
                for name, local in tensors.items():
                    entry[name] = self._sharded(b, i, local)
                state[str(index)] = entry
        return {"state": state}

    @torch.no_grad()
    def load_sharded_state_dict(self, state_dict: dict) -> None:
        """Finish a DCP load: tensors were filled in place; restore steps and masters."""
        for k, b in enumerate(self._buckets):
            steps = {float(state_dict["state"][str(index)]["step"]) for index in b.indices}
            if len(steps) != 1:
                raise ValueError(f"parameters {b.indices} share a bucket but have steps {sorted(steps)}")
            b.step = int(steps.pop())
            staged = getattr(self, "_staged", {}).get(k)
            if staged is None:
                raise RuntimeError("call sharded_state_dict() before load_sharded_state_dict()")
            self._commit_locals(b, {n: t for n, t in staged.items() if n != "master"})
            if b.master is not None:
                b.pbuf.local.copy_(b.master)
        self._gather_params()
