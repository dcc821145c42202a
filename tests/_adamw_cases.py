"""Deterministic parameters and per-rank gradients shared by the AdamW tests, and torch.optim.AdamW
fed their mean gradient: the reference the tests hold the library's AdamW to."""

import torch
from _reference import mean_of

# the last has 4160 elements, so state_bits=16/8 keep its moments in low precision
SHAPES = [(5, 7), (13,), (3, 4, 5), (1,), (17, 3), (2, 9), (64, 65)]


def make_params(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def groups(params, amsgrad=True, maximize=True):
    return [
        {"params": params[:3], "lr": 1e-2, "weight_decay": 0.1},
        {"params": params[3:], "lr": 3e-3, "weight_decay": 0.0, "amsgrad": amsgrad, "maximize": maximize},
    ]


def grad(step, rank, i, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + i)
    return (torch.randn(SHAPES[i], generator=g) * (1 + rank)).to(dtype)


def set_grads(params, step, rank, dtype=torch.float32, skip=()):
    for i, p in enumerate(params):
        if i in skip:
            p.grad = None  # no gradient on this rank this step
        else:
            p.grad = grad(step, rank, i, dtype)


def full_precision(dtype):
    """What the optimizer updates parameters of `dtype` in (and the reference runs in)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def mean_grads(step, world, dtype=torch.float32, skip=(), reversed_order=False):
    """The mean over ranks, summed in rank order then divided, as the library reduces
    (`_reference.mean_of`); None for parameters no rank has a gradient for (no step)."""
    full = full_precision(dtype)
    ranks = range(world - 1, -1, -1) if reversed_order else range(world)
    return [
        None if i in skip else mean_of(grad(step, r, i, dtype).to(full) for r in ranks)
        for i in range(len(SHAPES))
    ]


def schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.8**t)


STEPS = 4
SKIP = {2: (1,), 3: (4,)}  # step -> params that get no gradient that step
# fp32 against torch.optim.AdamW: covers twice the noise floor of summing the ranks' gradients
# in another order (gloo's ring does on W >= 3), measured by tests/test_references.py
TOL = dict(rtol=1e-5, atol=1e-6)


def reference(
    world, steps=STEPS, clip=None, dtype=torch.float32, norm_type=2.0, amsgrad=True, reversed_order=False
):
    """torch.optim.AdamW (and the schedule) on the mean gradient of `world` ranks, clipped to `clip`
    if given: the parameters, the optimizer and each step's norm before clipping."""
    params = [torch.nn.Parameter(p.detach().to(full_precision(dtype))) for p in make_params(dtype)]
    opt = torch.optim.AdamW(groups(params, amsgrad=amsgrad))
    sched = schedule(opt)
    norms = []
    for t in range(steps):
        for p, g in zip(params, mean_grads(t, world, dtype, SKIP.get(t, ()), reversed_order)):
            p.grad = None if g is None else g.clone()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(params, clip, norm_type).item())
        opt.step()
        sched.step()
    return params, opt, norms
