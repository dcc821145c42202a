"""What a sharded optimizer holds on this rank, counted: its state (masters and owned state
included) and, through its runtime, its parameters, gradients and unsharded buffers."""

from __future__ import annotations

from collections.abc import Iterator

import torch


class MemoryAccounting:
    """`local_state_numel`, `local_state_bytes` and `memory_stats` of a `ShardedOptimizer` (its
    `runtime`, segments' state, `_owned_state` and `opt.state`)."""

    def local_state_numel(self) -> int:
        """Elements of optimizer state (masters included) held by this rank."""
        return sum(t.numel() for t in self._local_state_tensors())

    def local_state_bytes(self) -> int:
        """Bytes of every persistent tensor the optimizer holds on this rank besides the parameters and
        gradients: state, fp32 masters of bf16/fp16 parameters, owned state (Shampoo's), opt.state's steps."""
        return sum(t.numel() * t.element_size() for t in self._local_state_tensors())

    def _local_state_tensors(self) -> Iterator[torch.Tensor]:
        for seg in self.runtime.segments:
            yield from seg.state.values()
            for per_param in self._owned_state(seg):
                yield from (o.tensor for o in per_param if o.tensor is not None)
        yield from self.runtime.masters()
        yield from self.state.held()  # the step counts `opt.state` shows, once read

    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds now: `parameters` (shards, or whole parameters kept by unsharded
        units, in their dtypes), `gradients` (averaged-gradient shards, and those kept unsynced
        across replicas inside `no_all_reduce()`), `state` (`local_state_bytes()`, masters
        included), `unsharded` (gathered parameters and unreduced gradients between gather and free)."""
        stats = self.runtime.memory_stats()
        return {
            "parameters": stats["parameters"],
            "gradients": stats["gradients"],
            "state": self.local_state_bytes(),
            "unsharded": stats["unsharded"],
        }
