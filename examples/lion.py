"""A new optimizer on vescale_optim's sharded base: Lion, in full, and its check.

Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), per element, with
gradient g and momentum m:

    p <- p * (1 - lr * wd);  c = b1 * m + (1 - b1) * g;  p <- p - lr * sign(c);  m <- b2 * m + (1 - b2) * g

`Lion` is the whole optimizer (docs/extending.md walks through it and shows this class as it
is here). `check(world_size)` trains a tiny model a few steps with it under ZeRO-2 and ZeRO-3
on every rank of a `world_size`-rank world and compares the weights and the momentum with
`lion_reference_step`, a plain one-process Lion fed the mean gradient:

    from vescale_optim.local_world import run_local
    run_local(check, 2, 2)   # check(2) on both ranks of a fresh 2-rank gloo world
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F

import vescale_optim as vo
from vescale_optim.units.segment import Segment, StateSpec


class Lion(vo.ShardedOptimizer):
    """Lion with parameters, gradients and momentum sharded over the process group; the
    sharding keywords are `vo.ShardingConfig`'s (`shard_modules=`, `mesh=`, ...)."""

    STATE = (StateSpec("exp_avg"),)  # the momentum m: one flat tensor per segment, under this name
    takes_dtensors = True  # element-wise math: exact on each TP rank's local shard of a DTensor

    def __init__(
        self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0, **sharding: Any
    ):
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay)
        super().__init__(params, defaults, sharding)  # lays the parameters out: units, segments, state

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)  # torch fills in the defaults
        problem = lion_group_problem(self.param_groups[-1])
        if problem is not None:
            raise ValueError(problem)

    def _check_group(self, gi: int, group: dict) -> str | None:
        # at every step (a scheduler may have changed the group): every rank refuses together
        problem = lion_group_problem(group)
        return None if problem is None else f"param group {gi}: {problem}"

    def _state_specs(self, seg: Segment) -> list[StateSpec]:
        return list(self.STATE)

    def _update(self, seg: Segment, grads: Tensor) -> None:
        lr, betas, weight_decay = seg.group["lr"], seg.group["betas"], seg.group["weight_decay"]
        params, exp_avg = seg.local_params, seg.read("exp_avg")  # this rank's flat slices
        for lo, hi, _ in seg.runs():  # the ranges of parameters that step
            lion_update_(params[lo:hi], grads[lo:hi], exp_avg[lo:hi], lr, betas, weight_decay)
        seg.store("exp_avg", exp_avg)  # encodes it back (a no-op for fp32 state)


def lion_update_(
    param: Tensor, grad: Tensor, exp_avg: Tensor, lr: float, betas: tuple[float, float], weight_decay: float
) -> None:
    """One Lion step on flat tensors, in place."""
    beta1, beta2 = betas
    param.mul_(1 - lr * weight_decay)
    update = (exp_avg * beta1).add_(grad * (1 - beta1)).sign_()
    param.sub_(update * lr)
    exp_avg.mul_(beta2).add_(grad * (1 - beta2))


def lion_group_problem(group: dict) -> str | None:
    """What is wrong with a param group's hyperparameters, or None."""
    betas = group["betas"]
    if not group["lr"] >= 0.0:
        return f"lr must be at least 0; got {group['lr']!r}"
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
        return f"betas must be two numbers in [0, 1); got {betas!r}"
    if not group["weight_decay"] >= 0.0:
        return f"weight_decay must be at least 0; got {group['weight_decay']!r}"
    return None


# --- the check: sharded at W against one process ------------------------------------------------

LR, BETAS, WEIGHT_DECAY = 1e-2, (0.9, 0.99), 0.1


@torch.no_grad()
def lion_reference_step(
    params: list[Tensor],
    exp_avgs: list[Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
) -> None:
    """Lion on whole tensors in one process, from each parameter's `.grad`, as the paper writes
    it; a parameter without a gradient takes no step (as in torch)."""
    beta1, beta2 = betas
    for p, m in zip(params, exp_avgs):
        g = p.grad
        if g is None:
            continue
        p.mul_(1 - lr * weight_decay)
        c = beta1 * m + (1 - beta1) * g
        p.sub_(lr * c.sign())
        m.copy_(beta2 * m + (1 - beta2) * g)


class Net(nn.Module):
    """The tiny model: two hidden layers and a head, and a second head used on even steps only
    (on odd steps its parameters get no gradient and take no step)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10), nn.Tanh())
        self.head, self.extra = nn.Linear(10, 3), nn.Linear(10, 3)

    def forward(self, x: Tensor, step: int) -> Tensor:
        h = self.body(x)
        return self.head(h) + self.extra(h) if step % 2 == 0 else self.head(h)


def build() -> Net:
    """The same weights on every call (seeded)."""
    torch.manual_seed(0)
    return Net()


def loss(model: Net, step: int, rank: int) -> Tensor:
    """Rank `rank`'s loss at `step`, on a batch of its own."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
    return F.mse_loss(model(x, step), y)


def reference(world_size: int, steps: int) -> tuple[Net, list[Tensor], list[int]]:
    """The model after `steps` reference steps, each on the mean gradient of the `world_size`
    ranks' batches, reduced as the library reduces it: each rank's gradient made alone, the
    gradients summed in rank order, the sum divided by the world size; with the momentum and
    each parameter's count of steps."""
    model = build()
    params = list(model.parameters())
    exp_avgs, counts = [torch.zeros_like(p) for p in params], [0] * len(params)
    for step in range(steps):
        total: list[Tensor | None] = [None] * len(params)
        for rank in range(world_size):
            model.zero_grad()
            loss(model, step, rank).backward()
            for i, p in enumerate(params):
                if p.grad is not None:
                    total[i] = p.grad.clone() if total[i] is None else total[i].add_(p.grad)
        for i, (t, p) in enumerate(zip(total, params)):
            p.grad = None if t is None else t.div_(world_size)
            counts[i] += p.grad is not None
        lion_reference_step(params, exp_avgs, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    return model, exp_avgs, counts


def check(world_size: int, steps: int = 4) -> dict[str, int]:
    """On every rank of a `world_size`-rank world (or in one process without a group, for 1):
    `steps` steps of `Lion` under ZeRO-2 and ZeRO-3 against `reference`. Raises AssertionError
    on a mismatch, else returns how many weights and momentum elements it compared.

    The reference runs in this process, so its kernels are the ranks'. On 1 and 2 ranks every
    bit agrees: the sum of two gradients does not depend on its order. On 3 or more, gloo's ring
    sums each chunk starting at another rank, so the mean gradient can differ from the
    rank-order sum in its last bits, and the momentum with it: within `rtol=1e-5, atol=1e-8`
    (measured: at most 4.7e-10 on 3 to 7 ranks, for momenta of about 1e-3). The weights stay
    equal bit for bit even then: Lion moves a weight by `lr` times a sign, so a difference in
    the last bits of `c` reaches the weight only if it flips that sign, which `c` would have
    to be within rounding of zero for (no element of this model and data comes near).
    """
    size = dist.get_world_size() if dist.is_initialized() else 1
    if size != world_size:
        raise ValueError(f"check({world_size}) runs on {size} rank(s)")
    rank = dist.get_rank() if dist.is_initialized() else 0
    want, want_exp_avgs, want_steps = reference(world_size, steps)
    counts = {"weights": 0, "exp_avg": 0}
    for zero in (2, 3):
        model = build()
        units = [model.body[0], model.body[2], model.extra, model] if zero == 3 else None  # ZeRO-3
        opt = Lion(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, shard_modules=units)
        for step in range(steps):
            loss(model, step, rank).backward()
            opt.step()
            opt.zero_grad()
        got = opt.full_model_state_dict(model)  # whole weights on every rank (collective)
        state = opt.state_dict()["state"]  # whole momenta, in torch's format (collective)
        for i, (name, w) in enumerate(want.state_dict().items()):
            differ = int((got[name] != w).sum())
            assert differ == 0, f"ZeRO-{zero} on {world_size} rank(s): {name} differs in {differ} elements"
            assert state[i].keys() == {"step", "exp_avg"} and state[i]["step"] == want_steps[i], state[i]
            m, want_m = state[i]["exp_avg"], want_exp_avgs[i]
            if world_size <= 2:
                assert torch.equal(m, want_m), (
                    f"ZeRO-{zero} on {world_size} rank(s): {name}'s exp_avg differs"
                )
            else:
                torch.testing.assert_close(
                    m, want_m, rtol=1e-5, atol=1e-8, msg=f"ZeRO-{zero}: {name}'s exp_avg"
                )
            counts["weights"] += w.numel()
            counts["exp_avg"] += m.numel()
    return counts
