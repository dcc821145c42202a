"""The optimizers the demo can train with, by name, and the shared LR schedule.

Register a new one by adding a factory to `OPTIMIZERS`: it gets the model (already
on its device) and the run's `TrainConfig` and returns the optimizer. `cfg.lr` is
None unless the user passed `--lr`; use the optimizer's own tuned default then, and
pass `**sharding(model, cfg)` so that `--zero`, `--param-dtype` and `cfg.sharding` apply. Every
optimizer gets the same warmup + cosine multiplier (`make_scheduler`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

import vescale_optim as vo

from .config import TrainConfig

OptimizerFactory = Callable[[nn.Module, TrainConfig], torch.optim.Optimizer]


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two param groups: `nn.Linear` weights decay; norms, biases and embeddings do not."""
    decay = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if id(p) in decay], "weight_decay": weight_decay},
        {"params": [p for p in params if id(p) not in decay], "weight_decay": 0.0},
    ]


PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def param_dtype_name(cfg: TrainConfig, device: torch.device) -> str:
    """`--param-dtype`, or by default "bf16" on CUDA and "fp32" on the CPU (which has no
    fast bf16 everywhere)."""
    if cfg.param_dtype is not None:
        return cfg.param_dtype
    return "bf16" if torch.device(device).type == "cuda" else "fp32"


def mixed_precision(cfg: TrainConfig, device: torch.device) -> dict:
    """The optimizers' mixed-precision keywords for a model on `device`. bf16: parameters
    gathered and computed in bf16 (`param_dtype`; ZeRO-3 frees them after each unit, as
    FSDP2's `MixedPrecisionPolicy` does) over fp32 shards, masters and state; gradients
    reduced in fp32 (`reduce_dtype`, torchtitan's default too: the mean over ranks is not
    rounded to bf16 at every hop before it reaches the fp32 gradient shards). fp32: none."""
    name = param_dtype_name(cfg, device)
    if name not in PARAM_DTYPES:
        raise ValueError(f"param_dtype must be one of {list(PARAM_DTYPES)} or None, not {name!r}")
    if name == "fp32":
        return {}
    return {"param_dtype": PARAM_DTYPES[name], "reduce_dtype": torch.float32}


def sharding(model: nn.Module, cfg: TrainConfig) -> dict:
    """`--zero 3`: every block is a unit, and the model (embeddings, final norm, head) the
    outermost one: parameters, gradients and state sharded. `--zero 2`: no units listed,
    parameters whole on every rank. Either with `mixed_precision` for the model's device
    (`--param-dtype`), then `cfg.sharding`'s keywords over them."""
    precision = mixed_precision(cfg, next(model.parameters()).device)
    if cfg.zero == 3:
        return {"shard_modules": [*model.blocks, model], **precision, **cfg.sharding}
    if cfg.zero == 2:
        return {**precision, **cfg.sharding}
    raise ValueError(f"zero must be 2 or 3, not {cfg.zero!r}")


def make_adamw(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """Sharded AdamW, betas (0.9, 0.95), weight decay 0.1 on matrices only."""
    lr = cfg.lr if cfg.lr is not None else 3e-3
    return vo.AdamW(decay_groups(model, 0.1), lr=lr, betas=(0.9, 0.95), eps=1e-8, **sharding(model, cfg))


# --muon-variant: the Muon keys of each variant (docs/muon.md)
MUON_VARIANTS: dict[str, dict] = {
    "muon": {},
    "polar": {"ns_coefficients": "polar_express"},
    "normuon": {"normuon": True},
}


def make_muon(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """Sharded Muon on the hidden matrices (lr 0.02, weight decay 0.1), as `cfg.muon_variant` asks
    (`MUON_VARIANTS`); embeddings, the head, norms and biases take AdamW steps at AdamW's tuned
    lr, without weight decay."""
    if cfg.muon_variant not in MUON_VARIANTS:
        raise ValueError(f"muon_variant must be one of {sorted(MUON_VARIANTS)}; got {cfg.muon_variant!r}")
    lr = cfg.lr if cfg.lr is not None else 0.02
    groups = vo.muon_param_groups(model, exclude=[model.head], adamw_lr=3e-3, adamw_weight_decay=0.0)
    kwargs = {**MUON_VARIANTS[cfg.muon_variant], **sharding(model, cfg)}
    return vo.Muon(groups, lr=lr, weight_decay=0.1, adjust_lr_fn="original", **kwargs)


def make_shampoo(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """Sharded Shampoo with Adam grafting, tiles of at most 128, roots every 10 steps."""
    lr = cfg.lr if cfg.lr is not None else 3e-3
    return vo.Shampoo(
        decay_groups(model, 0.1),
        lr=lr,
        betas=(0.9, 0.95),
        epsilon=1e-8,
        max_preconditioner_dim=128,
        precondition_frequency=10,
        grafting="adam",
        **sharding(model, cfg),
    )


def make_soap(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """Sharded SOAP with the authors' defaults (betas (0.95, 0.95), bases refreshed every 10 steps) but
    lr 0.01, the best of 1e-3, 3e-3, 1e-2 and 3e-2 on the demo's 100 steps (train loss 3.86, 2.89,
    2.25, 2.53); weight decay 0.1 on matrices only."""
    lr = cfg.lr if cfg.lr is not None else 1e-2
    return vo.SOAP(decay_groups(model, 0.1), lr=lr, **sharding(model, cfg))


OPTIMIZERS: dict[str, OptimizerFactory] = {
    "adamw": make_adamw,
    "muon": make_muon,
    "shampoo": make_shampoo,
    "soap": make_soap,
}


def lr_multiplier(step: int, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warmup to 1 over `warmup` steps, then cosine decay to `min_ratio` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_scheduler(opt: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LRScheduler:
    """Warmup + cosine on every group's own base LR, stepped once per optimizer step."""
    warmup = max(1, min(cfg.warmup, cfg.steps // 2))
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, warmup, cfg.steps))


# What a run trains when `--optimizer` is not given: AdamW and Muon from the same initial weights
# (AdamW alone with a checkpoint directory: checkpoints are of one run).
DEFAULT_OPTIMIZERS = ("adamw", "muon")


def optimizer_names(cfg: TrainConfig) -> list[str]:
    """The optimizers a run trains, in order: `cfg.optimizer` (one name, several separated by
    commas, or "all": every registered one), by default `DEFAULT_OPTIMIZERS` (AdamW alone with
    a `checkpoint_dir`); a ValueError for a configuration no run can take."""
    if cfg.zero not in (2, 3):
        raise ValueError(f"zero must be 2 or 3, not {cfg.zero!r}")
    if cfg.resume and cfg.checkpoint_dir is None:
        raise ValueError("resume needs a checkpoint_dir")
    if cfg.param_dtype not in (None, *PARAM_DTYPES):
        raise ValueError(f"param_dtype must be one of {list(PARAM_DTYPES)} or None, not {cfg.param_dtype!r}")
    if cfg.checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be at least 1, not {cfg.checkpoint_every}")
    if cfg.optimizer is None:
        return ["adamw"] if cfg.checkpoint_dir is not None else list(DEFAULT_OPTIMIZERS)
    if cfg.optimizer == "all":
        names = list(OPTIMIZERS)
    else:
        names = [n.strip() for n in cfg.optimizer.split(",")]
        unknown = [n for n in names if n not in OPTIMIZERS]
        if unknown or not names:
            raise ValueError(
                f"unknown optimizer {cfg.optimizer!r}; choose from {[*OPTIMIZERS, 'all']}, "
                "or several separated by commas"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"optimizer {cfg.optimizer!r} names one twice")
    if cfg.checkpoint_dir is not None and len(names) > 1:
        raise ValueError(f"checkpoints are of one run: pick one optimizer, not {cfg.optimizer!r}")
    return names
