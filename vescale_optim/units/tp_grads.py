"""Where a tensor-parallel parameter's reduced gradient sits in the whole (`TPPlace`).

A DTensor parameter's averaged gradient lives in this rank's piece of its TP shard's
data-parallel layout. Its `.grad` (a `ReducedGrad`) reads as the DTensor gradient it stands for:
the parameter's global shape, its `placements` and `device_mesh`, `to_local()` (the TP shard's
own gradient), `full_tensor()` (the whole gradient, gathered over the data-parallel group and
then over TP), and whole-tensor reductions that add the TP shards' parts over the TP group
(`across`) for a `Shard`-placed parameter and count a replicated one once. So torch's own
`clip_grad_norm_` / `get_total_norm` give the norm of the whole model, as with FSDP2 after TP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..shard.comm import Comm
from .tensor_parallel import is_dtensor, local_shape, tp_full, tp_slice


@dataclass(frozen=True, eq=False)
class TPPlace:
    """The DTensor parameter `param` whose gradient this is (mesh, placements, global shape),
    and `across`: the TP group over which its shards' parts add up (None: replicated over TP)."""

    param: torch.Tensor
    across: Comm | None

    @property
    def local_shape(self) -> tuple[int, ...]:
        return local_shape(self.param)

    def whole(self, t: torch.Tensor) -> torch.Tensor:
        """The whole tensor of which `t` (of the local shape) is this rank's TP shard (collective
        over TP, by DTensor)."""
        return tp_full(self.param, t)

    def slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's TP shard of `full` (of the global shape; a view)."""
        return tp_slice(self.param, full)


def tp_places(params: list[torch.Tensor]) -> list[TPPlace | None]:
    """Each parameter's `TPPlace` (None for a plain one); one `Comm` per TP group."""
    comms: dict[int, Comm] = {}
    out: list[TPPlace | None] = []
    for p in params:
        if not is_dtensor(p):
            out.append(None)
            continue
        dims = [d for d, pl in enumerate(p.placements) if pl.is_shard()]
        if len(dims) > 1:
            raise NotImplementedError(
                f"a DTensor parameter sharded on {len(dims)} mesh dimensions ({tuple(p.placements)}); "
                "one tensor-parallel dimension is supported yet"
            )
        across = None
        if dims:
            group = p.device_mesh.get_group(dims[0])
            across = comms.setdefault(id(group), Comm(group))
        out.append(TPPlace(p, across))
    return out


__all__ = ["TPPlace", "tp_places"]
