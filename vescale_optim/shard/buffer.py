"""Flat buffers: one `W*S` tensor per bucket and role, with every tensor a view into it."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .layout import Layout
from .spec import RaggedShard, Shape


class FlatBuffer:
    """The global buffer of a planned bucket, seen from `rank`.

    `view(i)` is tensor `i` shaped like itself, `local` is the rank's slice
    `[rank*S, (rank+1)*S)` and `local_piece(i)` the flat part of tensor `i` inside it;
    all are views of `data`, so collectives on `data`/`local` move the tensors
    themselves. With `allocate=False` nothing is allocated until `allocate()`: `data` is
    an empty placeholder until then (a buffer made in backward, at the peak, costs
    nothing), so views are made only after the first `allocate()`.
    """

    def __init__(
        self,
        layout: Layout,
        shapes: Sequence[Shape],
        rank: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        allocate: bool = True,
    ):
        shapes = [tuple(s) for s in shapes]
        if [math.prod(s) for s in shapes] != list(layout.sizes):
            raise ValueError("shapes do not match the layout's sizes")
        if not 0 <= rank < layout.world_size:
            raise ValueError(f"rank {rank} outside a world of {layout.world_size}")
        self.layout, self.shapes, self.rank = layout, shapes, rank
        numel = layout.numel if allocate else 0
        self.data = torch.zeros(numel, dtype=dtype, device=device)

    @property
    def shard_size(self) -> int:
        return self.layout.shard_size

    @property
    def allocated(self) -> bool:
        if self.data.numel() != self.layout.numel:
            return False  # the placeholder of `allocate=False`
        return self.data.untyped_storage().nbytes() > 0 or self.data.numel() == 0

    def free(self) -> None:
        """Release the memory; every view keeps its shape and offset but holds nothing
        until `allocate()` (reading it meanwhile is undefined, as for FSDP2's resharded
        parameters)."""
        self.data.untyped_storage().resize_(0)

    def allocate(self, zero: bool = False) -> None:
        """Give the buffer memory again (contents undefined unless `zero`); views made
        before `free()` see it, since they share the storage object."""
        if self.data.numel() != self.layout.numel:  # first allocation of `allocate=False`
            self.data = torch.empty(self.layout.numel, dtype=self.data.dtype, device=self.data.device)
            if zero:
                self.data.zero_()
        elif not self.allocated:
            self.data.untyped_storage().resize_(self.data.numel() * self.data.element_size())
            if zero:
                self.data.zero_()
        elif zero:
            self.data.zero_()

    @property
    def nbytes(self) -> int:
        """Bytes the buffer holds now (0 while freed)."""
        return self.data.untyped_storage().nbytes()

    @property
    def local(self) -> torch.Tensor:
        s = self.layout.shard_size
        return self.data[self.rank * s : (self.rank + 1) * s]

    def view(self, i: int) -> torch.Tensor:
        start = self.layout.offsets[i]
        return self.data[start : start + self.layout.sizes[i]].view(self.shapes[i])

    def local_range(self, i: int) -> tuple[int, int]:
        """Where tensor `i`'s piece lies in the local slice, as [start, stop) ((0, 0) when
        this rank holds none of it)."""
        start, stop = self.layout.rank_range(i, self.rank)
        if stop <= start:
            return 0, 0
        base = self.rank * self.layout.shard_size
        return start - base, stop - base

    def tensor_range(self, i: int) -> tuple[int, int]:
        """Which flat elements of tensor `i` this rank holds, as [start, stop)."""
        start, stop = self.layout.rank_range(i, self.rank)
        return start - self.layout.offsets[i], stop - self.layout.offsets[i]

    def local_piece(self, i: int) -> torch.Tensor:
        start, stop = self.local_range(i)
        return self.local[start:stop]

    def placement(self, i: int) -> RaggedShard:
        return self.layout.placement(i, self.shapes[i])
