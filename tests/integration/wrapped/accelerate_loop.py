"""An accelerate training loop on gloo ranks, as users write and launch it:

    torchrun --nproc-per-node 2 --standalone accelerate_loop.py --opt vo_adamw --out r.pt

`Accelerator(cpu=True)` prepares the model, optimizers and loader and wraps the model in
DistributedDataParallel over gloo, with `--wrap bucket_view` given gradient_as_bucket_view=True
through DistributedDataParallelKwargs. accelerator.backward, then accelerator.clip_grad_norm_ at
0.5. Rank 0 writes its final parameters and the norms the clipping saw.

`--wrap fsdp2`: FullyShardedDataParallelPlugin(fsdp_version=2), whose prepare() takes the model
and its optimizers together: it builds nothing new, but fully_shard()s the model and swaps each
optimizer's parameters for FSDP2's DTensors in place. accelerate takes the plugin on accelerator
devices only (on CPU it would wrap in DistributedDataParallel instead, without a word), so the
script sets the distributed type a GPU launch would have; FSDP2 itself runs on gloo."""

from __future__ import annotations

import torch
from _common import BATCH, STEPS, data, leave, loss, net, optimizers, parser, save
from accelerate import Accelerator, DistributedDataParallelKwargs, FullyShardedDataParallelPlugin
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor


def accelerator(wrap: str) -> Accelerator:
    """The Accelerator a launch with `wrap` ("ddp", "bucket_view" or "fsdp2") builds on gloo."""
    if wrap != "fsdp2":
        views = [DistributedDataParallelKwargs(gradient_as_bucket_view=True)] if wrap == "bucket_view" else []
        return Accelerator(cpu=True, kwargs_handlers=views)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    acc.state.distributed_type, acc.state.fsdp_plugin = DistributedType.FSDP, plugin  # as on a GPU
    assert acc.is_fsdp2
    return acc


def main() -> None:
    p = parser()
    p.add_argument("--wrap", choices=["ddp", "bucket_view", "fsdp2"], default="ddp")
    a = p.parse_args()
    acc = accelerator(a.wrap)
    model = net()
    opts = optimizers(a.opt, model)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data()), batch_size=BATCH)
    model, loader, *opts = acc.prepare(model, loader, *opts)
    if a.wrap == "fsdp2":
        assert all(isinstance(q, DTensor) for q in model.parameters()), "not FSDP2's shards"
        assert all(isinstance(q, DTensor) for o in opts for g in o.param_groups for q in g["params"])
    else:
        assert isinstance(model, torch.nn.parallel.DistributedDataParallel), type(model)
    norms = []
    for x, y in loader:  # each rank its own rows, in order
        acc.backward(loss(model(x), y))
        norms.append(float(acc.clip_grad_norm_(model.parameters(), 0.5)))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert len(norms) == STEPS and max(norms) > 0.5, norms  # it clipped
    params = [q.full_tensor() if isinstance(q, DTensor) else q for q in model.parameters()]  # collective
    save(a.out, [q.detach() for q in params], norms, opts[0])
    leave()


if __name__ == "__main__":
    main()
