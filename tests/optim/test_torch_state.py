"""torch's habits on the optimizer object: `opt.state[p]` holds this rank's piece of the state under
`state_dict()`'s names (fp32 as views of the shards), and torch's `get_optimizer_state_dict` /
`set_optimizer_state_dict` work with the library's optimizers, resuming bit for bit."""

import copy
import pickle
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist
from _adamw_cases import groups, make_params, set_grads
from _held import held_tensor_bytes
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

import vescale_optim as vo

NEVER = 3  # the parameter that never gets a gradient, so never steps


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _optimizer(kind: str, params: list) -> vo.ShardedOptimizer:
    """AdamW (amsgrad and maximize in one group), AdamW on bf16 parameters (fp32 masters), Muon
    with NorMuon (its `v` kept whole by owners) beside AdamW groups, Shampoo (tiles kept whole)."""
    if kind in ("adamw", "adamw-bf16"):
        return vo.AdamW(groups(params))
    if kind == "muon":
        matrices = [params[i] for i in (0, 2, 4, 6)]
        rest = [p for p in params if all(p is not q for q in matrices)]
        return vo.Muon([{"params": matrices, "normuon": True}, {"params": rest, "use_muon": False}], lr=0.02)
    return vo.Shampoo(params, max_preconditioner_dim=4, epsilon=1e-6)


def _trained(kind: str, state_bits: int = 32) -> tuple[list, vo.ShardedOptimizer]:
    dtype = torch.bfloat16 if kind == "adamw-bf16" else torch.float32
    params = make_params(dtype)
    opt = vo.AdamW(params, state_bits=state_bits) if state_bits != 32 else _optimizer(kind, params)
    for t in range(2):
        set_grads(params, t, _rank(), dtype, skip=(NEVER,))
        opt.step()
    return params, opt


# --- opt.state[p] and state_dict() ---------------------------------------------------------------


def _pieces_match_state_dict(kind: str) -> dict:
    """On this rank, every value of `opt.state[p]` is its `flat_range` of the full tensor in
    `state_dict()`, whole in its shape or 1-D; writing zeros into the views zeroes the full state.
    Returns `{(index, name): (start, stop, numel)}` for the test to check that the ranks tile it."""
    params, opt = _trained(kind)
    full = opt.state_dict()["state"]
    ranges = {}
    for index, p in enumerate(q for g in opt.param_groups for q in g["params"]):  # state_dict()'s order
        if index not in full:
            assert p is params[NEVER] and p not in opt.state and opt.state[p] == {}
            assert p not in opt.state  # read as torch's defaultdict reads it, but not added
            continue
        entry = opt.state[p]
        assert list(entry) == list(full[index])  # the same keys, in the same order
        for name, piece in entry.items():
            whole = full[index][name]
            start, stop = opt.state.flat_range(p, name)
            assert torch.equal(piece.reshape(-1), whole.reshape(-1)[start:stop]), (index, name)
            assert piece.shape == (whole.shape if (start, stop) == (0, whole.numel()) else (stop - start,))
            ranges[index, name] = (start, stop, whole.numel())
    assert len(opt.state) == len(full) == len(params) - 1
    assert held_tensor_bytes(opt) == opt.local_state_bytes()  # no copies: the step counts are all it adds
    for entry in opt.state.values():  # views of the optimizer's own memory
        for name, piece in entry.items():
            if name != "step":
                piece.zero_()
    zeroed = opt.state_dict()["state"]
    assert all(not v.any() for entry in zeroed.values() for name, v in entry.items() if name != "step")
    return ranges


def _tiled(per_rank: list[dict]) -> None:
    """The ranks' pieces of each tensor cover it exactly once, and some tensor is cut inside."""
    cut = False
    for key in per_rank[0]:
        if key[1] == "step":
            continue
        numel = per_rank[0][key][2]
        pieces = sorted((a, b) for r in per_rank for a, b, _ in [r[key]] if b > a)
        assert [a for a, _ in pieces] == [0] + [b for _, b in pieces[:-1]] and pieces[-1][1] == numel, key
        cut |= any(0 < b - a < numel for a, b in pieces)
    assert cut or len(per_rank) == 1


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("kind", ["adamw", "adamw-bf16", "muon", "shampoo"])
def test_state_holds_this_ranks_piece_of_state_dict(world, kind, size):
    check = _pieces_match_state_dict
    _tiled([check(kind)] if size == 1 else world(size).run(check, kind, timeout=60))


def _decoded(state_bits: int) -> None:
    """bf16 and 8-bit state reads as fp32 copies decoded at each read: equal to `state_dict()`'s,
    fresh each time, and writing into them changes nothing; fp32 state beside it stays a view."""
    params, opt = _trained("adamw", state_bits)
    big, small = params[-1], params[0]  # 4160 elements: the low-bit tier; 35: fp32
    before = opt.state_dict()["state"]
    first, again = opt.state[big], opt.state[big]
    assert first["exp_avg"].dtype == torch.float32 and first["exp_avg"] is not again["exp_avg"]
    for name, piece in first.items():
        start, stop = opt.state.flat_range(big, name)
        assert torch.equal(piece.reshape(-1), before[len(params) - 1][name].reshape(-1)[start:stop])
        if name != "step":
            piece.add_(1.0)
    assert opt.state[small] is opt.state[small]  # no decoding: the same entry
    after = opt.state_dict()["state"]
    for index, entry in before.items():
        for name, value in entry.items():
            assert torch.equal(after[index][name], value), (index, name)


@pytest.mark.parametrize("state_bits", [16, 8])
def test_low_bit_state_reads_as_decoded_copies(world, state_bits):
    _decoded(state_bits)
    world(2).run(_decoded, state_bits, timeout=60)


# --- the dict torch code reads -----------------------------------------------------------------


def test_state_is_a_dict_as_torch_keeps_it():
    """The same keys, shapes and (up to rounding) values as torch.optim.AdamW's; no entry before
    a parameter steps; `step` a CPU tensor that follows the steps; read-only otherwise."""
    params = make_params()
    theirs_params = [nn.Parameter(p.detach().clone()) for p in params]
    ours, theirs = vo.AdamW(groups(params)), torch.optim.AdamW(groups(theirs_params))
    assert isinstance(ours.state, dict) and not ours.state and ours.state == {}
    assert ours.state[params[0]] == {} and params[0] not in ours.state  # read as {}, not added
    for t in range(2):
        set_grads(params, t, 0, skip=(NEVER,))
        set_grads(theirs_params, t, 0, skip=(NEVER,))
        ours.step()
        theirs.step()
    assert len(ours.state) == len(theirs.state) == len(params) - 1
    for p, q in zip(params, theirs_params):
        assert list(ours.state[p]) == list(theirs.state[q])
        for name, value in theirs.state[q].items():
            assert ours.state[p][name].shape == value.shape
            torch.testing.assert_close(ours.state[p][name], value, rtol=1e-5, atol=1e-7)
    step = ours.state[params[0]]["step"]
    assert step.device.type == "cpu" and step.dtype == torch.get_default_dtype() and step.dim() == 0
    set_grads(params, 2, 0)
    ours.step()
    assert step.item() == 3 and ours.state[params[NEVER]]["step"].item() == 1
    before = ours.state
    p = params[0]
    edits = [lambda s: s.clear(), lambda s: s.pop(p), lambda s: s.update({}), lambda s: s.setdefault(p, {})]
    edits += [lambda s: s.__setitem__(p, {}), lambda s: s.__delitem__(p)]
    for edit in edits:
        with pytest.raises(TypeError, match=r"read-only: load state with opt.load_state_dict\(\)"):
            edit(ours.state)
    with pytest.raises(TypeError, match=r"AdamW.state shows the sharded state and cannot be replaced"):
        ours.state = defaultdict(dict)
    assert ours.state is before and len(ours.state) == len(params)
    for snapshot in (copy.deepcopy(ours.state), pickle.loads(pickle.dumps(ours.state)), ours.state.copy()):
        assert type(snapshot) is dict  # keyed by copies of the parameters, but for the last
        assert torch.equal(next(iter(snapshot.values()))["exp_avg"], before[params[0]]["exp_avg"])


def test_state_dict_and_load_keep_their_path():
    """torch's `Optimizer.state_dict` packs `opt.state` but the full state replaces it (keyed by
    index, nothing twice); user hooks see `opt.state` whole; a load that drops a parameter's state
    drops its entry, and `opt.state` stays the optimizer's."""
    params = make_params()
    opt = vo.AdamW(groups(params))
    set_grads(params, 0, 0)
    opt.step()
    seen = []
    opt.register_state_dict_pre_hook(lambda o: seen.append(len(o.state)))
    opt.register_state_dict_post_hook(lambda o, sd: seen.append((len(o.state), sorted(sd["state"]))))
    sd = opt.state_dict()
    assert seen == [len(params), (len(params), list(range(len(params))))]
    assert all(isinstance(k, int) for k in sd["state"]) and sd["state"][0]["exp_avg"].shape == params[0].shape
    before = opt.state
    opt.load_state_dict({**sd, "state": {k: v for k, v in sd["state"].items() if k != 0}})
    assert opt.state is before and params[0] not in opt.state and len(opt.state) == len(params) - 1
    opt.load_state_dict(sd)
    assert torch.equal(opt.state[params[0]]["exp_avg"], sd["state"][0]["exp_avg"])


# --- torch.distributed.checkpoint.state_dict ------------------------------------------------------


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3))


def _built(kind: str, seed: int) -> tuple[nn.Module, vo.ShardedOptimizer]:
    """AdamW fully sharded (ZeRO-3), Muon with NorMuon (ZeRO-2; biases and the head on AdamW),
    Shampoo (ZeRO-2, tiles of 4)."""
    torch.manual_seed(seed)
    model = _model()
    if kind == "adamw":
        units = [model[0], model[2], model[4], model]
        return model, vo.AdamW(model.parameters(), lr=1e-2, shard_modules=units)
    if kind == "muon":
        groups = vo.muon_param_groups(model, exclude=[model[4]])
        return model, vo.Muon(groups, lr=0.02, normuon=True)
    return model, vo.Shampoo(model.parameters(), lr=1e-2, max_preconditioner_dim=4, epsilon=1e-6)


def _train(model: nn.Module, opt: vo.ShardedOptimizer, steps: range) -> None:
    for t in steps:
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * t + _rank()))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


OPTIONS = {  # how the state dict is taken, and how it is given back
    "default": (StateDictOptions(), StateDictOptions()),
    "full": (StateDictOptions(full_state_dict=True), StateDictOptions(full_state_dict=True)),
    "rank0": (  # rank 0 only, on the CPU; given back by broadcast from rank 0
        StateDictOptions(full_state_dict=True, cpu_offload=True),
        StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    ),
    "flat": (StateDictOptions(flatten_optimizer_state_dict=True),) * 2,
    "model+optim": (StateDictOptions(), StateDictOptions()),  # get_state_dict / set_state_dict
}


def _round_trip(kind: str, how: str) -> None:
    """Taking torch's state dict changes nothing (no step with zero gradients); a fresh model and
    optimizer given it takes the next step bit for bit as the uninterrupted run."""
    take, give = OPTIONS[how]
    model, opt = _built(kind, seed=0)
    _train(model, opt, range(2))
    ours = opt.state_dict()
    if how == "model+optim":
        weights, saved = get_state_dict(model, opt, options=take)
    else:
        weights, saved = model.state_dict(), get_optimizer_state_dict(model, opt, options=take)
    weights = {name: w.clone() for name, w in weights.items()}  # a plain model's are its live tensors
    again = opt.state_dict()
    for index, entry in ours["state"].items():
        assert all(torch.equal(v, again["state"][index][k]) for k, v in entry.items()), index
    if how in ("default", "full") or (how == "rank0" and _rank() == 0):
        name_of = {id(p): name for name, p in model.named_parameters()}
        names = [name_of[id(p)] for g in opt.param_groups for p in g["params"]]  # by state_dict() index
        assert sorted(saved["state"]) == sorted(names)
        for index, entry in ours["state"].items():
            assert all(torch.equal(v, saved["state"][names[index]][k].cpu()) for k, v in entry.items())
    _train(model, opt, range(2, 3))
    resumed, fresh = _built(kind, seed=1)
    if how == "model+optim":
        set_state_dict(resumed, fresh, model_state_dict=weights, optim_state_dict=saved, options=give)
    else:
        resumed.load_state_dict(weights)
        set_optimizer_state_dict(resumed, fresh, saved, options=give)
    root_dtypes = [g.get("root_dtype") for g in opt.param_groups]  # Shampoo's: a dtype again, not its name
    assert [g.get("root_dtype") for g in fresh.param_groups] == root_dtypes
    _train(resumed, fresh, range(2, 3))
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    want, got = opt.state_dict()["state"], fresh.state_dict()["state"]
    assert want.keys() == got.keys()
    for index, entry in want.items():
        assert all(torch.equal(v, got[index][k]) for k, v in entry.items()), index


@pytest.mark.parametrize("how", list(OPTIONS))
@pytest.mark.parametrize("kind", ["adamw", "muon", "shampoo"])
def test_torch_distributed_state_dict_round_trips(world, kind, how):
    if how in ("default", "flat"):
        _round_trip(kind, how)
    world(2).run(_round_trip, kind, how, timeout=120)
