"""The one-process mean gradient that references are fed, reduced as the library reduces it.

The library averages gradients as DDP and any reduce-scatter do: each rank's gradient is made
alone (its micro-batches accumulated into it), the ranks' gradients are summed in rank order,
and the sum is divided by the world size. A reference that scales each loss by `1/world`
before its backward rounds differently, and how differently depends on the host's kernels
(AVX2, AVX-512 BF16, AMX): AdamW's first steps turn that into differences of about 1e-4 at
lr 3e-3. Every reference in `tests/` goes through `mean_grad_reference`;
`tests/test_references.py` refuses the old pattern and measures each tolerance's noise floor.

On more than two ranks the collectives themselves may sum in another order than rank order
(gloo's ring reduces each chunk starting at another rank), so the last bits can still differ
from the reference: `reversed_order=True` sums the same gradients in the opposite order, and
the difference between the two runs is the noise floor a tolerance has to cover.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def mean_grad_reference(
    params: Iterable[torch.nn.Parameter],
    world: int,
    rank_backward: Callable[[int], object],
    reversed_order: bool = False,
    dtype: torch.dtype | None = None,
) -> None:
    """Set each parameter's `.grad` to the mean over `world` ranks of their gradients.

    `rank_backward(r)` runs rank `r`'s backward pass(es) into the parameters' (cleared)
    gradients, exactly as rank `r` would in the distributed run (micro-batches included). The
    ranks' gradients are summed in rank order (or the reverse), then divided by `world`.
    A parameter no rank has a gradient for keeps `grad = None` (it takes no step, as in torch).
    `dtype` sums in another precision (the result is cast back to the gradient's dtype).
    """
    params = list(params)
    total: list[torch.Tensor | None] = [None] * len(params)
    ranks = range(world - 1, -1, -1) if reversed_order else range(world)
    for r in ranks:
        for p in params:
            p.grad = None
        rank_backward(r)
        for i, p in enumerate(params):
            if p.grad is None:
                continue
            g = p.grad.detach().to(dtype or p.grad.dtype)
            total[i] = g.clone() if total[i] is None else total[i].add_(g)
    for p, t in zip(params, total):
        p.grad = None if t is None else t.div_(world).to(p.dtype)


def mean_of(tensors: Iterable[torch.Tensor], world: int | None = None) -> torch.Tensor:
    """The mean of per-rank tensors as the library makes it: summed in the given order, divided."""
    tensors = list(tensors)
    total = tensors[0].clone()
    for t in tensors[1:]:
        total.add_(t)
    return total.div_(world or len(tensors))


def max_difference(a: dict[str, torch.Tensor] | list, b: dict[str, torch.Tensor] | list) -> float:
    """The largest absolute difference between two sets of tensors (the measured noise floor)."""
    pairs = zip(a.values(), b.values()) if isinstance(a, dict) else zip(a, b)
    return max(float((x.double() - y.double()).abs().max()) for x, y in pairs)
