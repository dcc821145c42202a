"""Small helpers that keep errors and warnings pointed at the user: parameter labels,
the caller's stack level, and the refusal of a loss scaler whose skips are per rank."""

from __future__ import annotations

import inspect
import os

import torch

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_INTERNAL = (_PACKAGE + os.sep, os.path.dirname(torch.__file__) + os.sep)


def label_params(param_groups: list[dict]) -> dict[int, str]:
    """`id(p)` -> how errors name `p`: its name when the group has `param_names`, else
    its position, with its shape."""
    labels = {}
    for gi, g in enumerate(param_groups):
        names = g.get("param_names")
        for j, p in enumerate(g["params"]):
            where = f"'{names[j]}'" if names else f"#{j} of param group {gi}"
            labels[id(p)] = f"{where} (shape {tuple(p.shape)})"
    return labels


def caller_stacklevel() -> int:
    """The `stacklevel` for `warnings.warn` called by our caller that points at the first
    frame outside this package and torch (the user's `opt.step()` or `scaler.step(opt)`)."""
    frame = inspect.currentframe().f_back  # the function that warns: level 1
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


def check_amp_scaler(distributed: bool) -> None:
    """Called while `torch.amp.GradScaler.step` asks whether the optimizer handles loss
    scaling. A scaler that finds inf/nan by looking at this rank's gradients only (the
    plain `GradScaler`) would skip `step()` on some ranks and not others — a hang — and
    update its scale differently per rank; refuse it on more than one rank. Scalers that
    agree over ranks (`ShardedGradScaler`, or any that overrides `unscale_`) pass."""
    if not distributed:
        return
    frame = inspect.currentframe().f_back.f_back  # the property, then the scaler's step()
    scaler = frame.f_locals.get("self") if frame is not None else None
    if isinstance(scaler, torch.amp.GradScaler) and type(scaler).unscale_ is torch.amp.GradScaler.unscale_:
        raise RuntimeError(
            "torch.amp.GradScaler decides per rank whether to skip step(), so with more than one "
            "rank an inf/nan on one rank hangs the job and the ranks' scales drift apart; use "
            "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler, which agrees over "
            "ranks, or skip_nonfinite=True without a scaler"
        )
