"""The host syncs of a training step, as ARCHITECTURE.md counts them: one per backward (the
agreement on `no_sync()`, read before the backward's first reduction) and one per step (the
step's agreement, carrying `skip_nonfinite`'s check and under tensor parallelism its answer
over the TP group), counted as reads of tensor values on the host (`host_reads`, what a GPU
would wait for). Before, the non-finite check read a second answer back, and under tensor
parallelism a third (copied from pageable memory, then `.item()`).

A step that still has gradients to reduce after its agreement (a backward inside `no_sync()`
right before it) checks them once reduced: one read more. The answers are checked too: a
non-finite gradient on one rank skips the step on every rank.
"""

from __future__ import annotations

import contextlib

import pytest
import torch.distributed as dist
from _small_model import small_loss, small_model
from _tp import ADAMW, PLAN, batch, build, mesh
from _tp import loss as tp_loss
from torch.distributed.tensor.parallel import parallelize_module

import vescale_optim as vo
from vescale_optim.shard.host_reads import host_reads

STEPS = 3  # the first settles the order of reductions (one exchange of Python objects a run)


def _reads(sharded: bool, quiet_last: bool):
    """Per step after the first: the reads of each backward and of the step, and whether the
    step was skipped. Step 2's gradient holds a NaN on rank 1 only. `quiet_last`: the step's
    one backward runs inside `no_sync()` (its gradients are reduced at the step)."""
    rank = dist.get_rank()
    model = small_model()
    units = dict(shard_modules=[model[0], model]) if sharded else {}
    opt = vo.AdamW(model.parameters(), lr=0.01, skip_nonfinite=True, **units)
    found = []
    for t in range(STEPS):
        loss = small_loss(model, t, rank) * (float("nan") if t == 2 and rank == 1 else 1.0)
        with host_reads() as backward, opt.no_sync() if quiet_last else contextlib.nullcontext():
            loss.backward()
        with host_reads() as step, pytest.warns(UserWarning) if t == 2 else contextlib.nullcontext():
            opt.step()
        opt.zero_grad()
        found.append((backward, step, opt.skipped_steps))
    return found[1:]


@pytest.mark.parametrize("sharded", [False, True], ids=["zero2", "zero3"])
def test_one_read_per_backward_and_one_per_step(world, sharded):
    for rank in world(2).run(_reads, sharded, False, timeout=60):
        (backward1, step1, skipped1), (backward2, step2, skipped2) = rank
        assert len(backward1) == len(backward2) == 1, (backward1, backward2)
        assert len(step1) == len(step2) == 1, (step1, step2)  # the non-finite check in the agreement
        assert (skipped1, skipped2) == (0, 1)  # the NaN on rank 1 skips the step on every rank


def test_gradients_reduced_at_the_step_are_checked_once_reduced(world):
    for rank in world(2).run(_reads, True, True, timeout=60):
        (backward1, step1, skipped1), (backward2, step2, skipped2) = rank
        assert len(backward1) == len(backward2) == 1
        assert len(step1) == len(step2) == 2, (step1, step2)
        assert (skipped1, skipped2) == (0, 1)


def _tp_reads(poisoned: int | None):
    """dp2 x tp2, `skip_nonfinite`: the reads of step 2 (after the first), and whether it was
    skipped; `poisoned`: the global rank whose local gradient of wq holds a NaN then."""
    world = mesh()
    model = parallelize_module(build(), world["tp"], PLAN)
    opt = vo.AdamW(model.parameters(), mesh=world["dp"], skip_nonfinite=True, **ADAMW)
    dp_rank = world["dp"].get_local_rank()
    for t in range(2):
        nan = t == 1 and dist.get_rank() == poisoned
        hook = model.wq.weight.register_hook(lambda g: g * float("nan")) if nan else None
        tp_loss(model, *batch(t, dp_rank)).backward()
        if hook is not None:
            hook.remove()
        with (
            host_reads() as step,
            pytest.warns(UserWarning) if poisoned is not None and t == 1 else contextlib.nullcontext(),
        ):
            opt.step()
        opt.zero_grad()
    return step, opt.skipped_steps


@pytest.mark.slow
@pytest.mark.parametrize("poisoned", [None, 2])
def test_under_tensor_parallelism_the_step_still_reads_once(world, poisoned):
    for step, skipped in world(4).run(_tp_reads, poisoned, timeout=120):
        assert len(step) == 1, step  # no read of its own for the answer over TP
        assert skipped == (poisoned is not None)  # a NaN on one TP rank skips every rank's step
