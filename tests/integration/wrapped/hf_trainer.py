"""HF `transformers.Trainer` on gloo ranks, as users launch it:

    torchrun --nproc-per-node 2 --standalone hf_trainer.py --opt vo_adamw --out r.pt

use_cpu=True, so Trainer wraps the model in DistributedDataParallel over gloo; max_grad_norm
clips, a LambdaLR scheduler comes with the optimizer in `optimizers=`. `--built before` builds
the optimizer before TrainingArguments, that is before the process group exists. Rank 0 writes
its final parameters and the logged grad norms to `--out`."""

from __future__ import annotations

import tempfile

import torch
import transformers
from _common import BATCH, STEPS, Rows, TrainerModel, data, leave, optimizers, parser, save


def main() -> None:
    p = parser(["torch", "vo_adamw"])
    p.add_argument("--built", choices=["before", "after"], default="after", help="the optimizer")
    a = p.parse_args()
    out_dir = tempfile.mkdtemp()

    def arguments() -> transformers.TrainingArguments:  # under torchrun this creates the process group
        return transformers.TrainingArguments(
            output_dir=out_dir,
            max_steps=STEPS,
            per_device_train_batch_size=BATCH,
            max_grad_norm=0.5,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            dataloader_num_workers=0,
            seed=0,
            data_seed=0,
            disable_tqdm=True,
        )

    args = arguments() if a.built == "after" else None
    model = TrainerModel()
    (opt,) = optimizers(a.opt, model)
    args = args or arguments()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / (2 * STEPS))
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Rows(*data()), optimizers=(opt, sched)
    )
    assert trainer.args.parallel_mode == transformers.training_args.ParallelMode.DISTRIBUTED
    trainer.train()
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    save(a.out, [q.detach() for q in model.parameters()], norms, opt)
    leave()


if __name__ == "__main__":
    main()
