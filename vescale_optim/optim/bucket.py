"""A bucket: parameters of one param group and dtype, planned and bound into flat buffers.

Besides the buffers it keeps what torch keeps per parameter: the step count (`steps`;
0 means never stepped, so no state) and whether the parameter takes the current step
(`active`, agreed over ranks by the optimizer). `runs()` cuts the rank's local slice
into maximal ranges that one element-wise call can update.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from ..shard import Comm, bind_parameters

_MASTER_DTYPES = (torch.bfloat16, torch.float16)


class Bucket:
    def __init__(self, params: list[torch.nn.Parameter], indices: list[int], group: dict, layout, comm: Comm):
        self.params, self.indices, self.group, self.layout = params, indices, group, layout
        had_grad = [p.grad is not None for p in params]
        self.pbuf, self.gbuf = bind_parameters(params, layout, comm.rank)
        self.pviews = [self.pbuf.view(i) for i in range(len(params))]
        self.gviews = [self.gbuf.view(i) for i in range(len(params))]
        for p, kept in zip(params, had_grad):
            if not kept:
                p.grad = None  # as in torch: no gradient until backward gives one
        self.marked = had_grad  # has a gradient since the last zero_grad (hooks, assignments)
        self.steps = [0] * len(params)
        self.active = [False] * len(params)
        self.master: torch.Tensor | None = None
        self.state_names: list[str] = []  # element-wise state under torch's names
        self.state: dict[str, torch.Tensor] = {}
        self._spans = self._local_spans()

    def init_master(self) -> None:
        """An fp32 copy of the local slice for bf16/fp16 parameters (after any broadcast)."""
        if self.pbuf.data.dtype in _MASTER_DTYPES:
            self.master = self.pbuf.local.float()

    @property
    def local_params(self) -> torch.Tensor:
        """The fp32 (or native) local parameter slice the update writes."""
        return self.master if self.master is not None else self.pbuf.local

    def local_grads(self) -> torch.Tensor:
        g = self.gbuf.local
        return g.float() if self.master is not None else g

    @property
    def step(self) -> int:
        """The step count every parameter of the bucket shares (for optimizers that step
        whole buckets); raises if they differ."""
        if len(set(self.steps)) != 1:
            raise RuntimeError(f"parameters {self.indices} of one bucket have different steps {self.steps}")
        return self.steps[0]

    def refresh_master(self) -> None:
        """Where a parameter no longer equals its master rounded to its dtype, it was written
        from outside (e.g. `model.load_state_dict`): take the parameter's value."""
        if self.master is None:
            return
        local = self.pbuf.local
        stale = self.master.to(local.dtype) != local
        if bool(stale.any()):
            self.master[stale] = local[stale].float()

    def publish(self) -> None:
        """Copy the master slice into the parameters' own (low-precision) slice."""
        if self.master is not None:
            self.pbuf.local.copy_(self.master)

    def advance(self) -> None:
        """Count a step for every active parameter."""
        self.steps = [s + a for s, a in zip(self.steps, self.active)]

    def _local_spans(self) -> list[tuple[int, int, int]]:
        """(param, lo, hi) over the local slice in order, each parameter's piece extended
        to the next piece (or the slice's ends), so padding rides with a neighbour and a
        span starts where its parameter starts — on a quantization block in 8-bit buckets."""
        starts = sorted(
            (lo, i) for i in range(len(self.params)) for lo, hi in [self.pbuf.local_range(i)] if hi > lo
        )
        ends = [lo for lo, _ in starts[1:]] + [self.layout.shard_size]
        return [(i, 0 if k == 0 else lo, hi) for k, ((lo, i), hi) in enumerate(zip(starts, ends))]

    def runs(self, key: Callable[[int], object] | None = None) -> Iterator[tuple[int, int, object]]:
        """Maximal ranges `[lo, hi)` of the local slice whose parameters are all active and
        share `key(param)` (by default the step count), as `(lo, hi, key)`."""
        key = key or self.steps.__getitem__
        run = None
        for i, lo, hi in self._spans:
            k = key(i) if self.active[i] else None
            if run is not None and k is not None and k == run[2]:
                run[1] = hi
                continue
            if run is not None:
                yield tuple(run)
            run = [lo, hi, k] if k is not None else None
        if run is not None:
            yield tuple(run)

    @property
    def any_active(self) -> bool:
        return any(self.active)


__all__ = ["Bucket"]
