"""A segment: the parameters of one param group and state tier inside a unit, as the
optimizer's math sees them: the runtime's declared interface to a unit's shards.

The planner keeps a segment's tensors adjacent in the unit's buffer, so on each rank
the segment is one range `[lo, hi)` of the unit's local slice: element-wise math runs on
`local_params` / `local_grads()` (views of the unit's shards) and the state tensors are
exactly that long. `layout` is the unit's layout restricted to the segment's tensors
(indices are the segment's, coordinates the unit's).

Besides views it keeps what torch keeps per parameter. The runtime sets whether a
parameter has a gradient (`marked`) and whether it takes the current step (`active`,
agreed over ranks); the optimizer sets its state (`StateSpec`s, stored by the `StateCodec`
of the segment's tier in `state`: flat tensors as long as the segment) and step counts
(`steps`; 0 means never stepped, so no state), each through a method of this class. The
optimizer's math reads a state tensor decoded (`read`) and writes it back (`store`),
never knowing how its tier stores it. `runs()` cuts the segment into maximal ranges that
one element-wise call can update.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..shard.layout import Layout
from ..units.unit import LOW_PRECISION, Unit

FROZEN = "frozen"  # the tier of parameters frozen at construction: no state, no steps


@dataclass(frozen=True)
class StateSpec:
    """One element-wise state tensor an optimizer keeps per segment, under torch's name.
    `stored_as_sqrt`: a tier that quantizes keeps `sqrt(x)` instead of `x` (second moments:
    the form the 8-bit update kernel keeps, finer near zero); decoded it is `x` again."""

    name: str
    stored_as_sqrt: bool = False


class StateCodec(Protocol):
    """How one storage tier keeps a segment's state (`optim.state_tiers` defines the tiers).
    `exact`: the stored tensor is the working copy itself, at the parameters' update
    precision (so `decode` returns it and in-place math needs no `encode_`)."""

    exact: bool

    def allocate(
        self, specs: Sequence[StateSpec], n: int, device: torch.device, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]: ...

    def decode(self, state: dict[str, torch.Tensor], spec: StateSpec) -> torch.Tensor: ...

    def decode_range(
        self, state: dict[str, torch.Tensor], spec: StateSpec, start: int, stop: int
    ) -> torch.Tensor: ...

    def encode_(self, state: dict[str, torch.Tensor], spec: StateSpec, x: torch.Tensor) -> None: ...


class Segment:
    def __init__(self, unit: Unit, members: list[int], indices: list[int], group: dict, tier: str):
        self.unit, self.members, self.indices, self.group, self.tier = unit, members, indices, group, tier
        self.params = [unit.params[m] for m in members]
        lay = unit.layout
        self.layout = Layout(
            lay.world_size,
            lay.shard_size,
            tuple(lay.sizes[m] for m in members),
            tuple(lay.granules[m] for m in members),
            tuple(lay.offsets[m] for m in members),
        )
        key = lay.segments[members[0]]
        self.ranges = [lay.segment_range(key, r) for r in range(lay.world_size)]  # per rank, local
        self.lo, self.hi = self.ranges[unit.comm.rank]
        nonempty = [lay.offsets[m] for m in members if lay.sizes[m]]
        self.start = min(nonempty) if nonempty else 0  # where the segment begins in the unit's buffer
        self.marked = [p.grad is not None for p in self.params]  # has a gradient since zero_grad
        self.steps = [0] * len(members)
        self.active = [False] * len(members)
        self.state_names: list[str] = []  # element-wise state under torch's names
        self.specs: dict[str, StateSpec] = {}
        self.codec: StateCodec | None = None  # how the tier stores the state (set with it)
        self.state: dict[str, torch.Tensor] = {}  # the stored tensors, as the codec lays them out
        self._spans = self._local_spans()

    # --- views -------------------------------------------------------------------------

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def counts(self) -> list[int]:
        """The segment's length on every rank."""
        return [b - a for a, b in self.ranges]

    def rank_start(self, rank: int) -> int:
        """Where the segment begins in `rank`'s local slice of the unit."""
        return self.ranges[rank][0]

    @property
    def local_params(self) -> torch.Tensor:
        """The rank's parameter elements the update writes (fp32 for bf16/fp16 parameters)."""
        return self.unit.shard[self.lo : self.hi]

    def local_grads(self) -> torch.Tensor:
        """The rank's averaged-gradient elements, in the parameters' update precision."""
        return self.unit.grads.shard[self.lo : self.hi]

    @property
    def master(self) -> torch.Tensor | None:
        """The fp32 master of bf16/fp16 parameters (the unit's shard), else None."""
        return self.local_params if self.unit.orig_dtype in LOW_PRECISION else None

    def local_range(self, i: int) -> tuple[int, int]:
        """Where parameter `i`'s piece lies in the segment on this rank, as [start, stop)."""
        start, stop = self.unit.full.local_range(self.members[i])
        return (start - self.lo, stop - self.lo) if stop > start else (0, 0)  # (relative to the segment)

    def tensor_range(self, i: int) -> tuple[int, int]:
        """Which flat elements of parameter `i` this rank holds, as [start, stop)."""
        return self.unit.full.tensor_range(self.members[i])

    def flat_offset(self, i: int) -> int:
        """Where parameter `i` starts in the segment's ranks' pieces concatenated in order."""
        return self.layout.offsets[i] - self.start

    # --- what the runtime sets -------------------------------------------------------------

    def mark(self, i: int, value: bool = True) -> None:
        """Parameter `i` has (or, with `value=False`, no longer has) a gradient."""
        self.marked[i] = value

    def clear_marks(self) -> None:
        self.marked = [False] * len(self.params)

    def set_active(self, active: list[bool]) -> None:
        """Which parameters take the current step (agreed over ranks; frozen ones never)."""
        self.active = [False] * len(active) if self.tier == FROZEN else list(active)

    # --- what the optimizer sets -----------------------------------------------------------

    def set_state(self, specs: Sequence[StateSpec], codec: StateCodec) -> None:
        """The optimizer's element-wise state, zero, stored by `codec` (the tier's)."""
        params = self.local_params
        self.state_names, self.specs, self.codec = [s.name for s in specs], {s.name: s for s in specs}, codec
        self.state = codec.allocate(specs, self.numel, params.device, params.dtype)

    # --- state, decoded ---------------------------------------------------------------------

    def read(self, name: str) -> torch.Tensor:
        """State `name` in the update precision: the stored tensor itself in an exact tier
        (in-place math updates it), else a decoded copy for `store` to write back."""
        return self.codec.decode(self.state, self.specs[name])

    def read_range(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements `[start, stop)` of `read(name)`, decoding no more than it must."""
        return self.codec.decode_range(self.state, self.specs[name], start, stop)

    def store(self, name: str, value: torch.Tensor) -> None:
        """Encode `value` (the segment's length, update precision) as state `name`."""
        self.codec.encode_(self.state, self.specs[name], value)

    def set_steps(self, steps: list[int]) -> None:
        if len(steps) != len(self.params):
            raise ValueError(f"{len(steps)} step counts for a segment of {len(self.params)} parameters")
        self.steps = list(steps)

    # --- steps ---------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """The step count every parameter of the segment shares (for optimizers that step
        whole segments); raises if they differ."""
        if len(set(self.steps)) != 1:
            raise RuntimeError(f"parameters {self.indices} of one segment have different steps {self.steps}")
        return self.steps[0]

    def advance(self) -> None:
        """Count a step for every active parameter."""
        self.steps = [s + a for s, a in zip(self.steps, self.active)]

    @property
    def any_active(self) -> bool:
        return any(self.active)

    def _local_spans(self) -> list[tuple[int, int, int]]:
        """(param, lo, hi) over the segment in order, each parameter's piece extended to the
        next piece (or the segment's ends), so padding rides with a neighbour and a span
        starts where its parameter starts — on a quantization block in 8-bit segments."""
        starts = sorted(
            (lo, i) for i in range(len(self.params)) for lo, hi in [self.local_range(i)] if hi > lo
        )
        ends = [lo for lo, _ in starts[1:]] + [self.numel]
        return [(i, 0 if k == 0 else lo, hi) for k, ((lo, i), hi) in enumerate(zip(starts, ends))]

    def runs(self, key: Callable[[int], object] | None = None) -> Iterator[tuple[int, int, object]]:
        """Maximal ranges `[lo, hi)` of the segment whose parameters are all active and share
        `key(param)` (by default the step count), as `(lo, hi, key)`."""
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

    def __repr__(self) -> str:
        return f"Segment(unit {self.unit.name or self.unit.index}, {self.tier}, params {self.indices})"


__all__ = ["FROZEN", "Segment", "StateCodec", "StateSpec"]
