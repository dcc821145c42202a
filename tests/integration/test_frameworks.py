"""Frameworks users already run, with vo.AdamW in place of torch.optim.AdamW (one process):
HF `Trainer` with `optimizers=(opt, scheduler)` and `max_grad_norm`, and a Lightning
`LightningModule` with `gradient_clip_val` (both clip through torch.nn.utils.clip_grad_norm_ /
clip_grad_value_ on `.grad`). A tiny model built here; nothing is downloaded."""

from __future__ import annotations

import os

import pytest
import torch
from wrapped._common import Rows, TrainerModel, lightning_module

import vescale_optim as vo

pytestmark = pytest.mark.slow  # make test-fast leaves it out

STEPS = 6


def _data(n: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


# --- Hugging Face Trainer ----------------------------------------------------------------------


def _hf(kind: str, tmp: str) -> list[torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    model = TrainerModel()
    cls = vo.AdamW if kind == "vo" else torch.optim.AdamW
    opt = cls(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / (2 * STEPS))
    args = transformers.TrainingArguments(
        output_dir=tmp,
        max_steps=STEPS,
        per_device_train_batch_size=4,
        max_grad_norm=0.5,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
        data_seed=0,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Rows(*_data()), optimizers=(opt, sched)
    )
    trainer.train()
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert len(norms) == STEPS and max(norms) > 0.5  # it clipped
    return [p.detach().clone() for p in model.parameters()] + [torch.tensor(norms)]


def test_hf_trainer_with_max_grad_norm_trains_like_torch_adamw(tmp_path):
    want = _hf("torch", str(tmp_path / "torch"))
    got = _hf("vo", str(tmp_path / "vo"))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# --- Lightning ---------------------------------------------------------------------------------


def _lightning(kind: str, tmp: str, clip: str) -> list[torch.Tensor]:
    L = pytest.importorskip("lightning")
    x, y = _data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    module = lightning_module("vo_adamw" if kind == "vo" else "torch")  # lr 1e-2, weight decay 0.01
    os.environ.setdefault("PL_DISABLE_FORK", "1")
    trainer = L.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        gradient_clip_val=0.5 if clip == "norm" else 0.02,
        gradient_clip_algorithm=clip,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp,
    )
    trainer.fit(module, loader)
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("clip", ["norm", "value"])
def test_lightning_with_gradient_clip_val_trains_like_torch_adamw(tmp_path, clip):
    want = _lightning("torch", str(tmp_path / "torch"), clip)
    got = _lightning("vo", str(tmp_path / "vo"), clip)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
