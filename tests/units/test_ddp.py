"""Inside torch's DistributedDataParallel: the optimizer takes ZeRO-1's part.

Each case trains the same model twice on every rank of a gloo world, under DDP both times and
on the same data: once with the library's optimizer and once with the independent reference
(`torch.optim.AdamW`, `torch.optim.Muon` + `torch.optim.AdamW`, the plain Shampoo of
`_shampoo_reference`). DDP averages the gradients in both, so the two must train alike, in
either build order (the optimizer before DDP, as HF Trainer, accelerate and Lightning do, or
after), with `gradient_as_bucket_view`, `static_graph`, `find_unused_parameters` and DDP's own
`no_sync()` accumulation. The optimizer must issue no gradient reduction of its own, keep
`1/W` of the state per rank, and compute each Muon matrix once in the world; `shard_modules=`
(ZeRO-3), which DDP cannot hold, is refused by name in either order on every rank.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from _shampoo_reference import ReferenceShampoo
from _tiny_gpt import batch, build, loss_fn
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import vescale_optim as vo
from vescale_optim.shard.handle import traced

STEPS = 3
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MUON = dict(lr=0.02, weight_decay=0.1)
AUX = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
SHAMPOO = dict(lr=1e-2, max_preconditioner_dim=8, precondition_frequency=2, root_dtype=torch.float64)
# Both runs see DDP's mean gradient, so only the update math differs. Measured after 3 steps at
# W=2: AdamW 2.4e-7, Shampoo 4.2e-6 (fp64 roots), Muon 6e-8 (bf16 Newton-Schulz rounding alike in
# both here); Muon's tolerance stays at the library's Muon floor (`_fsdp_cases.TOL`, 2e-3), since another
# host's bf16 matmuls may flip an output rounding that this one does not.
TOL = {"adamw": 1e-6, "muon": 2e-3, "shampoo": 1e-5}
MATRICES = 12  # TinyGPT's Muon matrices: 3 layers x (attn, proj, mlp.0, mlp.2)

CONFIGS = {
    "optimizer first": dict(order="optimizer", ddp={}),
    "DDP first": dict(order="ddp", ddp={}),
    "bucket view, optimizer first": dict(order="optimizer", ddp=dict(gradient_as_bucket_view=True)),
    "bucket view, DDP first": dict(order="ddp", ddp=dict(gradient_as_bucket_view=True)),
    "static graph": dict(order="optimizer", ddp=dict(static_graph=True)),
    "find unused parameters": dict(order="ddp", ddp=dict(find_unused_parameters=True), unused=True),
    "DDP no_sync accumulation": dict(order="optimizer", ddp=dict(gradient_as_bucket_view=True), micro=2),
}


def _split(model: nn.Module) -> tuple[list, list]:
    mats = [p for n, p in model.named_parameters() if p.ndim == 2 and "emb" not in n and "head" not in n]
    return mats, [p for p in model.parameters() if all(p is not m for m in mats)]


def _optimizers(kind: str, model: nn.Module, ours: bool, **sharding) -> list[torch.optim.Optimizer]:
    if kind == "adamw":
        return [
            vo.AdamW(model.parameters(), **ADAMW, **sharding)
            if ours
            else torch.optim.AdamW(model.parameters(), **ADAMW)
        ]
    if kind == "muon":
        mats, rest = _split(model)
        if ours:
            groups = [{"params": mats}, {"params": rest, "use_muon": False, **AUX}]
            return [vo.Muon(groups, **MUON, **sharding)]
        return [torch.optim.Muon(mats, **MUON), torch.optim.AdamW(rest, **AUX)]
    if ours:
        return [vo.Shampoo(model.parameters(), **SHAMPOO, **sharding)]
    return [ReferenceShampoo(list(model.parameters()), **SHAMPOO)]


def _model(unused: bool) -> nn.Module:
    model = build()
    if unused:  # a parameter no forward uses: DDP leaves its gradient None, so it takes no step
        model.unused = nn.Linear(4, 4)
    return model


def _train(kind: str, config: dict, ours: bool, clip: bool = True):
    """`STEPS` steps under DDP; the final parameters, clip norms and the step's stats."""
    rank = dist.get_rank()
    model = _model(config.get("unused", False))
    if config["order"] == "optimizer":
        opts = _optimizers(kind, model, ours)
        ddp = DDP(model, **config["ddp"])
    else:
        ddp = DDP(model, **config["ddp"])
        opts = _optimizers(kind, model, ours)
    micro, norms, stats, trace = config.get("micro", 1), [], [], []
    for t in range(STEPS):
        for m in range(micro):
            quiet = ddp.no_sync() if m < micro - 1 else contextlib.nullcontext()
            with quiet, traced(trace) if ours else contextlib.nullcontext():
                (loss_fn(ddp, *batch(t, rank, m)) / micro).backward()
        if clip:  # torch's clipping on DDP's `.grad`, as HF Trainer, accelerate and Lightning clip
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        with traced(trace) if ours else contextlib.nullcontext():
            for opt in opts:
                opt.step()
        if ours:
            opts[0].zero_grad()
        else:
            model.zero_grad()
        stats.append(dict(getattr(opts[0], "step_stats", {})))
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = opts[0].local_state_bytes() if ours else None
    return params, norms, stats, trace, state


def _both(kind: str, config: dict, clip: bool = True):
    want = _train(kind, config, ours=False, clip=clip)
    got = _train(kind, config, ours=True, clip=clip)
    return got, want


def _assert_close(got: dict, want: dict, atol: float) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=atol, msg=k)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("kind", ["adamw", "muon", "shampoo"])
def test_under_ddp_trains_like_the_reference(world, kind, config):
    for got, want in world(2).run(_both, kind, CONFIGS[config], timeout=120):
        _assert_close(got[0], want[0], TOL[kind])
        torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]), rtol=1e-5, atol=1e-6)
        # no gradient reduction of the library's: DDP's all-reduce is the only one
        assert not [op for op in got[3] if op.startswith("reduce-scatter") or "gradients" in op], got[3]
        assert all(s["reduce_bytes"] == 0 for s in got[2])


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_state_is_sharded_and_matrices_computed_once(world, kind):
    """W=3 cuts the tensors raggedly: each rank holds about a third of the state, and each
    Muon matrix is orthogonalized by one rank of the world."""
    config = CONFIGS["optimizer first"]
    results = world(3).run(_both, kind, config, False, timeout=120)
    for got, want in results:
        _assert_close(got[0], want[0], TOL[kind])
    total = sum(got[4] for got, _ in results)
    assert max(got[4] for got, _ in results) <= total / 3 * 1.05 + 4096  # 1/W + padding
    if kind == "muon":
        per_step = [sum(got[2][t]["ns_matrices"] for got, _ in results) for t in range(STEPS)]
        assert per_step == [MATRICES] * STEPS


def _zero3_in_ddp(order: str) -> str:
    model = build()
    try:
        if order == "optimizer":
            opt = vo.AdamW(model.parameters(), shard_modules=[*model.layers, model])
            ddp = DDP(model)
        else:
            ddp = DDP(model)
            opt = vo.AdamW(model.parameters(), shard_modules=[*model.layers, model])
        loss_fn(ddp, *batch(0, dist.get_rank())).backward()
        opt.step()
    except (vo.ReshardedParameterError, vo.WrapperError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("order", ["optimizer", "ddp"])
def test_shard_modules_inside_ddp_is_refused_by_name_on_every_rank(world, order):
    for message in world(2).run(_zero3_in_ddp, order, timeout=60):
        assert "shard_modules=" in message and "DistributedDataParallel" in message, message
        assert "drop shard_modules=" in message, message


def _partly_in_ddp() -> str:
    model = build()
    extra = nn.Linear(3, 3)
    opt = vo.AdamW([*model.parameters(), *extra.parameters()])
    ddp = DDP(model)
    try:
        loss_fn(ddp, *batch(0, dist.get_rank())).backward()
    except vo.WrapperError as e:
        return str(e)
    opt.step()
    return "no error"


def test_parameters_outside_the_ddp_module_are_refused(world):
    for message in world(2).run(_partly_in_ddp, timeout=60):
        assert "not in the DistributedDataParallel module" in message, message
