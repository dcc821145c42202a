"""Pipeline stages' checkpoints: optimizer state keyed by parameter name, so each stage's dicts
merge into one DCP checkpoint with disjoint keys, which loads at another pipeline degree, another
dp size and without pipelining, bitwise; checkpoints keyed by index (written before) still load."""

import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _pipeline import Layout, Reference, assert_same, build, full_state, merged
from torch import nn

import vescale_optim as vo

SAVED = Layout(pp=2, dp=2, microbatches=2)
STEPS, MORE = 2, 2  # steps before the save, and after the load
ZERO = {"adamw": 3, "muon": 2}  # the ZeRO stage each optimizer runs at
TOLERANCE = {"adamw": 1e-5, "muon": 1e-5}  # against torch: 1.2e-7 and 3e-8 measured, after moves of 4e-2
LEGACY = Path(__file__).parent / "legacy_index"


def _save(kind: str, folder: str):
    """pp2 x dp2: train, then every rank saves its own stage's dicts (through the manager, and
    through plain DCP); this rank's stage, its dicts' keys and its whole state."""
    rank = build(kind, SAVED, ZERO[kind])
    rank.train(range(STEPS))
    model = rank.opt.sharded_model_state_dict(rank.part)
    optim = rank.opt.sharded_state_dict(rank.part)
    dcp.save({"model": model, "optim": optim}, checkpoint_id=f"{folder}/raw")
    vo.CheckpointManager(f"{folder}/managed", [rank.part], [rank.opt]).save(STEPS)
    return rank.pp_rank, {"model": set(model), "optim": set(optim)}, full_state(rank)


def _load(kind: str, folder: str, layout: Layout, through: str):
    """`layout` from other weights: load, this rank's whole state, then train on."""
    rank = build(kind, layout, ZERO[kind], seed=1)  # everything must come from the checkpoint
    if through == "manager":
        assert vo.CheckpointManager(f"{folder}/managed", [rank.part], [rank.opt]).load().step == STEPS
    else:
        sd = {
            "model": rank.opt.sharded_model_state_dict(rank.part),
            "optim": rank.opt.sharded_state_dict(rank.part),
        }
        dcp.load(sd, checkpoint_id=f"{folder}/raw")
        rank.opt.load_sharded_model_state_dict(sd["model"])
        rank.opt.load_sharded_state_dict(sd["optim"], rank.part)
    state = full_state(rank)
    rank.train(range(STEPS, STEPS + MORE))
    return state, full_state(rank)["model"]


@pytest.mark.parametrize("kind", list(ZERO))
def test_pp2_dp2_checkpoint_resumes_at_pp1_dp4_and_at_pp4_dp1(world, tmp_path, kind):
    saves = world(4).run(_save, kind, str(tmp_path), timeout=120)
    keys = {pp_rank: k for pp_rank, k, _ in saves}
    for what in ("model", "optim"):  # the two stages' dicts merge with no key in both
        assert keys[0][what] and keys[1][what] and not keys[0][what] & keys[1][what], what
    assert {"state.layers.0.a.weight.step", "param_groups.layers.0.a.weight.lr"} <= keys[0]["optim"]
    assert {"state.head.weight.exp_avg", "param_groups.layers.3.b.bias.weight_decay"} <= keys[1]["optim"]
    want = merged([state for *_, state in saves])  # (the dp ranks of a stage agree, checked)
    assert len(want["optim"]) == len(list(Reference(kind).model.parameters()))
    for layout, through in ((Layout(1, 4, 1), "manager"), (Layout(4, 1, 2), "dcp")):
        got = world(4).run(_load, kind, str(tmp_path), layout, through, timeout=120)
        assert_same(merged([state for state, _ in got]), want)  # the state as saved, bitwise
        reference = Reference(kind)
        reference.train(range(STEPS), SAVED)
        reference.train(range(STEPS, STEPS + MORE), layout)
        trained = merged([{"model": params, "optim": {}} for _, params in got])["model"]
        for name, value in reference.params().items():  # and it trains on as torch does
            torch.testing.assert_close(trained[name], value, rtol=0, atol=TOLERANCE[kind], msg=name)


def _load_legacy(folder: str):
    """The index-keyed checkpoint loaded through the manager, and through plain DCP."""
    from legacy_index import make  # its writer: the same model and optimizer

    model, opt = make.model_and_optimizer()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*the random states are not restored")
        assert vo.CheckpointManager(folder, model, opt).load().step == make.STEP
    managed = opt.full_model_state_dict(), opt.state_dict()
    model, opt = make.model_and_optimizer()
    sd = {"model": opt.sharded_model_state_dict(), "optim": opt.sharded_state_dict(keys="index")}
    dcp.load(sd, checkpoint_id=f"{folder}/step-{make.STEP}")
    opt.load_sharded_model_state_dict(sd["model"])
    opt.load_sharded_state_dict(sd["optim"])
    return managed, (opt.full_model_state_dict(), opt.state_dict())


def test_a_checkpoint_keyed_by_index_still_loads(world, tmp_path):
    """The fixture was written by 2 ranks before names (see legacy_index/make.py); 4 load it."""
    shutil.copytree(LEGACY, tmp_path / "legacy")
    want = torch.load(LEGACY / "expected.pt")
    for loaded in world(4).run(_load_legacy, str(tmp_path / "legacy"), timeout=120):
        for model, optim in loaded:
            assert model.keys() == want["model"].keys()
            for k, v in want["model"].items():
                assert torch.equal(model[k], v), k
            assert optim["param_groups"] == want["optim"]["param_groups"]
            assert optim["state"].keys() == want["optim"]["state"].keys()
            for i, entry in want["optim"]["state"].items():
                for k, v in entry.items():
                    assert torch.equal(optim["state"][i][k], v), (i, k)


def test_names_come_from_the_model_the_param_names_or_the_units_and_else_are_asked_for():
    def fresh():
        return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))

    keys = {"state.0.weight.exp_avg", "state.1.bias.step", "param_groups.1.weight.lr"}
    m = fresh()
    assert keys <= set(vo.AdamW(m.parameters()).sharded_state_dict(model=m))
    assert keys <= set(vo.AdamW(fresh().named_parameters()).sharded_state_dict())
    m = fresh()
    assert keys <= set(vo.AdamW(m.parameters(), shard_modules=[m]).sharded_state_dict())
    m = fresh()
    opt = vo.AdamW(m.parameters())
    with pytest.raises(ValueError, match="pass the model, e.g. opt.sharded_state_dict.model=model."):
        opt.sharded_state_dict()
    with pytest.raises(ValueError, match="the model passed does not hold parameters"):
        opt.sharded_state_dict(model=m[0])
    with pytest.raises(ValueError, match="pass the model"):
        opt.load_sharded_state_dict(opt.sharded_state_dict(m))


def _regrouped(groups: int, lrs: tuple[float, ...]):
    torch.manual_seed(0)
    m = nn.Linear(3, 4)
    split = [[m.weight], [m.bias]] if groups == 2 else [[m.weight, m.bias]]
    return m, vo.AdamW([{"params": ps, "lr": lr} for ps, lr in zip(split, lrs)])


def test_state_by_name_loads_into_other_param_groups_unless_a_group_was_saved_apart(tmp_path):
    """Keys name parameters, so the groups may be cut otherwise; a group whose parameters were
    saved with different hyperparameters is refused before anything changes."""
    m, opt = _regrouped(1, (0.5,))
    m(torch.ones(2, 3)).sum().backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(opt.sharded_state_dict(m), checkpoint_id=tmp_path / "one")
        m2, two = _regrouped(2, (0.1, 0.2))
        sd = two.sharded_state_dict(m2)
        dcp.load(sd, checkpoint_id=tmp_path / "one")
        two.load_sharded_state_dict(sd, m2)
        assert [g["lr"] for g in two.param_groups] == [0.5, 0.5]
        assert torch.equal(two.state_dict()["state"][1]["exp_avg"], opt.state_dict()["state"][1]["exp_avg"])
        dcp.save(two.sharded_state_dict(m2) | {"param_groups.bias.lr": 0.3}, checkpoint_id=tmp_path / "two")
        m1, one = _regrouped(1, (0.7,))
        sd = one.sharded_state_dict(m1)
        dcp.load(sd, checkpoint_id=tmp_path / "two")
    with pytest.raises(ValueError, match="'weight' and 'bias' were saved with lr=0.5 and 0.3"):
        one.validate_sharded_state_dict(sd, m1)
    with pytest.raises(ValueError, match="saved with lr"):
        one.load_sharded_state_dict(sd, m1)
    assert one.param_groups[0]["lr"] == 0.7 and one.state_dict()["state"] == {}


def _whole_model_over_half_the_world():
    from torch.distributed.device_mesh import init_device_mesh

    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    m = nn.Linear(3, 4)
    with pytest.raises(ValueError, match="spans 2 of the 4 ranks, while 4 ranks hold its model part"):
        vo.CheckpointManager("unused", m, vo.AdamW(m.parameters(), mesh=world["dp"]))


def test_an_optimizer_over_part_of_the_world_without_stages_is_refused(world):
    world(4).run(_whole_model_over_half_the_world, timeout=60)


def _two_stages_per_rank(folder: str, save: bool):
    """Each rank of pp2 x dp2 holds two single-layer stages, r and r + 2 of 4 (an interleaved
    schedule's placement), with an optimizer each: one step from gradients named after their
    parameters, then saved (or, `save=False`, the checkpoint loaded at pp1 x dp4 from other
    weights); the whole state by name."""
    from types import SimpleNamespace

    from _pipeline import model, optimizer, stage_of
    from torch.distributed.device_mesh import init_device_mesh

    layout = (2, 2) if save else (1, 4)
    world = init_device_mesh("cpu", layout, mesh_dim_names=("pp", "dp"))
    pp_rank = world["pp"].get_local_rank()
    parts = [stage_of(model(), 4, s) for s in (pp_rank, pp_rank + 2)] if save else [model(seed=1)]
    opts = [optimizer("adamw", part, world["dp"], zero=2) for part in parts]
    manager = vo.CheckpointManager(folder, parts, opts)
    if save:
        for part, opt in zip(parts, opts):
            for name, p in part.named_parameters():
                p.grad = torch.randn(
                    p.shape, generator=torch.Generator().manual_seed(len(name) * 31 + p.numel())
                )
            opt.step()
        manager.save(1)
    else:
        assert manager.load().step == 1
    return merged([full_state(SimpleNamespace(part=part, opt=opt)) for part, opt in zip(parts, opts)])


def test_a_rank_with_two_stages_saves_both_and_the_checkpoint_loads_without_stages(world, tmp_path):
    saved = merged(world(4).run(_two_stages_per_rank, str(tmp_path), True, timeout=120))
    assert len(saved["optim"]) == len(list(Reference("adamw").model.parameters()))
    for loaded in world(4).run(_two_stages_per_rank, str(tmp_path), False, timeout=120):
        assert_same(loaded, saved)
