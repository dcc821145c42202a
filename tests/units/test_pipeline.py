"""Stage-scoped optimizers under torch's pipelining on a pp2 x dp2 gloo world, each stage built
the torchtitan way (the whole model with the other stage's modules deleted) with its optimizer
over `world["dp"]`: every run against one-process torch on the whole model, whose step gradient
is the mean over the dp ranks of the mean-over-micro-batches gradient (`_pipeline`)."""

import pytest
import torch
import torch.distributed as dist
from _pipeline import LAYERS, Layout, Reference, batch, build, model, muon_groups

import vescale_optim as vo

LAYOUT = Layout(pp=2, dp=2, microbatches=2)
STEPS = 3
TOL = {"adamw": 1e-5, "muon": 1e-5, "shampoo": 1e-5}  # measured: 1.2e-7, 6e-8, 3e-7 after 3 steps


def _train(kind: str, zero: int, schedule: str, microbatches: int = LAYOUT.microbatches):
    rank = build(kind, LAYOUT, zero, schedule=schedule, microbatches=microbatches)
    rank.train(range(STEPS))
    params = {k: v.clone() for k, v in rank.opt.full_model_state_dict(rank.part).items()}
    if kind == "muon":
        work = rank.opt.ns_load[rank.dp_rank]
    elif kind == "shampoo":
        work = rank.opt.root_work[rank.dp_rank]
    else:
        work = 0.0
    return rank.pp_rank, params, work


def _whole_model_work(kind: str) -> float:
    """The Newton-Schulz FLOPs (Muon) or root work (Shampoo) of the whole model in one process."""
    whole = model()
    if kind == "muon":
        return sum(vo.Muon(muon_groups(whole), lr=0.02).ns_load)
    return sum(vo.Shampoo(whole.parameters(), lr=1e-2, max_preconditioner_dim=8).root_work)


CASES = [(k, z, "gpipe", 2) for k in ("adamw", "muon", "shampoo") for z in (2, 3)]
CASES += [("adamw", 3, "1f1b", 2), ("adamw", 3, "gpipe", 1), ("muon", 2, "1f1b", 1), ("adamw", 2, "gpipe", 3)]


@pytest.mark.parametrize("kind, zero, schedule, microbatches", CASES)
def test_pp2_dp2_trains_like_one_process_torch(world, kind, zero, schedule, microbatches):
    """`microbatches` as the schedule's (2: one reduction per step), 1 (one per micro-batch) or
    more than it runs (3: the step reduces what is left)."""
    runs = world(4).run(_train, kind, zero, schedule, microbatches, timeout=180)
    ref = Reference(kind)
    ref.train(range(STEPS), LAYOUT)
    want = ref.params()
    stages = {pp: set(params) for pp, params, _ in runs}
    assert not stages[0] & stages[1] and stages[0] | stages[1] == set(want)  # each name in one stage
    for _, params, _ in runs:
        for name, value in params.items():
            torch.testing.assert_close(value, want[name], rtol=0, atol=TOL[kind], msg=name)
    if kind != "adamw":  # each matrix (tile) computed once in the whole world
        assert sum(work for _, _, work in runs) == pytest.approx(_whole_model_work(kind), rel=1e-12)


def _different_optimizers(mismatch: bool):
    """Stage 0 builds Muon and AdamW, stage 1 one AdamW, at once; with `mismatch`, stage 1's dp rank 1
    another lr."""
    from _pipeline import stage_of
    from torch.distributed.device_mesh import init_device_mesh

    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = world["pp"].get_local_rank(), world["dp"].get_local_rank()
    part = stage_of(model(), 2, pp_rank)
    try:
        if pp_rank == 0:  # two optimizers over its part: Muon on the matrices, AdamW on the rest
            matrices, rest = muon_groups(part)
            opts = [vo.Muon([matrices], lr=0.02, mesh=world["dp"])]
            opts.append(vo.AdamW(rest["params"], lr=1e-2, mesh=world["dp"]))
        else:
            lr = 0.5 if mismatch and dp_rank == 1 else 1e-2
            opts = [vo.AdamW(part.parameters(), lr=lr, mesh=world["dp"])]
    except ValueError as e:
        return pp_rank, f"ValueError: {e}"
    dist.barrier(group=world["dp"].get_group())
    return pp_rank, "+".join(type(opt).__name__ for opt in opts)


@pytest.mark.parametrize("mismatch", [False, True])
def test_two_stages_build_different_optimizers_and_a_mismatch_raises_in_its_stage(world, mismatch):
    got = world(4).run(_different_optimizers, mismatch, timeout=60)
    stage0 = [what for pp, what in got if pp == 0]
    stage1 = [what for pp, what in got if pp == 1]
    assert stage0 == ["Muon+AdamW", "Muon+AdamW"]  # no hang, no false mismatch from the other stage
    if mismatch:
        assert all(w.startswith("ValueError") and "lr" in w for w in stage1), stage1
    else:
        assert stage1 == ["AdamW", "AdamW"]


def test_the_layers_split_evenly():
    assert LAYERS % LAYOUT.pp == 0


def _reductions(zero: int, microbatches: int):
    """The collectives of one step's forwards and backwards (the second step's), by kind."""
    from vescale_optim.shard.handle import traced

    rank = build("adamw", LAYOUT, zero, microbatches=microbatches)
    rank.train(range(1))
    with traced() as issued:
        rank.forward_backward(*batch(1, rank.dp_rank, LAYOUT.dp))
    rank.opt.step()
    peak = rank.opt.memory_stats()
    kinds = [c.split(":")[0] for c in issued]
    return kinds.count("reduce-scatter"), len(rank.opt.units), rank.opt.step_stats["bytes_sent"], peak


@pytest.mark.parametrize("zero", [2, 3])
def test_declared_microbatches_reduce_once_per_step(world, zero):
    once = world(4).run(_reductions, zero, LAYOUT.microbatches, timeout=60)
    each = world(4).run(_reductions, zero, 1, timeout=60)
    for (n_once, units, _, _), (n_each, _, _, _) in zip(once, each):
        assert n_once == units  # each unit reduced once in the step's backwards
        assert n_each == LAYOUT.microbatches * units  # once per micro-batch


def _interleaved(zero: int):
    """Two stages per rank (stages r and r + 2 of 4), each with its own optimizer, under torch's
    `ScheduleInterleaved1F1B`."""
    from _pipeline import loss_fn, optimizer, stage_of
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = world["pp"].get_local_rank(), world["dp"].get_local_rank()
    group, ids = world["pp"].get_group(), (pp_rank, pp_rank + 2)
    parts = [stage_of(model(), 4, s) for s in ids]
    opts = [optimizer("adamw", p, world["dp"], zero, microbatches=LAYOUT.microbatches) for p in parts]
    stages = [PipelineStage(p, s, 4, torch.device("cpu"), group=group) for p, s in zip(parts, ids)]
    schedule = ScheduleInterleaved1F1B(stages, LAYOUT.microbatches, loss_fn=loss_fn)
    for step in range(STEPS):
        x, y = batch(step, dp_rank, LAYOUT.dp)
        schedule.step(x, target=y) if pp_rank == 0 else schedule.step(target=y)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    out = {}
    for opt, part in zip(opts, parts):
        out.update({k: v.clone() for k, v in opt.full_model_state_dict(part).items()})
    return out


def test_interleaved_1f1b_with_two_stages_per_rank_trains_like_one_process_torch(world):
    runs = world(4).run(_interleaved, 3, timeout=180)
    ref = Reference("adamw")
    ref.train(range(STEPS), LAYOUT)
    want = ref.params()
    assert set().union(*runs) == set(want) and all(len(params) < len(want) for params in runs)
    for params in runs:
        for name, value in params.items():
            torch.testing.assert_close(value, want[name], rtol=0, atol=TOL["adamw"], msg=name)


def _pp_tp(steps: int):
    """pp2 x dp1 x tp2: each stage's blocks cut by torch's ColwiseParallel / RowwiseParallel over
    world["tp"], its `vo.AdamW` over world["dp"] (one rank: the TP shards are its own)."""
    from _pipeline import loss_fn, optimizer, stage_of
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank = world["pp"].get_local_rank()
    part = stage_of(model(), 2, pp_rank)
    for layer in part.layers.values():
        parallelize_module(layer, world["tp"], {"a": ColwiseParallel(), "b": RowwiseParallel()})
    opt = optimizer("adamw", part, world["dp"], zero=3, microbatches=LAYOUT.microbatches)
    stage = PipelineStage(part, pp_rank, 2, torch.device("cpu"), group=world["pp"].get_group())
    schedule = ScheduleGPipe(stage, LAYOUT.microbatches, loss_fn=loss_fn)
    for step in range(steps):
        x, y = batch(step, 0, 1)
        schedule.step(x) if pp_rank == 0 else schedule.step(target=y)
        opt.clip_grad_norm_(0.05, pp_mesh=world["pp"])
        opt.step()
        opt.zero_grad()
    return {
        k: v.full_tensor() if hasattr(v, "full_tensor") else v
        for k, v in opt.full_model_state_dict(part).items()
    }


def test_pp2_dp1_tp2_trains_like_one_process_torch(world):
    runs = world(4).run(_pp_tp, STEPS, timeout=180)
    ref = Reference("adamw")
    one = Layout(pp=2, dp=1, microbatches=LAYOUT.microbatches)
    for step in range(STEPS):
        ref.backward_mean(step, one)
        torch.nn.utils.clip_grad_norm_(ref.model.parameters(), 0.05)
        for opt in ref.opts:
            opt.step()
        ref.model.zero_grad()
    want = ref.params()
    assert set().union(*runs) == set(want)
    for params in runs:
        for name, value in params.items():
            torch.testing.assert_close(value, want[name], rtol=0, atol=TOL["adamw"], msg=name)
