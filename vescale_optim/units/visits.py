"""What the schedule knows of one unit: which of its module's calls are inside a backward, and
when a backward of one forward is done with the unit (its *visit*), so that the unit is freed
and reduced once per backward, whatever the order of forwards and backwards.

A forward of the model (a *pass*: one call of a top listed module, `Schedule._pass`) may call a
unit's module several times (a block applied twice); one backward of that forward runs every
call's backward, the last call first. The unit's visit of that backward ends once every call of
the pass has run its backward: counted per pass (`calls`), and again for each further backward
of the same graph (`retain_graph=True`), re-armed when the first call's backward starts
(`left`). Other passes do not count: with several forwards before their backwards (GPipe, DPO,
several losses), each backward frees and reduces the unit on its own, and the next gathers
it again, as FSDP2 does. A pass's backward that never comes (a loss dropped) holds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .hooks import Arrivals


@dataclass
class Record:
    """One unit's place in the schedule: its module, whether that module encloses other
    units' and whether the unit has trainable parameters (fixed); whether it ran in the
    current round (reset when a round opens); and its calls' backward (kept across rounds,
    forgotten at the step)."""

    module: nn.Module | None
    encloses: bool
    trainable: bool
    arrivals: Arrivals | None = None  # counts its gradients when no module hook tells
    in_forward: bool = False
    ran: bool = False  # its forward ran towards a backward, or its backward ran, in this round
    complete: bool = False  # (watched) its gradients arrived; it may reduce in order
    depth: int = 0  # its calls inside a backward now (their backward started and is not done)
    calls: dict[int, int] = field(default_factory=dict)  # per pass: calls with a post-backward trigger
    left: dict[int, int] = field(default_factory=dict)  # per pass: calls whose backward is still to run

    @property
    def in_backward(self) -> bool:
        """Whether a backward of the unit runs now (a forward meanwhile is a recomputation)."""
        return self.depth > 0

    def new_round(self) -> None:
        self.ran = False
        if self.arrivals is not None:
            self.arrivals.reset()

    def forget(self) -> None:
        """The step: no graph before it is backwarded after it (its versions were bumped)."""
        self.depth, self.complete = 0, False
        self.calls.clear()
        self.left.clear()

    def call_counted(self, pass_id: int) -> None:
        """A call of pass `pass_id` whose backward ends in the unit's post-backward trigger."""
        self.calls[pass_id] = self.calls.get(pass_id, 0) + 1
        self.left[pass_id] = self.left.get(pass_id, 0) + 1

    def backward_starts(self, pass_id: int) -> None:
        """A call of pass `pass_id` starts its backward: a backward of that pass again (the
        graph was retained) counts every call of it anew."""
        self.depth += 1
        self.ran = True
        if not self.left.get(pass_id):
            self.left[pass_id] = self.calls.get(pass_id, 0)

    def backward_done(self, pass_id: int) -> bool:
        """A call of pass `pass_id` finished its backward: whether it was the last of the
        pass's calls in this backward (the visit ends)."""
        self.depth = max(self.depth - 1, 0)
        left = self.left.get(pass_id, 1) - 1
        self.left[pass_id] = max(left, 0)
        return left <= 0
