"""An accelerate training loop on gloo ranks, as users write and launch it:

    torchrun --nproc-per-node 2 --standalone accelerate_loop.py --opt vo_adamw --out r.pt

`Accelerator(cpu=True)` prepares the model, optimizers and loader and wraps the model in
DistributedDataParallel over gloo, with `--wrap bucket_view` given gradient_as_bucket_view=True
through DistributedDataParallelKwargs. accelerator.backward, then accelerator.clip_grad_norm_ at
0.5. Rank 0 writes its final parameters and the norms the clipping saw.

(FSDP2 cannot be tried here: on CPU accelerate leaves FullyShardedDataParallelPlugin(fsdp_version=2)
unused and wraps the model in DistributedDataParallel all the same, without a word.)"""

from __future__ import annotations

import torch
from _common import BATCH, STEPS, data, leave, loss, net, optimizers, parser, save
from accelerate import Accelerator, DistributedDataParallelKwargs


def main() -> None:
    p = parser()
    p.add_argument("--wrap", choices=["ddp", "bucket_view"], default="ddp")
    a = p.parse_args()
    views = [DistributedDataParallelKwargs(gradient_as_bucket_view=True)] if a.wrap == "bucket_view" else []
    acc = Accelerator(cpu=True, kwargs_handlers=views)
    model = net()
    opts = optimizers(a.opt, model)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data()), batch_size=BATCH)
    model, loader, *opts = acc.prepare(model, loader, *opts)
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel), type(model)
    norms = []
    for x, y in loader:  # each rank its own rows, in order
        acc.backward(loss(model(x), y))
        norms.append(float(acc.clip_grad_norm_(model.parameters(), 0.5)))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert len(norms) == STEPS and max(norms) > 0.5, norms  # it clipped
    if acc.is_main_process:
        save(a.out, [q.detach() for q in model.parameters()], norms, opts[0])
    leave()


if __name__ == "__main__":
    main()
