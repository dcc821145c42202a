"""A Lightning module trained with strategy="ddp" on 2 CPU ranks, launched as users launch it:

    python lightning_ddp.py --opt vo_adamw --out r.pt

(Lightning starts the second rank itself, running this script again.) `configure_optimizers`
returns the optimizer, gradient_clip_val=0.5 clips by norm; `--wrap bucket_view` passes
gradient_as_bucket_view=True to DistributedDataParallel. Rank 0 writes its final parameters."""

from __future__ import annotations

import lightning as L
import torch
from _common import BATCH, STEPS, data, leave, lightning_module, parser, save
from lightning.pytorch.strategies import DDPStrategy


def main() -> None:
    p = parser(["torch", "vo_adamw"])
    p.add_argument("--wrap", choices=["ddp", "bucket_view"], default="ddp")
    a = p.parse_args()
    strategy = DDPStrategy(gradient_as_bucket_view=True) if a.wrap == "bucket_view" else "ddp"
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data()), batch_size=BATCH)
    # Lightning gives each rank its own rows: a DistributedSampler, unshuffled
    module = lightning_module(a.opt)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        gradient_clip_val=0.5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    assert trainer.world_size == 2 and trainer.global_step == STEPS, (trainer.world_size, trainer.global_step)
    save(a.out, [q.detach() for q in module.parameters()], opt=trainer.optimizers[0])
    leave()


if __name__ == "__main__":
    main()
