"""Which parameters step, as in torch: those with a gradient on some rank.

A parameter is *marked* when autograd accumulates its gradient (a post-accumulate hook,
installed by the units' schedule) or when a `.grad` set by hand is taken in at the step;
`zero_grad(set_to_none=True)` clears the marks. At each step one small all-reduce of
every rank's marks decides who steps. The same reduction says which units still hold
unreduced gradients on some rank (accumulated under `no_sync()`, or set by hand), so
every rank reduce-scatters the same units, and carries a flag for problems found before
anything is modified (parameters moved or cast after construction, unfrozen, a unit
still in its forward, or whatever the optimizer reports): every rank refuses together
instead of hanging. With `skip_nonfinite` it carries the non-finite check too (computed on
the device, or'ed over tensor parallelism as well), so that the step reads one answer
back; only when some rank still had gradients to reduce after it (`no_sync()` before the
step, `no_all_reduce()`, gradients set by hand) does the check need a read of its own, on
the reduced shards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..shard.collectives import Comm
from ..shard.flags import any_rank
from .schedule import Schedule
from .segment import FROZEN, Segment
from .stand_in import revealed_all
from .unit import Unit

DIGEST_BITS = 32  # of the hyperparameters' hash, checked at every step


class GradTracker:
    """Marks, the per-step agreement and gradient zeroing over `units` and their `segments`;
    `labels` names each parameter (by id) in errors; agreement runs over `world`."""

    def __init__(
        self,
        units: Sequence[Unit],
        segments: Sequence[Segment],
        schedule: Schedule,
        world: Comm,
        labels: dict[int, str],
    ):
        self.units, self.segments, self.schedule = list(units), list(segments), schedule
        self.world, self.labels = world, labels
        self.where = {id(p): (s, i) for s in self.segments for i, p in enumerate(s.params)}
        # the non-finite check the last agreement carried: None when it carried none, or when
        # some rank had gradients left to reduce after it (the shards it saw were not final)
        self.nonfinite: bool | None = None

    @property
    def device(self) -> torch.device:
        """Where small control tensors go (the units' device: NCCL needs them there)."""
        return self.units[0].device if self.units else torch.device("cpu")

    def mark(self, p: torch.Tensor, has: bool = True) -> None:
        """`p`'s gradient was accumulated (the schedule's post-accumulate hook), or under DDP
        whether it has one at the step (`has`)."""
        where = self.where.get(id(p))
        if where is not None:
            where[0].mark(where[1], has)

    def problem(self) -> str | None:
        """Why this rank cannot step, as far as the runtime can tell (nothing is modified)."""
        busy = self.schedule.unfinished_forward()
        if busy is not None:
            return (
                f"step() while units {busy} are still gathered by a forward that has not finished; "
                "finish the forward (and its backward) before stepping"
            )
        for u in self.units:
            with revealed_all(u.params):
                moved = next(filter(None, map(u.placement_problem, range(len(u.params)))), None)
            if moved is not None:
                return moved
        for seg in self.segments:
            if seg.tier != FROZEN:
                continue
            for i, p in enumerate(seg.params):
                if p.requires_grad or seg.marked[i]:
                    now = "requires grad" if p.requires_grad else "has a gradient"
                    return (
                        f"parameter {self.labels[id(p)]} was frozen (requires_grad=False) when the "
                        f"optimizer was built, so it has no optimizer state, but now {now}; build the "
                        "optimizer with it trainable (freezing it later is fine)"
                    )
        return None

    @torch.no_grad()
    def agree(
        self,
        problem: str | None,
        digest: int = 0,
        explain: Callable[[], str] | None = None,
        nonfinite: bool = False,
        tp: Sequence[Comm] = (),
    ) -> list[Unit]:
        """One all-reduce over every rank's marks, unreduced units, a problem flag (this
        rank's, or `problem`, the optimizer's) and the bits of `digest` (a 32-bit hash of what
        must be equal on every rank: the hyperparameters): a parameter steps iff some rank has
        a gradient for it. Sets each segment's active parameters and returns the units that
        some rank still has unreduced gradients for (every rank reduces those, in order).
        With `nonfinite`, the same read answers whether some rank's gradient shards hold inf
        or NaN, over the world and the tensor-parallel groups `tp` (`self.nonfinite`), unless
        some rank still had gradients to reduce (then `self.nonfinite` is None).

        The digest travels as its bits and their complements under a bitwise or: the ranks
        agree iff no bit comes back set in both, which every rank sees alike, so all raise
        together (with `explain()`'s words, a collective on that error path only)."""
        problem = self.problem() or problem
        marks = [m for seg in self.segments for m in seg.marked]
        unreduced = [u.grads.has_full for u in self.units]
        bits = [bool(digest >> i & 1) for i in range(DIGEST_BITS)]
        flags = [*marks, *unreduced, *bits, *(not b for b in bits), problem is not None]
        what = "the step's agreement on which parameters step"
        # with the non-finite check: its flag, and whether this rank has gradients left to reduce
        # (or'ed over TP too, so that every TP rank takes the same path after it)
        left = any(u.grads.has_full or u.grads.unsynced is not None for u in self.units)
        tail = [self._nonfinite_flag(), left] if nonfinite else []
        agreed = any_rank(flags, self.world, what=what, tail=tail, tail_over=tp)
        if tail:
            (bad, left), agreed = agreed[-2:], agreed[:-2]
        self.nonfinite = None if not tail or left else bad
        if problem is not None:
            raise RuntimeError(problem)
        if agreed[-1]:
            raise RuntimeError(
                "step refused: another rank found a problem with its parameters (see that rank's error)"
            )
        ones, zeros = agreed[-1 - 2 * DIGEST_BITS : -1 - DIGEST_BITS], agreed[-1 - DIGEST_BITS : -1]
        if any(a and b for a, b in zip(ones, zeros)):
            raise RuntimeError(explain() if explain is not None else "ranks disagree on the hyperparameters")
        pos = 0
        for seg in self.segments:
            seg.set_active(agreed[pos : pos + len(seg.params)])
            pos += len(seg.params)
        return [u for u, f in zip(self.units, agreed[pos : pos + len(self.units)]) if f]

    def reattach(self, grads: bool = True) -> None:
        """Bring what was set by hand into the units: a tensor assigned to `.data` (same
        dtype and shape) is written into the parameter's shard; one assigned to `.grad`
        replaces the parameter's gradient (and marks it); `.grad = None` unmarks it, as
        torch then skips the parameter (`grads=False`: `.grad` is a wrapper's, read as it is).
        Moved or cast parameters are left for `problem()` to report."""
        for u in self.units:
            with revealed_all(u.params):  # metadata read as is, with no stand-in dispatch per read
                self._reattach_unit(u, grads)

    def _reattach_unit(self, u: Unit, grads: bool) -> None:
        for i, p in enumerate(u.params):
            if u.placement_problem(i) is not None:
                continue
            u.take_data(i)
            if not grads:
                continue
            g = p.grad
            if g is None:
                seg, j = self.where[id(p)]
                seg.mark(j, False)
            elif not u.grads.is_reduced(i) and not u.grads.is_live(i) and g.device == u.device:
                u.grads.take(i, g)
                self.mark(p)

    def zero_grad(self, set_to_none: bool = True, own_grads: bool = True) -> None:
        """Zero every gradient, as torch: `set_to_none=True` sets every `.grad` to None (a
        parameter that then gets no gradient takes no step); `set_to_none=False` keeps the
        gradients that exist, zeroed (those parameters step with a zero gradient).
        `own_grads=False`: `.grad` is a wrapper's (DDP's), zeroed as torch.optim zeroes it."""
        self.schedule.wait_reductions()
        for u in self.units:
            u.grads.clear(set_to_none, own_grads)
        if set_to_none:
            for seg in self.segments:
                seg.clear_marks()

    def _nonfinite_flag(self) -> torch.Tensor:
        """Whether this rank's gradient shards hold inf or NaN, on the device (no read)."""
        bad = torch.zeros((), dtype=torch.bool, device=self.device)
        for u in self.units:
            if u.grads.shard_bytes:
                bad |= ~torch.isfinite(u.grads.shard).all()
        return bad

    def any_nonfinite(self, tp: Sequence[Comm] = ()) -> bool:
        """Whether some rank's gradient shards hold inf or NaN, over the world and the
        tensor-parallel groups `tp` (every TP rank alike: one TP rank's shard alone can trip
        it, and the shards of one matrix must not part): the last agreement's answer when it
        has one, else one all-reduce per group and one read, on the shards as they are now."""
        if self.nonfinite is not None:
            return self.nonfinite
        what = "the non-finite gradient check"
        return any_rank([], self.world, what=what, tail=[self._nonfinite_flag()], tail_over=tp)[0]
