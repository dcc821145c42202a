"""Over FSDP2's shards: the optimizer of a model `fully_shard` wrapped (torchtitan's order: wrap,
then build the optimizer over `model.parameters()`; accelerate's, the optimizer built first and
its parameters swapped for FSDP2's, is followed before the first step).

Each case trains the same model twice under the same FSDP2 layout, on the same data: once with
the library's optimizer and once with torch's, the way its users run it under FSDP2:
`torch.optim.AdamW` on the DTensor parameters, and for Muon torchtitan's baseline, each matrix
made whole with `full_tensor()` on every rank, `torch.optim.Muon` on it, and the shard written
back. Layouts: 1-D at W=2 and W=3 (FSDP2's uneven row chunks), HSDP 2x2, and FSDP2 over a
tensor-parallel model at dp2 x tp2 (strided and column shards, and parameters TP leaves whole
living on each tp rank's dp mesh). The library must issue no gradient reduction of its own,
orthogonalize each matrix once in the world, clip to the whole model's norm, checkpoint in
torch's format, and refuse what it cannot do by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _tiny_gpt import batch, build, loss_fn, train
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import vescale_optim as vo
from vescale_optim.shard.handle import traced

STEPS = 3
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MUON = dict(lr=0.02, weight_decay=0.1)
AUX = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
# Both runs see FSDP2's reduced gradient, so only the update math differs. Measured after 3
# steps here: AdamW 2.7e-7, Muon 6e-8 (both Newton-Schulz on whole bf16 matrices); Muon's
# tolerance stays at the library's Muon floor (`_fsdp_cases.TOL`, 2e-3), since another host's bf16
# matmuls may flip an output rounding that this one does not.
TOL = {"adamw": 1e-6, "muon": 2e-3}
MATRICES = 12  # TinyGPT's Muon matrices: 3 layers x (attn, proj, mlp.0, mlp.2)
LAYOUTS = {"1-D W=2": (2, None), "1-D W=3": (3, None), "HSDP 2x2": (4, "hsdp"), "FSDP2 + TP 2x2": (4, "tp")}


def _wrapped(layout: str, dim: int = 16) -> tuple[nn.Module, int]:
    """TinyGPT wrapped by FSDP2 in `layout`, and this rank's data-parallel rank (its batch)."""
    size, kind = LAYOUTS[layout]
    model = build(dim=dim)
    if kind is None:
        mesh, dp_rank = init_device_mesh("cpu", (size,)), dist.get_rank()
    elif kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        dp_rank = dist.get_rank()
    else:
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for layer in model.layers:
            parallelize_module(layer.mlp, world["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        mesh, dp_rank = world["dp"], world["dp"].get_local_rank()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, dp_rank


def _is_matrix(name: str, p: torch.Tensor) -> bool:
    """Whether the parameter `name` goes to Muon (`_split`)."""
    return p.ndim == 2 and "embed" not in name and "head" not in name


def _split(model: nn.Module) -> tuple[list, list]:
    mats = [p for n, p in model.named_parameters() if _is_matrix(n, p)]
    return mats, [p for p in model.parameters() if all(p is not m for m in mats)]


class _WholeMuon:
    """torchtitan's Muon under FSDP2: every matrix made whole on every rank (`full_tensor()`),
    `torch.optim.Muon` on it, each rank's shard written back."""

    def __init__(self, mats: list, rest: list):
        self.mats = mats
        self.whole = [nn.Parameter(p.full_tensor()) for p in mats]
        self.opts = [torch.optim.Muon(self.whole, **MUON), torch.optim.AdamW(rest, **AUX)]

    @torch.no_grad()
    def step(self) -> None:
        for w, p in zip(self.whole, self.mats):
            w.grad = None if p.grad is None else p.grad.full_tensor()
        for opt in self.opts:
            opt.step()
        for w, p in zip(self.whole, self.mats):
            shard = distribute_tensor(w.detach(), p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(shard.to_local())

    def zero_grad(self) -> None:
        for opt in self.opts:
            opt.zero_grad()
        for p in self.mats:  # FSDP2's gradients of the matrices, which no torch optimizer holds
            p.grad = None


def _optimizer(kind: str, model: nn.Module, ours: bool, **kwargs):
    if kind == "adamw":
        return (
            vo.AdamW(model.parameters(), **ADAMW, **kwargs)
            if ours
            else torch.optim.AdamW(model.parameters(), **ADAMW)
        )
    mats, rest = _split(model)
    if ours:
        return vo.Muon([{"params": mats}, {"params": rest, "use_muon": False, **AUX}], **MUON, **kwargs)
    return _WholeMuon(mats, rest)


@torch.no_grad()
def _torch_clip(model: nn.Module, max_norm: float) -> float:
    """torch's clipping over FSDP2's gradients (torchtitan's way, since torch's `clip_grad_norm_`
    cannot stack the norms of parameters on different meshes next to TP): the whole model's norm
    from each gradient made whole, then every gradient scaled as torch scales it."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.full_tensor()) for g in grads]))
    coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    for g in grads:
        g.mul_(coef)
    return float(total)


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}


def _train(kind: str, layout: str, ours: bool, torch_clip: bool = False, **kwargs):
    """`STEPS` clipped steps (the library's runs by `opt.clip_grad_norm_`, or with `torch_clip` by
    torch's clipping of FSDP2's gradients); the whole parameters, clip norms, the steps' stats and
    what we traced."""
    model, dp_rank = _wrapped(layout)
    opt = _optimizer(kind, model, ours, **kwargs)
    norms, stats, trace = [], [], []
    for t in range(STEPS):
        loss_fn(model, *batch(t, dp_rank)).backward()
        with traced(trace):
            if ours and not torch_clip:
                norms.append(float(opt.clip_grad_norm_(0.5)))
            else:
                norms.append(_torch_clip(model, 0.5))
            opt.step()
        opt.zero_grad()
        stats.append(dict(getattr(opt, "step_stats", {})))
    return _full(model), norms, stats, trace


def _both(kind: str, layout: str, torch_clip: bool = False):
    return _train(kind, layout, ours=True, torch_clip=torch_clip), _train(kind, layout, ours=False)


def _assert_close(got: dict, want: dict, atol: float) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=atol, msg=k)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_over_fsdp2_trains_like_torch(world, kind, layout):
    results = world(LAYOUTS[layout][0]).run(_both, kind, layout, timeout=120)
    for got, want in results:
        _assert_close(got[0], want[0], TOL[kind])
        # opt.clip_grad_norm_ is the whole model's norm, as torch's clipping of the DTensors gives (after
        # Muon's steps the norms carry its parameters' bf16 flips: 1.1e-5 relative measured at W=3)
        rtol = 1e-5 if kind == "adamw" else 1e-4
        torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]), rtol=rtol, atol=1e-6)
        # FSDP2 reduced the gradients; the library reduces none (Muon's moves are all-to-alls)
        assert not [op for op in got[3] if op.startswith("reduce-scatter") or "gradients" in op], got[3]
    if kind == "muon":  # each matrix once in the whole world, each step
        per_step = [sum(got[2][t]["ns_matrices"] for got, _ in results) for t in range(STEPS)]
        assert per_step == [MATRICES] * STEPS
        # the moves' bytes are counted: what one rank sends another receives, and no matrix travels
        # more than to its owner and back (fp32 updates)
        whole = 4 * sum(v.numel() for k, v in results[0][0][0].items() if _is_matrix(k, v))
        for t in range(STEPS):
            sent, received = (sum(r[2][t][k] for r, _ in results) for k in ("bytes_sent", "bytes_received"))
            assert 0 < sent == received <= 2 * whole, (sent, received, whole)


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_torch_clipping_of_fsdp2_gradients_is_what_the_step_takes(world, kind):
    for got, want in world(2).run(_both, kind, "1-D W=2", True, timeout=120):
        _assert_close(got[0], want[0], TOL[kind])


def _eight_bit(layout: str):
    """fp32 and 8-bit AdamW over FSDP2's shards of a model wide enough for the int8 tier (a local
    shard of 4096 elements or more): the start, both results and both state sizes."""
    out = [_full(_wrapped(layout, dim=64)[0])]
    for bits in (32, 8):
        model, dp_rank = _wrapped(layout, dim=64)
        opt = vo.AdamW(model.parameters(), **ADAMW, state_bits=bits)
        train(model, opt, range(STEPS), dp_rank)
        out += [_full(model), opt.local_state_bytes()]
    return out


def test_8_bit_state_over_fsdp2(world):
    for start, fp32, fp32_bytes, q8, q8_bytes in world(2).run(_eight_bit, "1-D W=2", timeout=120):
        assert q8_bytes < 0.5 * fp32_bytes  # int8 moments and a scale per block, not fp32
        for k in fp32:  # off by at most 5 % of how far fp32 moved (measured 1.8 %; a wrong update: ~100 %)
            moved = (fp32[k] - start[k]).norm()
            assert (q8[k] - fp32[k]).norm() <= 0.05 * moved + 1e-7, k


def _steps(model: nn.Module, opt, dp_rank: int, steps: range) -> None:
    train(model, opt, steps, dp_rank, clip=0.5)


def _resume(kind: str, layout: str):
    """Steps 0-1, torch's format state dict, a fresh model and optimizer loading it, step 2:
    bitwise the run that never stopped; the saved state holds whole tensors."""
    model, dp_rank = _wrapped(layout)
    opt = _optimizer(kind, model, True)
    _steps(model, opt, dp_rank, range(STEPS))
    never_stopped = _full(model)
    model, dp_rank = _wrapped(layout)
    opt = _optimizer(kind, model, True)
    _steps(model, opt, dp_rank, range(STEPS - 1))
    saved, params = opt.state_dict(), {k: v.detach().clone() for k, v in model.state_dict().items()}
    model, dp_rank = _wrapped(layout)
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(params[k])
    opt = _optimizer(kind, model, True)
    opt.load_state_dict(saved)
    _steps(model, opt, dp_rank, range(STEPS - 1, STEPS))
    state = saved["state"].items()
    shapes = {i: {k: tuple(v.shape) for k, v in st.items() if k != "step"} for i, st in state}
    whole = [tuple(p.shape) for p in model.parameters()]
    return _full(model), never_stopped, shapes, whole


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_state_dict_round_trip_continues_bitwise(world, kind):
    for got, want, shapes, whole in world(3).run(_resume, kind, "1-D W=3", timeout=120):
        for k in want:
            assert torch.equal(got[k], want[k]), k
        # whole tensors under the one-process keys, not FSDP2's local shards
        assert shapes and all(set(s.values()) <= set(whole) for s in shapes.values()), shapes


def _swapped(kind: str, stepped_first: bool):
    """accelerate's `prepare(model, opt)` under FSDP2: the optimizer built over the plain model,
    then its param groups' parameters swapped in place for FSDP2's DTensors (before its first
    step, or with `stepped_first` after one step over the plain model); then a backward whose
    gradients `zero_grad()` drops, and `STEPS` steps. The whole parameters, this rank's state
    bytes, and the same of the optimizer built over the wrapped model."""
    model = build()
    opt = _optimizer(kind, model, True)
    if stepped_first:
        loss_fn(model, *batch(0, dist.get_rank())).backward()
        opt.step()
    before = {id(p): n for n, p in model.named_parameters()}
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    after = dict(model.named_parameters())
    for g in opt.param_groups:
        g["params"] = [after[before[id(p)]] for p in g["params"]]
    try:
        loss_fn(model, *batch(STEPS, dist.get_rank())).backward()  # dropped by zero_grad
        opt.zero_grad()
        _steps(model, opt, dist.get_rank(), range(STEPS))
    except RuntimeError as e:
        return str(e)
    wrapped, _ = _wrapped("1-D W=2")
    built_after = _optimizer(kind, wrapped, True)
    _steps(wrapped, built_after, dist.get_rank(), range(STEPS))
    return (_full(model), opt.local_state_bytes()), (_full(wrapped), built_after.local_state_bytes())


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_parameters_swapped_for_fsdp2_before_the_first_step_are_followed(world, kind):
    """accelerate's FSDP2 prepare: the optimizer lays itself out anew over the DTensors and trains
    bitwise as if built over the wrapped model, holding no more state."""
    for (got, got_bytes), (want, want_bytes) in world(2).run(_swapped, kind, False, timeout=120):
        assert got_bytes == want_bytes
        for k in want:
            assert torch.equal(got[k], want[k]), k


def test_parameters_swapped_after_a_step_are_refused_by_name(world):
    for message in world(2).run(_swapped, "adamw", True, timeout=60):
        assert "parameters were replaced after it was built, once it had stepped" in message, message


def _through_dcp(kind: str, layout: str, path: str, api: str):
    """Steps 0-1, the optimizer saved through DCP (its own sharded state dict, or torch's
    `get_optimizer_state_dict` as torchtitan saves it), a fresh model and optimizer loading it,
    step 2: the run that never stopped, bitwise."""
    model, dp_rank = _wrapped(layout)
    opt = _optimizer(kind, model, True)
    _steps(model, opt, dp_rank, range(STEPS - 1))
    if api == "ours":
        dcp.save(opt.sharded_state_dict(model), checkpoint_id=path)
    else:
        dcp.save(get_optimizer_state_dict(model, opt), checkpoint_id=path)
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _steps(model, opt, dp_rank, range(STEPS - 1, STEPS))
    never_stopped = _full(model)
    model, dp_rank = _wrapped(layout)
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(params[k])
    opt = _optimizer(kind, model, True)
    if api == "ours":
        sd = opt.sharded_state_dict(model)
        dcp.load(sd, checkpoint_id=path)
        opt.load_sharded_state_dict(sd, model)
    else:
        sd = get_optimizer_state_dict(model, opt)
        dcp.load(sd, checkpoint_id=path)
        set_optimizer_state_dict(model, opt, sd)
    _steps(model, opt, dp_rank, range(STEPS - 1, STEPS))
    return _full(model), never_stopped


@pytest.mark.parametrize("api", ["ours", "torch's"])
@pytest.mark.parametrize("kind, layout", [("adamw", "HSDP 2x2"), ("muon", "1-D W=3")])
def test_dcp_round_trip_continues_bitwise(world, tmp_path, kind, layout, api):
    path = str(tmp_path / "opt")
    for got, want in world(LAYOUTS[layout][0]).run(_through_dcp, kind, layout, path, api, timeout=120):
        for k in want:
            assert torch.equal(got[k], want[k]), k


def _refusal(case: str) -> str:
    model, _ = _wrapped("1-D W=2")
    try:
        if case == "shard_modules":
            vo.AdamW(model.parameters(), shard_modules=[*model.layers, model])
        elif case == "mesh":
            vo.AdamW(model.parameters(), mesh=init_device_mesh("cpu", (2,)))
        elif case == "normuon":
            _optimizer("muon", model, True, normuon=True)
        elif case == "model state":
            vo.AdamW(model.parameters()).sharded_model_state_dict(model)
    except (ValueError, RuntimeError) as e:  # NotImplementedError is a RuntimeError
        return str(e)
    return "no error"


def _tp_without_mesh() -> str:
    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(nn.Sequential(nn.Linear(8, 8)), world["tp"], {"0": ColwiseParallel()})
    try:
        vo.AdamW(model.parameters())  # every parameter a DTensor of TP alone: mesh= forgotten
    except ValueError as e:
        return str(e)
    return "no error"


def test_tensor_parallel_dtensors_without_mesh_are_not_taken_for_fsdp2(world):
    for message in world(4).run(_tp_without_mesh, timeout=60):
        assert "pass the data-parallel mesh as mesh=" in message, message


@pytest.mark.parametrize(
    "case, words",
    [
        ("shard_modules", "let FSDP2 shard the model"),
        ("mesh", "If FSDP2 (fully_shard) made these DTensors, pass no mesh="),
        ("normuon", "does not run over FSDP2's shards yet"),
        ("model state", "get_model_state_dict"),
    ],
)
def test_what_cannot_work_over_fsdp2_is_refused_by_name(world, case, words):
    for message in world(2).run(_refusal, case, timeout=60):
        assert words in message, message


def _written_between_steps(kind: str, ours: bool, layout: str, **kwargs):
    """`STEPS` clipped steps, the embedding halved in place between steps 1 and 2 (as a loaded
    model state dict writes FSDP2's memory): the whole parameters, per step whether the step left
    FSDP2's (clipped) gradients as they were, and ours' `memory_stats()` after each step (its
    gradients not yet zeroed) with FSDP2's local parameters."""
    model, dp_rank = _wrapped(layout)
    opt = _optimizer(kind, model, ours, **(kwargs if ours else {}))
    untouched, stats = [], []
    for t in range(STEPS):
        if t == 2:
            with torch.no_grad():
                model.embed.weight.to_local().mul_(0.5)
        loss_fn(model, *batch(t, dp_rank)).backward()
        opt.clip_grad_norm_(0.5) if ours else _torch_clip(model, 0.5)
        grads = [p.grad.to_local().clone() for p in model.parameters()]
        opt.step()
        untouched.append(all(torch.equal(g, p.grad.to_local()) for g, p in zip(grads, model.parameters())))
        if ours:
            stats.append(opt.memory_stats())
        opt.zero_grad()
    local = [p.to_local() for p in model.parameters()]
    return _full(model), untouched, stats, local


def _borrowing(kind: str, layout: str, own: int, align: int):
    """Ours with every parameter of `own` elements or more per mesh rank in a unit of its own
    (`fsdp_shards.OWN_UNIT_NUMEL`), and torch's run (`_written_between_steps`)."""
    from vescale_optim.units import fsdp_shards

    kept, fsdp_shards.OWN_UNIT_NUMEL = fsdp_shards.OWN_UNIT_NUMEL, own
    try:
        ours = _written_between_steps(kind, True, layout, align=align)
        return ours, _written_between_steps(kind, False, layout)
    finally:
        fsdp_shards.OWN_UNIT_NUMEL = kept


@pytest.mark.parametrize(
    "layout, own, align",
    [("1-D W=2", 1, 16), ("1-D W=2", 1 << 30, 16), ("1-D W=3", 1, 32)],
    ids=["W=2 own units", "W=2 buckets", "W=3 borrowed on some ranks"],
)
@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_large_fsdp2_shards_are_updated_in_fsdp2s_memory(world, kind, layout, own, align):
    """A parameter large enough gets a unit of its own (the same units on every rank), whose shard
    is FSDP2's memory itself where the local tensor needs no padding (no copy of the parameter,
    none of its gradient): trains as torch does, takes a value written between steps, leaves
    FSDP2's gradients as they were, and `memory_stats()` counts the copies the optimizer does keep
    (here of the local tensors whose length `align` would pad: at W=3 with align 32 the embedding
    on rank 0 only, FSDP2's uneven rows)."""
    results = world(LAYOUTS[layout][0]).run(_borrowing, kind, layout, own, align, timeout=120)
    for (got, untouched, stats, local), (want, _, _, _) in results:
        _assert_close(got, want, TOL[kind])
        assert all(untouched)
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        copied = nbytes(t for t in local if own > 1 << 20 or t.numel() % align)
        for s in stats:  # (at most `align` elements of padding per parameter on top)
            assert copied <= s["parameters"] < copied + 4 * align * len(local), (s, copied)
            assert copied <= s["gradients"] < copied + 4 * align * len(local), (s, copied)
        if own == 1:
            assert copied < nbytes(local) / 2
