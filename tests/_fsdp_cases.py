"""The fully sharded tests' cases on the tiny GPT (`_tiny_gpt`): the library's AdamW, Muon (+ an
AdamW group) and Shampoo as the tests build them, the one-process references they are held to
(torch.optim.AdamW, torch.optim.Muon + AdamW, the plain Shampoo of `_shampoo_reference`) fed the
mean gradient, the training loop of a rank, and each optimizer's tolerance."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from _shampoo_reference import ReferenceShampoo
from _tiny_gpt import TinyGPT, batch, build, loss_fn, world_grads

import vescale_optim as vo

STEPS = 3
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MUON = dict(lr=0.02, weight_decay=0.1)
AUX = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
# roots from two steps of gradients, in fp64 (the reference's eigh and power round differently)
SHAMPOO = dict(lr=1e-2, max_preconditioner_dim=8, precondition_frequency=2, root_dtype=torch.float64)

# Where each comes from (tests/test_references.py checks that each covers twice the noise floor
# of summing the ranks' gradients in another order, as gloo's ring does on W >= 3; rtol 1e-5).
# AdamW, Shampoo (fp32): that floor, ~5e-7 at W=4 after 3 steps.
# Muon: the mean gradient rounds differently here and in one process, and Newton-Schulz in
# bf16 turns that into the odd flipped rounding of its output: one flip moves a parameter by
# at most 2^-8 (|O| < 1) times the adjusted lr (0.02 * sqrt(3) for the 48x16 attention
# matrix), 1.4e-4; the tolerance allows about a dozen over the run. test_muon holds Muon to
# torch exactly on gradients whose mean is exact.
TOL = {"adamw": 1e-6, "muon": 2e-3, "shampoo": 1e-5}


def sharded_model(meta: bool = False, checkpoint: bool = False) -> TinyGPT:
    """The model a rank trains: `build()`'s, or built on the meta device under seed 0 (the optimizer
    materialises it by the modules' own initialisation)."""
    if meta:
        torch.manual_seed(0)
        with torch.device("meta"):
            return TinyGPT(checkpoint=checkpoint)
    return build(checkpoint=checkpoint)


def reference_model(meta: bool = False, checkpoint: bool = False) -> TinyGPT:
    """The one-process model `sharded_model(meta, checkpoint)` stands for: with `meta`, the modules'
    own initialisation under seed 0, as the meta model is materialised."""
    if meta:
        torch.manual_seed(0)
        return TinyGPT(checkpoint=checkpoint)
    return build(checkpoint=checkpoint)


def split_matrices(model) -> tuple[list, list]:
    """Muon's matrices and the rest (embedding tied with the head, norms, biases)."""
    mats = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "embed" not in n)]
    return mats, rest


def make_ours(kind: str, model, **sharding):
    """The library's optimizer of `kind` ("adamw", "muon" or "shampoo") over `model`."""
    if kind == "adamw":
        return vo.AdamW(model.parameters(), **ADAMW, **sharding)
    if kind == "muon":
        mats, rest = split_matrices(model)
        return vo.Muon([{"params": mats}, {"params": rest, "use_muon": False, **AUX}], **MUON, **sharding)
    return vo.Shampoo(model.parameters(), **SHAMPOO, **sharding)


class Reference:
    """torch's optimizers of `kind` over `model` in one process (Muon: torch.optim.Muon on the
    matrices and AdamW on the rest; Shampoo: the plain reference), stepped together."""

    def __init__(self, kind: str, model):
        if kind == "adamw":
            self.opts = [torch.optim.AdamW(model.parameters(), **ADAMW)]
        elif kind == "muon":
            mats, rest = split_matrices(model)
            self.opts = [torch.optim.Muon(mats, **MUON), torch.optim.AdamW(rest, **AUX)]
        else:
            self.opts = [ReferenceShampoo(list(model.parameters()), **SHAMPOO)]

    def step(self) -> None:
        for opt in self.opts:
            opt.step()


def reference(kind, world, steps=STEPS, micro=1, meta=False, checkpoint=False, reversed_order=False) -> dict:
    """One process fed the mean gradient of `world` ranks (each `micro` micro-batches): the model state."""
    model = reference_model(meta, checkpoint)
    opt = Reference(kind, model)
    for t in range(steps):
        world_grads(model, t, world, micro, reversed_order)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_sharded(
    kind, steps=STEPS, micro=1, accumulate=None, meta=False, checkpoint=False, **sharding
) -> tuple:
    """A rank's run: `make_ours(kind, ...)` over `sharded_model(meta, checkpoint)` with `sharding`
    (a unit per block and the root's unless `shard_modules` is given), `micro` micro-batches a step,
    each but the last inside `accumulate` (None, or the optimizer's "no_sync" or "no_all_reduce"
    context). The model state (in fp32) and each step's `step_stats`."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = sharded_model(meta, checkpoint)
    sharding.setdefault("shard_modules", [*model.layers, model])
    opt = make_ours(kind, model, **sharding)
    stats = []
    for t in range(steps):
        for m in range(micro):
            last = m == micro - 1
            quiet = contextlib.nullcontext() if last or accumulate is None else getattr(opt, accumulate)()
            with quiet:
                (loss_fn(model, *batch(t, rank, m)) / micro).backward()
        opt.step()
        opt.zero_grad()
        stats.append(dict(opt.step_stats))
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}, stats


def assert_equal(got: dict, want: dict, atol: float = 1e-6) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=atol, msg=k)
