"""What a unit's gradients read of their `Unit` (`UnitView`), as a type below `unit`.

`unit` imports `grad_buffers` (a unit owns its `GradBuffers`), which imports `reduced_grad`;
both read their unit back. Naming `unit.Unit` there, even for types only, would close an
import circle; they name this Protocol instead, which `Unit` satisfies.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from ..shard.buffer import FlatBuffer
from ..shard.comm import Comm
from ..shard.layout import Layout
from .streams import Streams


class ReducedShard(Protocol):
    """What a `ReducedGrad` reads of its unit's `GradBuffers`: the reduced shard, once waited for."""

    @property
    def shard(self) -> torch.Tensor: ...

    def wait(self) -> None: ...


class UnitView(Protocol):
    """The parts of a `Unit` its `GradBuffers` and `ReducedGrad`s read."""

    params: list[nn.Parameter]
    labels: list[str]
    comm: Comm
    reduce_comm: Comm
    streams: Streams
    layout: Layout
    full: FlatBuffer
    device: torch.device
    shard_dtype: torch.dtype
    reduce_dtype: torch.dtype

    @property
    def grads(self) -> ReducedShard: ...
