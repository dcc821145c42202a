"""Muon past one matrix per rank: split Newton–Schulz equals the one-rank iteration (hypothesis,
in one process), `vo.muon_plan`'s properties and goals on real shapes, and a world of 4 (and a
2x2 HSDP mesh) whose plan splits its large matrices training as torch.optim.Muon + AdamW."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _fsdp_cases import TOL, Reference, assert_equal, make_ours
from _muon_cases import grad
from _reference import mean_of
from hypothesis import given, settings
from hypothesis import strategies as st

import vescale_optim as vo
from vescale_optim.kernels import newton_schulz
from vescale_optim.optim._muon_math import ns_flops
from vescale_optim.optim._muon_plan import FREE_COMM, H200, split_rows
from vescale_optim.optim._split_ns import simulate

COEFFICIENTS = (3.4445, -4.775, 2.0315)


def _ns_cost(m: int, n: int, steps: int = 5) -> int:
    """Newton–Schulz FLOPs of an m x n matrix, a = min(m, n) <= b = max(m, n), written out here
    apart from the library (its `ns_flops` docstring): each step X Xᵀ (2a²b), A A (2a³) and
    B X (2a²b)."""
    a, b = min(m, n), max(m, n)
    return steps * (2 * a * a * b + 2 * a * a * a + 2 * a * a * b)


def _matrices(shapes):
    """The 2-D matrices of `shapes` as Muon sees them: a 3-D stack is that many matrices."""
    return [m for s in shapes for m in ([tuple(s[1:])] * s[0] if len(s) == 3 else [tuple(s)])]


def _expected_loads(plan, mats, world, steps=5):
    """Each rank's FLOPs from the plan's assignment: the whole cost of every matrix it owns,
    plus its member share of each split it is in."""
    loads = [0] * world
    for i, (owner, (m, n)) in enumerate(zip(plan.owners, mats)):
        if owner is not None:
            loads[owner] += _ns_cost(m, n, steps)
        else:
            for k, r in enumerate(plan.groups[i]):
                loads[r] += plan.splits[i].member_flops(k, steps)
    return loads


# --- the split iteration, in one process ---------------------------------------------------------


@st.composite
def splits(draw):
    m, n = draw(st.integers(2, 24)), draw(st.integers(2, 24))
    g = draw(st.integers(2, min(m, n, 6)))
    shares = draw(st.lists(st.floats(0.05, 1.0), min_size=g, max_size=g))
    return split_rows((m, n), shares)[0], draw(st.integers(1, 5)), draw(st.integers(0, 2**16))


@settings(max_examples=40)
@given(splits())
def test_split_newton_schulz_equals_one_rank(case):
    split, steps, seed = case
    x = torch.randn(split.shape, generator=torch.Generator().manual_seed(seed)) * 3
    want = newton_schulz(x, steps, COEFFICIENTS, 1e-7, "torch")
    got = simulate(split, x, steps, COEFFICIENTS, 1e-7)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    # bf16 products: a different matmul blocking may flip a last bit, and a step carries it on
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-2)
    assert sum(split.rows) == split.shape[0] and sum(split.x_rows) == min(split.shape)
    assert sum(split.member_flops(i, steps) for i in range(split.size)) == _ns_cost(*split.shape, steps)
    assert ns_flops(*split.shape, steps) == _ns_cost(*split.shape, steps)


# --- the plan ----------------------------------------------------------------------------------


def _hidden(model):
    from benchmarks.model_shapes import matrices

    return [s for _, s in matrices(model, hidden_only=True)]


@st.composite
def worlds(draw):
    shapes = draw(st.lists(st.tuples(st.integers(1, 300), st.integers(1, 300)), min_size=1, max_size=12))
    return shapes, draw(st.integers(1, 20)), draw(st.sampled_from([H200, FREE_COMM]))


@given(worlds())
def test_every_matrix_is_whole_on_one_rank_or_split_over_one_node(case):
    shapes, world, cost = case
    plan = vo.muon_plan(shapes, world, cost=cost)
    assert len(plan.loads) == world and sum(plan.loads) == sum(_ns_cost(m, n) for m, n in shapes)
    # each whole matrix's cost on its owner alone, each split's shares on its members
    assert plan.loads == _expected_loads(plan, shapes, world)
    for i, (owner, shape) in enumerate(zip(plan.owners, shapes)):
        assert (owner is None) == (i in plan.groups) == (i in plan.splits)
        if owner is not None:
            assert 0 <= owner < world
            continue
        members, split = plan.groups[i], plan.splits[i]
        assert list(members) == sorted(set(members)) and len(members) == split.size >= 2
        assert split.shape == shape and min(split.rows) >= 1 and min(split.x_rows) >= 1
        if cost is H200:
            assert members[0] // H200.node == members[-1] // H200.node  # a node's bandwidth
    grouped = {r for m in plan.groups.values() for r in m}
    assert all((plan.bytes_per_rank[r] > 0) == (r in grouped) for r in range(world))


def test_a_small_matrix_is_never_split_and_a_wide_one_is():
    assert not vo.muon_plan([(512, 512)] + [(8, 8)] * 3, 4).groups  # the bytes outweigh the FLOPs
    plan = vo.muon_plan([(4096, 4096)] + [(64, 64)] * 30, 4)
    assert plan.groups == {0: (0, 1, 2, 3)} and plan.imbalance < 1.01
    # its exchange: M's blocks, then each step X's (from the second) and A's
    assert len(plan.splits[0].gathers(5)) == 1 + 4 + 5


def test_goals_on_llama3_70b():
    shapes = _hidden("llama3-70b")
    assert vo.muon_plan(shapes, 1024).imbalance <= 1.10
    # At W = 8192 a node's share of the mean is below the largest matrix: max/mean is that
    # matrix over a node (groups across nodes would reach the mean, at the network's bandwidth:
    # slower in the cost model than one node), unless communication costs nothing.
    plan = vo.muon_plan(shapes, 8192)
    biggest = ns_flops(8192, 28672)
    assert plan.imbalance == pytest.approx(biggest / 8 / (sum(plan.loads) / 8192), rel=0.01)
    assert vo.muon_plan(shapes, 8192, cost=FREE_COMM).imbalance <= 1.25


def test_mesh_shape_checks_the_world_and_changes_nothing_else():
    shapes = [(256, 512)] * 9 + [(4096, 4096)]
    flat, mesh = vo.muon_plan(shapes, 16), vo.muon_plan(shapes, 16, mesh_shape=(2, 8))
    assert (flat.owners, flat.groups, flat.loads) == (mesh.owners, mesh.groups, mesh.loads)
    with pytest.raises(ValueError, match="does not span"):
        vo.muon_plan(shapes, 16, mesh_shape=(3, 4))


# --- training: a world of 4 and a 2x2 mesh ---------------------------------------------------------

# two matrices far larger than the rest (one tall, one wide): with communication free in the
# cost model the plan splits them over the 4 ranks
SHAPES = [(48, 20), (6, 5), (20, 36), (4, 4), (3, 5, 6)]
ADAM = [(7,), (5, 3)]
STEPS = 3
HYPER = dict(lr=0.02, weight_decay=0.1)


def _params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES + ADAM]


def _train(cap):
    rank, params = dist.get_rank(), _params()
    muon, adam = params[: len(SHAPES)], params[len(SHAPES) :]
    opt = vo.Muon(
        [{"params": muon}, {"params": adam, "use_muon": False, "lr": 0.01}],
        **HYPER,
        bucket_cap_numel=cap,
        cost_model=FREE_COMM,
    )
    stats = []
    for t in range(STEPS):
        for i, p in enumerate(params):
            p.grad = grad(p.shape, t, rank, i)
        opt.step()
        stats.append((opt.step_stats["ns_matrices"], opt.step_stats["ns_flops"]))
    return [p.detach().clone() for p in params], stats, opt.ns_load, dict(opt.plan.groups), opt.homes


def _reference(world):
    params = _params()
    muon, adam = params[: len(SHAPES)], params[len(SHAPES) :]
    mats = [(i, s) for i, p in enumerate(muon) for s in (range(p.shape[0]) if p.ndim == 3 else [None])]
    views = [
        torch.nn.Parameter((muon[i].detach()[s] if s is not None else muon[i].detach()).clone())
        for i, s in mats
    ]
    mopt, aopt = (
        torch.optim.Muon(views, **HYPER),
        torch.optim.AdamW(adam, lr=0.01, betas=(0.9, 0.95), weight_decay=0.1),
    )
    for t in range(STEPS):
        mean = [mean_of(grad(p.shape, t, r, i) for r in range(world)) for i, p in enumerate(params)]
        for v, (i, s) in zip(views, mats):
            v.grad = (mean[i][s] if s is not None else mean[i]).clone()
        for j, p in enumerate(adam):
            p.grad = mean[len(muon) + j]
        mopt.step()
        aopt.step()
    out = [
        torch.stack([v.detach() for v, (k, _) in zip(views, mats) if k == i])
        if p.ndim == 3
        else views[[k for k, _ in mats].index(i)].detach()
        for i, p in enumerate(muon)
    ]
    return out + [p.detach() for p in adam]


@pytest.mark.parametrize("cap", [64 * 1024 * 1024, 1], ids=["one bucket", "a bucket each"])
def test_a_world_of_4_with_split_matrices_equals_torch_muon(world, cap):
    results = world(4).run(_train, cap, timeout=120)
    want = _reference(4)
    plan = vo.muon_plan(SHAPES, 4, cost=FREE_COMM, homes=results[0][4])  # vo.Muon's own plan
    assert set(plan.groups) == {0, 2}  # the tall and the wide matrix are split
    mats = _matrices(SHAPES)
    n = len(mats)
    costed = _expected_loads(plan, mats, 4)  # the plan's assignment, costed here
    assert sum(costed) == sum(_ns_cost(m, k) for m, k in mats)
    firsts = [g[0] for g in plan.groups.values()]  # a split matrix counts at its first member
    counted = [plan.owners.count(r) + firsts.count(r) for r in range(4)]
    for rank, (params, stats, load, groups, _) in enumerate(results):
        assert groups == plan.groups and load == plan.loads == costed
        assert all(stat == (counted[rank], costed[rank]) for stat in stats)  # what this rank ran
        for got, ref in zip(params, want):
            torch.testing.assert_close(got, ref, rtol=0, atol=2e-4)
    assert [sum(r[1][t][0] for r in results) for t in range(STEPS)] == [n] * STEPS  # each once


def _hsdp(shape):
    from _tiny_gpt import build, train
    from torch.distributed.device_mesh import init_device_mesh

    rank, model = dist.get_rank(), build(layers=1)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    opt = make_ours("muon", model, mesh=mesh, shard_modules=[*model.layers, model], cost_model=FREE_COMM)
    train(model, opt, range(STEPS), rank)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, len(opt.plan.groups)


def test_hsdp_2x2_with_split_matrices_equals_one_process(world):
    from _tiny_gpt import build, world_grads

    model = build(layers=1)
    ref = Reference("muon", model)
    for t in range(STEPS):
        world_grads(model, t, 4)
        ref.step()
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for got, split in world(4).run(_hsdp, (2, 2), timeout=120):
        assert split >= 1
        assert_equal(got, want, TOL["muon"])


# --- a process group smaller than the world: its split groups made by all of its ranks --------------


def _emulated_split(real_new_group):
    """torch's `split_group` as its contract says, on gloo (which cannot split): every rank of
    the parent calls with the same disjoint splits (parent ranks) and gets its own group, or
    None. Built from local new_groups every rank of the parent makes, one each."""

    def split_group(parent_pg=None, split_ranks=None, **_):
        size, me = dist.get_world_size(parent_pg), dist.get_rank(parent_pg)
        splits = [sorted(g) for g in split_ranks]
        covered, mine = {r for g in splits for r in g}, None
        for g in splits + [[r] for r in range(size) if r not in covered]:
            ranks = [dist.get_global_rank(parent_pg, r) for r in g]
            made = real_new_group(ranks, use_local_synchronization=True)
            if me in g and g in splits:  # a rank in no split gets None
                mine = made
        return mine

    return split_group


def _on_three_of_four(bound):
    """vo.Muon over ranks 1, 2 and 3 of a world of 4 (rank 0 outside, as another pipeline
    stage), its plan splitting matrices. Every rank records the group-creation calls it makes
    (torch's `new_group` and `split_group`); with `bound` the library takes its path for a
    device-bound world (torch's split of the parent), emulated on gloo. Returns the calls, and
    on the group's ranks the plan's groups (global ranks) and the parameters after training."""
    from unittest import mock

    from vescale_optim.shard import groups

    rank, sub = dist.get_rank(), dist.new_group([1, 2, 3])
    calls, real_new, real_split = [], dist.new_group, _emulated_split(dist.new_group)

    def new_group(ranks=None, **kw):
        calls.append(("new_group", tuple(ranks), kw.get("use_local_synchronization", False)))
        return real_new(ranks, **kw)

    def split_group(parent_pg=None, split_ranks=None, **kw):
        calls.append(("split_group", parent_pg is sub, tuple(tuple(g) for g in split_ranks)))
        return real_split(parent_pg, split_ranks, **kw)

    with (
        mock.patch.object(dist, "new_group", new_group),
        mock.patch.object(dist, "split_group", split_group),
        mock.patch.object(groups, "_splits", lambda _: bound),
    ):
        if rank == 0:
            return calls, None, None
        me, params = dist.get_rank(sub), _params()
        muon, adam = params[: len(SHAPES)], params[len(SHAPES) :]
        opt = vo.Muon(
            [{"params": muon}, {"params": adam, "use_muon": False, "lr": 0.01}],
            **HYPER,
            cost_model=FREE_COMM,
            process_group=sub,
        )
        for t in range(STEPS):
            for i, p in enumerate(params):
                p.grad = grad(p.shape, t, me, i)
            opt.step()
    made = sorted({tuple(r + 1 for r in g) for g in opt.plan.groups.values()})
    return calls, made, [p.detach().clone() for p in params]


@pytest.mark.parametrize("bound", [False, True], ids=["new_group", "split_group"])
def test_split_groups_of_a_smaller_world_are_made_by_all_of_its_ranks(world, bound):
    """The groups a 3-rank process_group= splits its matrices over, in a world of 4, are made by
    all three of its ranks in one order, never by their members alone (on a device-bound world
    NCCL's split needs every rank of the parent: members alone would hang), and rank 0, outside
    it, makes none; the parameters end where torch.optim.Muon ends."""
    results = world(4).run(_on_three_of_four, bound, timeout=60)
    want = _reference(3)
    assert results[0][0] == []  # outside the group: no call
    calls, made = results[1][0], results[1][1]
    assert len(made) >= 2 and set(made[0]) & set(made[1])  # overlapping groups (wrap-around)
    for rank in (2, 3):  # the same calls in one order on every rank of the group
        assert results[rank][0] == calls and results[rank][1] == made
    if bound:
        assert calls and all(kind == "split_group" and of_sub for kind, of_sub, _ in calls)
        splits = [g for _, _, layer in calls for g in layer]
        assert all(len({r for g in layer for r in g}) == sum(map(len, layer)) for _, _, layer in calls)
        assert sorted(tuple(r + 1 for r in g) for g in splits) == made  # parent ranks, one split each
    else:
        assert calls and all(kind == "new_group" and local for kind, _, local in calls)
        assert all(set(ranks) <= {1, 2, 3} for _, ranks, _ in calls)
        assert set(made) <= {ranks for _, ranks, _ in calls}
    for rank in (1, 2, 3):
        for got, ref in zip(results[rank][2], want):
            torch.testing.assert_close(got, ref, rtol=0, atol=2e-4)
