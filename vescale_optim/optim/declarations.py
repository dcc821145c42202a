"""What an optimizer declares to the sharded base (`base.ShardedOptimizer`): its math and its
state, apart from the machinery that lays out, reduces and steps. A new optimizer subclasses
`ShardedOptimizer` and fills in these: at least `_update`, usually `_state_specs`; the rest
have defaults for element-wise math."""

from __future__ import annotations

import torch

from ..owners.moves import Move
from ..units.segment import Segment, StateSpec
from .state_dict import Owned


class Declarations:
    """The hooks and class attributes a `ShardedOptimizer` subclass declares, with their defaults."""

    state_bits = 32  # storage of element-wise state; subclasses may take it as an argument
    step_stat_names: tuple[str, ...] = ()  # the step statistics a subclass counts itself
    structural_keys: tuple[str, ...] = ()  # param-group keys that shape the state: fixed after construction
    takes_dtensors = False  # whether its math is exact on DTensor parameters' local shards (element-wise)

    def _plan_work(self) -> None:
        """Once the runtime is laid out (at construction, and again if the parameters are swapped
        before the first step): plan what spans parameters (owners of whole matrices or tiles)."""

    def _granule(self, p: torch.Tensor, group: dict) -> int:
        """Elements per layout granule: rank boundaries inside `p` fall on multiples of this."""
        return 1

    def _state_specs(self, seg: Segment) -> list[StateSpec]:
        """The element-wise state tensors kept for a segment, under torch's names."""
        return []

    def _update(self, seg: Segment, grads: torch.Tensor) -> Move | None:
        """Update the active ranges (`seg.runs()`) of `seg.local_params` (and state) from the
        averaged local `grads`; math that needs whole matrices or tiles returns a `Move`
        that runs with every other segment's (see `owners.moves`)."""
        raise NotImplementedError

    def _owned_state(self, seg: Segment) -> list[list[Owned]]:
        """Per parameter of `seg`, the state tensors it keeps whole on one rank (none here)."""
        return [[] for _ in seg.params]

    def _stepless(self, seg: Segment) -> bool:
        """Whether the segment's math ignores the step count (torch then keeps none)."""
        return False

    def _check_group(self, gi: int, group: dict) -> str | None:
        """A problem with a param group's current hyperparameters, checked at every step."""
        return None

    def _before_update(self) -> None:
        """Called once per step before the segments are updated (per-step counters)."""

    def _step_phase(self, segments: list[Segment]) -> list[Move]:
        """Once a step, after every stepping segment's `_update` (`segments`, in model order, agreed),
        before the moves: work spanning segments (Muon's split Newton–Schulz); returns more moves."""
        return []

    def _after_update(self) -> None:
        """Called once per step after every segment's update and move finished."""
