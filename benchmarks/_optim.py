"""Optimizer settings the training benchmarks share, Muon's split of a GPT's parameters, ours, and
one factory for the peer set-ups they compare with.

    vo.AdamW(model.parameters(), **ADAMW)
    vo.Muon(muon_groups(model))                  # hidden matrices -> Muon, the rest -> AdamW
    names = muon_names(model)                    # the Muon group's parameter names, for a peer's split
    opt = ours(model, "Muon", shard_modules=[*model.blocks, model], mesh=mesh)
    module, opt = peer(model, "FSDP2", "Muon", mesh=mesh)   # or "DDP", "ZeRO", "torch" (no wrapper)
    opt = fsdp2(model, "Muon", mesh=mesh)        # peer(model, "FSDP2", ...)'s optimizer
    opt = FullTensorMuon(model)                  # over FSDP2: torchtitan's whole-matrix torch.optim.Muon
    state_bytes(opt)                             # the optimizer state this rank holds, ours or a peer's

The peers: FSDP2 (`fully_shard_gpt` over `mesh`: the world; a 2-D mesh, FSDP2's HSDP; the dp mesh
of a dp x tp one, FSDP2 2-D), DDP, ZeRO (DDP + `ZeroRedundancyOptimizer`) and torch's optimizers
alone, each with `torch.optim.AdamW`, or `torch.optim.Muon` on the hidden matrices and
`torch.optim.AdamW` on the rest.
"""

from __future__ import annotations

import torch
from torch import nn

import vescale_optim as vo

PEERS = ("FSDP2", "DDP", "ZeRO", "torch")

ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5)
MUON_ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)  # Muon's AdamW group


def muon_groups(model: nn.Module) -> list[dict]:
    """`vo.muon_param_groups` of a GPT (`benchmarks._gpt`): its head goes to AdamW."""
    adamw = {f"adamw_{k}": MUON_ADAMW[k] for k in ("lr", "betas", "weight_decay")}
    return vo.muon_param_groups(model, **MUON, exclude=[model.head], **adamw)


def muon_names(model: nn.Module) -> set[str]:
    """Names of the parameters `muon_groups` puts in the Muon group."""
    ids = {id(p) for p in muon_groups(model)[0]["params"]}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def state_bytes(opt) -> int:
    """Bytes of the optimizer state this rank holds: ours `local_state_bytes()` (checked against
    `memory_stats()["state"]`); a torch optimizer's (each of a `Steps`, ZeRO's local one) every
    state tensor, a DTensor by its local shard."""
    if hasattr(opt, "local_state_bytes"):
        held, counted = opt.local_state_bytes(), opt.memory_stats()["state"]
        if held != counted:  # two public counts of the same tensors
            raise RuntimeError(f"local_state_bytes() {held} != memory_stats()['state'] {counted}")
        return held
    states = [s for o in getattr(opt, "opts", [opt]) for s in getattr(o, "optim", o).state.values()]
    local = [v.to_local() if hasattr(v, "to_local") else v for s in states for v in s.values()]
    return sum(v.numel() * v.element_size() for v in local if isinstance(v, torch.Tensor))


class Steps:
    """Several optimizers stepped as one (torch.optim.Muon, and AdamW for the rest)."""

    def __init__(self, *opts):
        self.opts = opts

    def step(self):
        for o in self.opts:
            o.step()

    def zero_grad(self):
        for o in self.opts:
            o.zero_grad()


def ours(model: nn.Module, family: str, **kwargs):
    """`vo.AdamW` or `vo.Muon` (with `muon_groups`) over a GPT, with `kwargs` (`shard_modules`,
    `mesh`, ...)."""
    if family == "AdamW":
        return vo.AdamW(model.parameters(), **ADAMW, **kwargs)
    return vo.Muon(muon_groups(model), **kwargs)


def fully_shard_gpt(model: nn.Module, mesh=None, reshard_after_forward=True, blocks=None) -> nn.Module:
    """FSDP2's `fully_shard` on every block (`blocks`, default `model.blocks`; resharded after
    forward unless told not to), then on the root (FSDP2's default for a root: kept gathered from
    forward to backward, as our outermost unit), over `mesh` (2-D: HSDP)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks if blocks is None else blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh)
    return model


def peer(model: nn.Module, setup: str, family: str = "AdamW", *, mesh=None, reshard_after_forward=True):
    """A peer set-up of `PEERS` over a GPT: (the module to call, its optimizer). `FSDP2`:
    `fully_shard_gpt` over `mesh`; `DDP`: `DistributedDataParallel(model)`; `ZeRO`: the same
    with every torch optimizer a `ZeroRedundancyOptimizer`; `torch`: the model as it is. The
    optimizer: `torch.optim.AdamW(foreach=True)` with `ADAMW`, or for Muon `torch.optim.Muon`
    (`MUON`) on `muon_names` and `torch.optim.AdamW` (`MUON_ADAMW`) on the rest, as one `Steps`."""
    hidden, module = muon_names(model) if family == "Muon" else set(), model
    if setup == "FSDP2":
        fully_shard_gpt(model, mesh, reshard_after_forward)
    elif setup in ("DDP", "ZeRO"):
        module = torch.nn.parallel.DistributedDataParallel(model)
    elif setup != "torch":
        raise ValueError(f"a peer set-up is one of {PEERS}, not {setup!r}")

    def make(cls, params: list, **hyper):
        if setup != "ZeRO":
            return cls(params, **hyper)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, **hyper)

    named = dict(model.named_parameters())  # DTensors under FSDP2
    if family == "AdamW":
        return module, make(torch.optim.AdamW, list(named.values()), foreach=True, **ADAMW)
    muon = make(torch.optim.Muon, [p for n, p in named.items() if n in hidden], **MUON)
    rest = [p for n, p in named.items() if n not in hidden]
    return module, Steps(muon, make(torch.optim.AdamW, rest, foreach=True, **MUON_ADAMW))


def fsdp2(model: nn.Module, family: str, mesh=None, reshard_after_forward: bool = True):
    """`peer(model, "FSDP2", ...)`'s optimizer (the model is sharded in place)."""
    return peer(model, "FSDP2", family, mesh=mesh, reshard_after_forward=reshard_after_forward)[1]


class FullTensorMuon(Steps):
    """torchtitan's Muon over FSDP2 (`fully_shard_gpt` done): every rank keeps each hidden matrix
    whole (`full_tensor()` at construction) with `torch.optim.Muon` over those copies, and
    `torch.optim.AdamW` on the other DTensor parameters. A step all-gathers each matrix's gradient,
    orthogonalizes every matrix on every rank, and writes each rank's shard back into it. Without a
    `model`: over the DTensor matrices `hidden` and the `rest`, with the hyperparameters given."""

    def __init__(
        self, model: nn.Module | None = None, *, hidden=None, rest=None, muon=MUON, adamw=MUON_ADAMW
    ):
        if model is not None:
            names, named = muon_names(model), dict(model.named_parameters())
            hidden = [p for n, p in named.items() if n in names]
            rest = [p for n, p in named.items() if n not in names]
        self.shards = hidden
        self.whole = [nn.Parameter(p.full_tensor()) for p in self.shards]
        super().__init__(torch.optim.Muon(self.whole, **muon), torch.optim.AdamW(rest, foreach=True, **adamw))

    @torch.no_grad()
    def step(self):
        from torch.distributed.tensor import distribute_tensor

        for w, p in zip(self.whole, self.shards):
            w.grad = None if p.grad is None else p.grad.full_tensor()
        super().step()
        for w, p in zip(self.whole, self.shards):
            rows = distribute_tensor(w.detach(), p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(rows.to_local())

    def zero_grad(self):
        super().zero_grad()
        for p in self.shards:  # FSDP2's gradients of the matrices, which no torch optimizer holds
            p.grad = None

    def state_bytes(self) -> int:
        """Bytes of both optimizers' state (Muon's whole momentum, AdamW's on the shards)."""
        values = [v for o in self.opts for s in o.state.values() for v in s.values()]
        return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))

    def held_bytes(self) -> int:
        """Every persistent tensor it keeps: its state and the whole matrices."""
        return self.state_bytes() + sum(w.numel() * w.element_size() for w in self.whole)
