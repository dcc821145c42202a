"""Argument checks shared by the optimizers' constructors.

They follow torch.optim's rules and messages where torch has them, so code that handles
torch's errors handles ours, and run on the defaults and on every param group before
anything is built.
"""

from __future__ import annotations

from numbers import Real

import torch

from ..shard.collectives import Comm, all_gather_object
from ..units.tensor_parallel import tp_description


def check_params_arg(params) -> None:
    """A bare tensor is not an iterable of parameters (iterating it would yield its rows)."""
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params argument given to the optimizer should be an iterable of Tensors or dicts, "
            f"but got {torch.typename(params)}"
        )


def check_lr(lr, message: str = "Invalid learning rate: {}") -> None:
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not lr >= 0.0:
        raise ValueError(message.format(lr))


def check_at_least(value, bound: float, message: str) -> None:
    """`value >= bound` (NaN fails), else ValueError(message with the value)."""
    if not bound <= value:
        raise ValueError(message.format(value))


def check_betas(betas, *, last_may_be_one: bool = False) -> None:
    """Two betas in [0, 1) (the second may be 1 if `last_may_be_one`), both numbers or both
    1-element tensors."""
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2); got {betas!r}")
    for i, b in enumerate(betas):
        if isinstance(b, torch.Tensor) and b.numel() != 1:
            raise ValueError(f"Tensor betas[{i}] must be 1-element")
        top_ok = b <= 1.0 if (last_may_be_one and i == 1) else b < 1.0
        if not (b >= 0.0 and top_ok):
            raise ValueError(f"Invalid beta parameter at index {i}: {b}")
    numbers = all(isinstance(b, Real) and not isinstance(b, bool) for b in betas)
    if not numbers and not all(isinstance(b, torch.Tensor) for b in betas):
        raise ValueError("betas must be either both floats or both Tensors")


def check_impl_flags(name: str, *, foreach, fused, capturable: bool, differentiable: bool) -> None:
    """torch.optim's implementation flags. `foreach` and `fused` are accepted so code written for
    torch runs unchanged (the update is one fused call per bucket whatever they say);
    `differentiable` and `capturable` ask for what a sharded step cannot give."""
    if fused and differentiable:
        raise RuntimeError("`fused` does not support `differentiable`")
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    if differentiable:
        raise ValueError(
            f"{name} does not support differentiable=True: the update runs on flat shards under "
            "no_grad and exchanges them with collectives, so autograd cannot see through step()"
        )
    if capturable:
        raise ValueError(
            f"{name} does not support capturable=True: step() runs collectives and host-side "
            "decisions, so it cannot be captured in a CUDA graph"
        )


MUON_ONLY = ("normuon", "split_sizes", "num_heads")  # Muon's keys that shape what Muon does


def check_adamw_group(group: dict) -> None:
    """torch.optim.AdamW's checks on a param group (or the defaults), in its order, after
    refusing Muon's own keys (`MUON_ONLY`), which nothing reads in an AdamW step."""
    given = [k for k in MUON_ONLY if group.get(k) not in (None, False)]
    if given:
        raise ValueError(
            f"{given[0]}={group[given[0]]!r} is a Muon option, but this group takes AdamW steps "
            "(vo.AdamW, or use_muon=False in vo.Muon), which do not read it"
        )
    check_lr(group["lr"])
    check_at_least(group["eps"], 0.0, "Invalid epsilon value: {}")
    check_betas(group["betas"])
    check_at_least(group["weight_decay"], 0.0, "Invalid weight_decay value: {}")


def check_params(params: list[torch.Tensor]) -> None:
    """Dense floating-point tensors, each once."""
    seen = set()
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameter {i} is a {type(p).__name__}, not a tensor")
        if id(p) in seen:
            raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) appears more than once")
        seen.add(id(p))
        if p.is_sparse or p.layout != torch.strided:
            raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) is sparse; only dense parameters")
        if not p.is_floating_point():
            raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) has dtype {p.dtype}; need floating")


def _value(v) -> str:
    """A hyperparameter as ranks compare it: a tensor by its values and dtype, not its
    device (cuda:0 on one rank is cuda:1 on the next) nor its printed digits."""
    if isinstance(v, torch.Tensor):
        return f"tensor({v.detach().cpu().tolist()!r}, {v.dtype})"
    return repr(v)


def _signature(param_groups: list[dict]) -> list[tuple]:
    sig = []
    for gi, g in enumerate(param_groups):
        hyper = tuple(sorted((k, _value(v)) for k, v in g.items() if k != "params"))
        sig.append(("group", gi, len(g["params"]), hyper))
        sig.extend(
            ("param", gi, j, tuple(p.shape), str(p.dtype), p.requires_grad, tp_description(p))
            for j, p in enumerate(g["params"])
        )
    return sig


def _structure_mismatch(rank: int, theirs: list | None, first: list | None) -> str:
    """How rank `rank`'s units differ from rank 0's, in words."""
    theirs, first = theirs or [], first or []
    if len(theirs) != len(first):
        return (
            f"rank {rank} split the parameters into {len(theirs)} units, rank 0 into {len(first)}: "
            "shard_modules must list the same modules, in the same order, on every rank"
        )
    for k, (a, b) in enumerate(zip(first, theirs)):
        if a != b:
            return (
                f"unit {k} differs between rank 0 ({a[0]}, parameters {a[1]}) and rank {rank} ({b[0]}, "
                f"parameters {b[1]}): shard_modules must list the same modules, in the same order, "
                "on every rank"
            )
    return f"rank {rank}'s units differ from rank 0's"


def check_same_on_every_rank(
    param_groups: list[dict], comm: Comm, problem: str | None = None, structure: list | None = None
) -> None:
    """Raise on every rank, before any collective whose sizes depend on the parameters (so
    nobody hangs or reads past a buffer), if ranks passed different params or split them into
    different units (`structure`: per unit, its module's class and parameter indices; from
    different `shard_modules`), or if one rank found a `problem` with its own (a parameter on
    the wrong device, say)."""
    answers = all_gather_object((_signature(param_groups), problem, structure), comm)
    for rank, (_, theirs, _) in enumerate(answers):
        if theirs is not None:
            raise ValueError(problem if problem is not None else f"rank {rank}: {theirs}")
    for rank, (_, _, units) in enumerate(answers):
        if units != answers[0][2]:
            raise ValueError(_structure_mismatch(rank, units, answers[0][2]))
    sigs = [sig for sig, _, _ in answers]
    for rank, sig in enumerate(sigs):
        if sig == sigs[0]:
            continue
        for a, b in zip(sigs[0], sig):
            if a != b:
                raise ValueError(f"rank {rank} passed different parameters than rank 0: {b} vs {a}")
        raise ValueError(
            f"rank {rank} passed {sum(s[0] == 'param' for s in sig)} parameters, rank 0 passed "
            f"{sum(s[0] == 'param' for s in sigs[0])}"
        )


def replaced_params(param_groups: list[dict], built_over: list[list], name: str) -> str | None:
    """Why the optimizer cannot step when its param groups hold other parameters than it was built
    over and it cannot follow (`ShardedOptimizer._follow_swapped`: only before its first step,
    and without shard_modules): its state, or its units' values, belong to the old ones."""
    for g, built in zip(param_groups, built_over):
        if len(g["params"]) != len(built) or any(p is not q for p, q in zip(g["params"], built)):
            return (
                f"the {name}'s parameters were replaced after it was built, once it had stepped or loaded "
                "state, or with shard_modules= (whose units hold the old parameters' values): its state "
                "belongs to the parameters it was built over. It follows a swap made before its first step "
                "(accelerate's prepare(model, opt) under FSDP2 makes one); otherwise build it over the "
                "parameters it is to step"
            )
    return None


def changed_structure(param_groups: list[dict], structure: list[dict]) -> str | None:
    """A state-shaping key (`structure`: each group's at construction) changed since, named."""
    for gi, (g, fixed) in enumerate(zip(param_groups, structure)):
        for key, value in fixed.items():
            if g.get(key) != value:
                return (
                    f"param group {gi}: '{key}' changed from {value!r} to {g.get(key)!r} after "
                    "construction; it shapes the optimizer state, so it is fixed"
                )
    return None
