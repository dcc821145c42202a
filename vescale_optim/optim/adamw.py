"""Sharded AdamW: torch.optim.AdamW's math on each rank's flat slice of every segment."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.adamw import adamw as _torch_adamw

from ..kernels import adamw8bit_update_
from ..shard.comm import host_to_device
from ..units.segment import Segment, StateSpec
from . import state_tiers
from ._checks import check_adamw_group, check_impl_flags, check_params_arg
from .base import ShardedOptimizer


def adamw_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: torch.Tensor | None,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool = False,
) -> None:
    """One AdamW step on flat tensors, in place (decoupled weight decay, bias correction).

    p <- p * (1 - lr*wd);  m <- b1*m + (1-b1)*g;  v <- b2*v + (1-b2)*g^2
    p <- p - lr/(1-b1^t) * m / (sqrt(max(v))/sqrt(1-b2^t) + eps)
    """
    if maximize:
        grad = -grad
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    second = exp_avg_sq
    if max_exp_avg_sq is not None:
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        second = max_exp_avg_sq
    step_size = lr / (1 - beta1**step)
    denom = (second.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


class AdamW(ShardedOptimizer):
    """AdamW with parameters, gradients and moments ragged-sharded over the process group.

    Same arguments, defaults and math as `torch.optim.AdamW`, plus the sharding keywords
    (`**sharding`: see `ShardingConfig`). Gradients are averaged by one reduce-scatter
    per unit; each step updates the rank's flat slice in a single call per segment (the
    ranges of parameters that step, with their own step counts). bf16/fp16 parameters get an fp32 master of
    the local slice only; float64 parameters keep float64 state.

    `state_bits` picks the moments' storage for tensors of at least 4096 elements:
    32 (fp32), 16 (bf16, rounded to nearest) or 8 (int8 codes with an fp32 absmax
    scale per 256-element block counted from each tensor's start; updated by the
    fused `kernels.adamw8bit_update_`). Blocks never straddle ranks, so 8-bit state
    is the same at every world size. `state_dict()` exports fp32 moments under
    torch's names; loading re-encodes them (8-bit: within half a step of each block).

    `foreach` and `fused` are accepted so code written for `torch.optim.AdamW` runs
    unchanged; they change nothing (the update is one fused call per segment either way).
    `differentiable=True` and `capturable=True` are refused.
    """

    structural_keys = ("amsgrad",)
    takes_dtensors = True  # element-wise: exact on each TP rank's local shard
    STATE = (StateSpec("exp_avg"), StateSpec("exp_avg_sq", stored_as_sqrt=True))
    AMSGRAD = StateSpec("max_exp_avg_sq")

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        state_bits: int = 32,
        **sharding: Any,
    ):
        check_params_arg(params)
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize
        )
        check_adamw_group(defaults)
        check_impl_flags(
            "AdamW", foreach=foreach, fused=fused, capturable=capturable, differentiable=differentiable
        )
        state_tiers.check_state_bits(state_bits)
        self.state_bits = state_bits
        super().__init__(params, defaults, sharding)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        check_adamw_group(group)
        if group["amsgrad"] and self.state_bits != 32:
            raise ValueError("amsgrad keeps an extra fp32 moment; use it with state_bits=32")

    def _check_group(self, gi: int, group: dict) -> str | None:
        try:
            check_adamw_group(group)
        except ValueError as e:
            return f"param group {gi}: {e}"
        return None

    def _state_specs(self, seg: Segment) -> list[StateSpec]:
        return [*self.STATE, self.AMSGRAD] if seg.group["amsgrad"] else list(self.STATE)

    def _update(self, seg: Segment, grads: torch.Tensor) -> None:
        adamw_segment_step(seg, grads)


def adamw_segment_step(seg: Segment, grads: torch.Tensor) -> None:
    """AdamW on the active runs of a seg's local slice, whatever the moments' storage.

    Moments kept exactly (fp32) go through torch's fused AdamW kernel, every run in one
    call (one pass over memory, same math as `adamw_update_`); 8-bit blocks use the fused
    block-quantized kernel per run (runs start and end on quantization blocks, and the
    second moment is stored as its square root, the kernel's form); other storage is
    decoded, updated run by run and re-encoded.
    """
    runs = list(seg.runs())
    if not runs:
        return
    g = seg.group
    beta1, beta2 = g["betas"]
    hyper = dict(
        lr=float(g["lr"]),
        beta1=beta1,
        beta2=beta2,
        eps=g["eps"],
        weight_decay=g["weight_decay"],
        maximize=g.get("maximize", False),
    )
    params, codec = seg.local_params, seg.codec
    if isinstance(codec, state_tiers.Blocks):
        (mq, ms), (vq, vs) = codec.parts(seg.state, "exp_avg"), codec.parts(seg.state, "exp_avg_sq")
        blk = codec.block
        for lo, hi, step in runs:
            b0, b1 = lo // blk, -(-hi // blk)
            moments = (mq[lo:hi], ms[b0:b1], vq[lo:hi], vs[b0:b1])  # codes per element, scales per block
            adamw8bit_update_(params[lo:hi], grads[lo:hi], *moments, step=step, block_size=blk, **hyper)
    elif codec.exact:
        amsgrad = "max_exp_avg_sq" in seg.state_names
        cut = lambda t: [t[lo:hi] for lo, hi, _ in runs]  # noqa: E731
        # the fused kernel counts each step up itself before using it
        # copied to the device without a stall (pinned, non-blocking on CUDA)
        steps = host_to_device([float(s - 1) for _, _, s in runs], torch.float32, params.device).unbind()
        maxima = cut(seg.read("max_exp_avg_sq")) if amsgrad else []
        moments = (cut(seg.read("exp_avg")), cut(seg.read("exp_avg_sq")), maxima)
        _torch_adamw(cut(params), cut(grads), *moments, list(steps), fused=True, amsgrad=amsgrad, **hyper)
    else:
        m, v = seg.read("exp_avg"), seg.read("exp_avg_sq")
        for lo, hi, step in runs:
            adamw_update_(params[lo:hi], grads[lo:hi], m[lo:hi], v[lo:hi], None, step=step, **hyper)
        seg.store("exp_avg", m)
        seg.store("exp_avg_sq", v)
