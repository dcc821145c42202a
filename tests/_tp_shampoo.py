"""Shampoo on the tensor-parallel tests' block (`_tp`): the one-process reference Shampoo fed the mean
gradient over the data-parallel ranks, and how many inverse roots the whole block's tiles take each
step, which the TP runs (under the library's sharding or FSDP2's) are held to."""

from __future__ import annotations

from _fsdp_cases import SHAMPOO
from _shampoo_reference import ReferenceShampoo, tile_slices
from _tp import build, mean_grad

STEPS = 4  # roots refreshed at steps 2 and 4 (precondition_frequency=2)


def reference(dp: int = 2, dp_after: int | None = None, opts: dict = SHAMPOO, steps: int = STEPS):
    """One process, the unparallelised block, the reference Shampoo on the mean gradient over
    dp (over `dp_after` from step STEPS/2 on, if given): the model state after STEPS steps, or
    after fewer `steps`, the optimizer's state per parameter."""
    model = build()
    opt = ReferenceShampoo(list(model.parameters()), **opts)
    for t in range(steps):
        mean_grad(model, t, dp if dp_after is None or t < STEPS // 2 else dp_after)
        opt.step()
    if steps != STEPS:
        return [opt.state.get(p) for p in model.parameters()]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def roots_per_step() -> list[int]:
    """Inverse roots of the whole block's tiles each step: two per tile where roots refresh."""
    d = SHAMPOO["max_preconditioner_dim"]
    tiles = sum(len(tile_slices(p.shape[0], p[0].numel(), d)) for p in build().parameters() if p.ndim >= 2)
    return [2 * tiles if (t + 1) % SHAMPOO["precondition_frequency"] == 0 else 0 for t in range(STEPS)]
