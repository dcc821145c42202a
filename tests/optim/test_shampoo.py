"""Sharded Shampoo equals a plain single-process Shampoo at any world size; checkpoints
move across world sizes; on a rotated ill-conditioned quadratic it beats AdamW."""

import math
import re
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _held import held_tensor_bytes
from _shampoo_reference import ReferenceShampoo, inverse_fourth_root

import vescale_optim as vo
from vescale_optim.optim._shampoo_math import inverse_roots_, stripe_granule
from vescale_optim.owners.balance import assign_owners, rank_loads

SHAPES = [(10, 7), (8, 3, 2), (13,), (5, 12), (1, 6), (6,), (9, 2, 2), (21, 16)]
# (param indices, hyperparameters) per group: tiles of 3, 4 and 5, rows that stripes do not
# divide (21 rows: a rank boundary may cut a stripe), a plain-sum second moment,
# preconditioning every other step from step 2
MIXED = [
    ([0, 1, 2, 7], dict(max_preconditioner_dim=4, weight_decay=0.1)),
    (
        [3, 4, 5],
        dict(
            max_preconditioner_dim=5,
            grafting="adagrad",
            betas=(0.5, 1.0),
            lr=3e-3,
            precondition_frequency=2,
            start_preconditioning_step=2,
        ),
    ),
    ([6], dict(max_preconditioner_dim=3, grafting="sgd", lr=0.05)),
]
COMMON = dict(epsilon=1e-6, root_dtype=torch.float64)
FP32_ROOTS = [(idx, {**hyper, "root_dtype": torch.float32}) for idx, hyper in MIXED]  # the default
STEPS = 5
TOL = dict(rtol=1e-4, atol=1e-5)


def make_params(shapes=SHAPES):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def groups(params, spec):
    return [{"params": [params[i] for i in idx], **COMMON, **hyper} for idx, hyper in spec]


def dyadic(shape, seed):
    """Normal values rounded to multiples of 2^-12: sums of a few of them are exact in fp32."""
    g = torch.Generator().manual_seed(seed)
    return torch.round(torch.randn(shape, generator=g) * 4096) / 4096


def base_grad(step, i, shape):
    return dyadic(shape, 1000 * step + i)


def set_grads(params, step, rank, world):
    """Rank r gets the base gradient plus (r - (W-1)/2) times another: ranks differ, and their
    mean is the base gradient exactly (every partial sum is exact), so results at different
    world sizes can be compared bit for bit."""
    for i, p in enumerate(params):
        p.grad = base_grad(step, i, p.shape) + (rank - (world - 1) / 2) * dyadic(p.shape, 7 + 1000 * step + i)


def reference(spec, steps=STEPS, shapes=SHAPES):
    params = make_params(shapes)
    opt = ReferenceShampoo(groups(params, spec))
    for t in range(steps):
        for i, p in enumerate(params):
            p.grad = base_grad(t, i, p.shape)
        opt.step()
    return params, opt


def _run(opt, params, steps):
    for t in steps:
        opt.zero_grad()
        set_grads(params, t, opt.rank, opt.world_size)
        opt.step()


def _train(spec, steps=STEPS, shapes=SHAPES, state=True):
    params = make_params(shapes)
    opt = vo.Shampoo(groups(params, spec))
    _run(opt, params, range(steps))
    return {
        "params": [p.detach().clone() for p in params],
        "state": opt.state_dict() if state else None,
        "moved": opt.moved_tiles,
        "work": opt.root_work,
        "native": opt.native_root_work,
    }


def check_state(ours, ref_opt, params, spec):
    order = [i for idx, _ in spec for i in idx]  # state dicts number params by group
    for pos, i in enumerate(order):
        want = ref_opt.state[params[i]]
        got = ours["state"]["state"][pos]
        assert float(got["step"]) == want["step"]
        assert set(got) == set(want), (i, set(got) ^ set(want))
        for k, v in want.items():
            if k != "step":
                torch.testing.assert_close(got[k], v, **TOL, msg=f"param {i} {k}")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_equals_reference(world, world_size):
    results = world(world_size).run(_train, MIXED)
    params, ref = reference(MIXED)
    one = world(1).run(_train, MIXED)[0]
    for res in results:
        # the plain reference multiplies tiles one by one on strided views and takes x^(-1/4)
        # with pow: a few ulps apart, amplified by ill-conditioned roots
        for got, want in zip(res["params"], params):
            torch.testing.assert_close(got, want.detach(), **TOL)
        # one process: the same numbers, state included (cut and moved tiles too)
        for got, want in zip(res["params"], one["params"]):
            assert torch.equal(got, want)
    assert_same_state(one["state"], results[0]["state"])
    check_state(results[0], ref, params, MIXED)
    # stripes of the 21-row matrix cut by rank boundaries, and tiles moved for balance
    assert (results[0]["moved"] > 0) == (world_size > 1)
    assert max(results[0]["work"]) <= 1.2 * sum(results[0]["work"]) / world_size


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_same_bits_at_every_world_size(world, world_size):
    # with float32 roots, x^(-1/4) by pow rounded differently in its vector and scalar paths,
    # so a root depended on its tile's place in the batch: 1 ulp at step 1 at W = 4
    one = world(1).run(_train, FP32_ROOTS)[0]
    for res in world(world_size).run(_train, FP32_ROOTS):
        for got, want in zip(res["params"], one["params"]):
            assert torch.equal(got, want)
        assert_same_state(one["state"], res["state"])


@pytest.mark.parametrize("grafting", ["adam", "adagrad", "sgd", None])
def test_every_grafting_equals_reference(world, grafting):
    spec = [(list(range(len(SHAPES))), dict(grafting=grafting, max_preconditioner_dim=3, lr=0.02))]
    results = world(3).run(_train, spec, state=False)
    params, _ = reference(spec)
    for got, want in zip(results[0]["params"], params):
        torch.testing.assert_close(got, want.detach(), **TOL)


def test_unbalanced_root_work_moves_tiles_to_other_owners(world):
    # 2 ranks: the layout puts the 16x4 matrix (four 4x4 tiles) on rank 0, the vector on rank 1
    shapes = [(16, 4), (64,)]
    spec = [([0, 1], dict(max_preconditioner_dim=4, grafting="adam"))]
    results = world(2).run(_train, spec, shapes=shapes, state=False)
    params, _ = reference(spec, shapes=shapes)
    res = results[0]
    assert max(res["native"]) > 1.2 * sum(res["native"]) / 2
    assert res["moved"] > 0 and max(res["work"]) <= 1.1 * sum(res["work"]) / 2
    for got, want in zip(res["params"], params):
        torch.testing.assert_close(got, want.detach(), **TOL)


def test_stripe_units_and_balance():
    assert stripe_granule((4096, 512), 1024) == 1024 * 512  # stripes of 1024 rows
    assert stripe_granule((1500, 8, 8), 1024) == 4 * 64  # gcd(1500, 1024) = 4 rows
    assert stripe_granule((768, 50257), 1024) == 768 * 50257  # one stripe: the whole matrix
    assert stripe_granule((7,), 4) == 1
    # Shampoo's balance: slack 0.2
    assert assign_owners([8, 8, 9], 3, [0, 1, 2], slack=0.2) == [0, 1, 2]  # within 1.2x: nothing moves
    owners = assign_owners([8] * 8, 4, [0] * 8, slack=0.2)
    assert rank_loads([8] * 8, owners, 4) == [16, 16, 16, 16]


@pytest.mark.parametrize("schedule", [dict(start_preconditioning_step=100), dict(precondition_frequency=5)])
def test_grafting_alone_before_preconditioning_is_adamw(schedule):
    # by default preconditioning starts at precondition_frequency: no root built from fewer
    # steps of gradients is applied for precondition_frequency steps
    params = make_params()
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = vo.Shampoo(params, lr=0.01, weight_decay=0.1, **schedule)
    assert ours.param_groups[0]["start_preconditioning_step"] == schedule.get("start_preconditioning_step", 5)
    theirs = torch.optim.AdamW(twins, lr=0.01, weight_decay=0.1, eps=1e-8)
    for t in range(4):
        set_grads(params, t, 0, 1)
        set_grads(twins, t, 0, 1)
        ours.step()
        theirs.step()
    for a, b in zip(params, twins):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


def test_roots_survive_eigh_failures_and_non_finite_factors(monkeypatch):
    g = torch.Generator().manual_seed(2)
    grad = torch.zeros(128, 128)
    grad[torch.randperm(128, generator=g)[:12]] = torch.randn(12, 128, generator=g) * 0.01
    # an embedding-like factor (few used rows: many equal eigenvalues, on which fp32 eigh may
    # fail to converge) and a non-finite one, whose root stays as it was
    factors = torch.stack([grad @ grad.T, torch.full((128, 128), float("nan"))])
    roots = torch.full_like(factors, 7.0)
    assert inverse_roots_(roots, factors, step=1, beta2=1.0, epsilon=1e-12, dtype=torch.float32) == 1
    assert torch.isfinite(roots[0]).all()
    assert torch.equal(roots[1], torch.full((128, 128), 7.0))
    # when fp32 fails, the root comes from float64
    eigh = torch.linalg.eigh

    def fp32_fails(a):
        if a.dtype == torch.float32:
            raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
        return eigh(a)

    monkeypatch.setattr(torch.linalg, "eigh", fp32_fails)
    assert inverse_roots_(roots, factors, step=1, beta2=1.0, epsilon=1e-6, dtype=torch.float32) == 1
    want = inverse_fourth_root(factors[0].double(), 1e-6, torch.float64).float()
    torch.testing.assert_close(roots[0], want, rtol=1e-5, atol=1e-5)


# --- a rotated, ill-conditioned quadratic --------------------------------------------


def _quadratic(n=16, cond=1000.0):
    """f(X) = 1/2 |A^(1/2) (X - X*) B^(1/2)|_F^2 with A, B of condition `cond` in random bases:
    Kronecker-structured curvature that no diagonal preconditioner can undo."""
    g = torch.Generator().manual_seed(0)
    q1, _ = torch.linalg.qr(torch.randn(n, n, generator=g))
    q2, _ = torch.linalg.qr(torch.randn(n, n, generator=g))
    spectrum = torch.logspace(0, -math.log10(cond), n)
    a, b = q1 @ torch.diag(spectrum) @ q1.T, q2 @ torch.diag(spectrum) @ q2.T
    target = torch.randn(n, n, generator=g)

    def loss(x):
        e = x - target
        return 0.5 * torch.trace(e.T @ a @ e @ b)

    return loss


def _final_loss(make_opt, loss, steps=100):
    x = torch.nn.Parameter(torch.zeros(16, 16))
    opt = make_opt([x])
    for _ in range(steps):
        opt.zero_grad()
        loss(x).backward()
        opt.step()
    value = loss(x).item()
    return value if math.isfinite(value) else math.inf


def _best(make_opt, loss, grid=(1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)):
    """(final loss, lr) at the best learning rate of the grid."""
    return min((_final_loss(lambda p, lr=lr: make_opt(p, lr), loss), lr) for lr in grid)


def test_beats_adamw_on_rotated_ill_conditioned_quadratic():
    loss = _quadratic()
    start = loss(torch.zeros(16, 16)).item()
    shampoo, _ = _best(lambda p, lr: vo.Shampoo(p, lr=lr, epsilon=1e-10), loss)
    adamw, _ = _best(lambda p, lr: torch.optim.AdamW(p, lr=lr, weight_decay=0), loss)
    # measured: start 2.07, AdamW 5.4e-3 (lr 0.3), Shampoo 5.2e-5 (lr 0.3)
    assert shampoo < 0.1 * adamw < start, (shampoo, adamw, start)


# --- checkpoints ------------------------------------------------------------------------


def _train_then_state(steps):
    params = make_params()
    opt = vo.Shampoo(groups(params, MIXED))
    _run(opt, params, range(steps))
    return [p.detach().clone() for p in params], opt.state_dict()


def _resume(values, state, steps):
    params = make_params()
    with torch.no_grad():
        for p, v in zip(params, values):
            p.copy_(v)
    opt = vo.Shampoo(groups(params, MIXED))
    opt.load_state_dict(state)
    reloaded = opt.state_dict()
    _run(opt, params, steps)
    return [p.detach().clone() for p in params], reloaded


def _dcp_save(path, steps):
    params = make_params()
    opt = vo.Shampoo(groups(params, MIXED))
    _run(opt, params, range(steps))
    dcp.save(opt.sharded_state_dict(torch.nn.ParameterList(params)), checkpoint_id=path)
    return [p.detach().clone() for p in params]


def _dcp_resume(path, values, steps):
    params = make_params()
    with torch.no_grad():
        for p, v in zip(params, values):
            p.copy_(v)
    opt = vo.Shampoo(groups(params, MIXED))
    names = torch.nn.ParameterList(params)  # the names its state is keyed by
    sd = opt.sharded_state_dict(names)
    dcp.load(sd, checkpoint_id=path)
    opt.load_sharded_state_dict(sd, names)
    loaded = opt.state_dict()
    _run(opt, params, steps)
    return [p.detach().clone() for p in params], loaded, dist.get_rank()


def assert_same_state(a, b):
    assert a["state"].keys() == b["state"].keys()
    for i, st in a["state"].items():
        assert st.keys() == b["state"][i].keys()
        for k, v in st.items():
            torch.testing.assert_close(b["state"][i][k], v, rtol=0, atol=0, msg=f"{i} {k}")


def test_state_dict_and_dcp_save_at_4_load_at_3_continue_exactly(world, tmp_path):
    straight, _ = world(4).run(_train_then_state, STEPS)[0]
    values, state = world(4).run(_train_then_state, 3)[0]
    # full format: 4 ranks -> 3 ranks (state identical) -> 4 ranks continues bit for bit
    _, via3 = world(3).run(_resume, values, state, range(0))[0]
    assert_same_state(state, via3)
    resumed, _ = world(4).run(_resume, values, via3, range(3, STEPS))[0]
    for a, b in zip(resumed, straight):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # DCP: saved by 4 ranks, each its own pieces; loaded by 3 gives the same state, and the
    # 3-rank run then continues exactly as one resumed from the full state dict
    path = str(tmp_path / "ckpt")
    world(4).run(_dcp_save, path, 3)
    results = world(3).run(_dcp_resume, path, values, range(3, STEPS))
    via_full = world(3).run(_resume, values, state, range(3, STEPS))[0][0]
    for got, loaded, _ in results:
        assert_same_state(state, loaded)
        for a, b in zip(got, via_full):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    params, _ = reference(MIXED)
    for a, b in zip(results[0][0], params):
        torch.testing.assert_close(a, b.detach(), **TOL)


BAD = [
    (dict(max_preconditioner_dim=0), "max_preconditioner_dim"),
    (dict(max_preconditioner_dim=2.5), "max_preconditioner_dim"),
    (dict(grafting="rmsprop"), "grafting"),
    (dict(epsilon=-1e-12), "epsilon"),
    (dict(grafting_epsilon=-1.0), "grafting_epsilon"),
    (dict(weight_decay=float("nan")), "weight_decay"),
    (dict(lr=-1.0), "learning rate"),
    (dict(lr=torch.tensor([0.1, 0.1])), "Tensor lr must be 1-element"),
    (dict(betas=(1.0, 0.99)), "beta parameter at index 0"),
    (dict(betas=(0.9, 1.5)), "beta parameter at index 1"),
    (dict(precondition_frequency=0), "precondition_frequency"),
    (dict(precondition_frequency=2.5), "precondition_frequency"),
    (dict(start_preconditioning_step=0), "start_preconditioning_step"),
    # a root built from one step's gradient would be applied for 10 steps
    (dict(precondition_frequency=10, start_preconditioning_step=1), "start_preconditioning_step"),
    (dict(root_dtype=torch.float16), "root_dtype"),
]


def _both_ways(kwargs):
    """Constructor arguments with `kwargs` as the defaults, and in a second param group."""
    params = make_params()
    return [((params,), kwargs), (([{"params": params[:2]}, {"params": params[2:], **kwargs}],), {})]


@pytest.mark.parametrize("kwargs, match", BAD)
def test_bad_input(kwargs, match):
    for args, kw in _both_ways(kwargs):
        with pytest.raises(ValueError, match=match):
            vo.Shampoo(*args, **kw)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(start_preconditioning_step=None), "start_preconditioning_step"),
        (dict(lr=-1.0), "learning rate"),
        (dict(precondition_frequency=0), "precondition_frequency"),
    ],
)
def test_a_bad_hyperparameter_set_after_construction_is_refused_before_anything_changes(change, match):
    params = make_params()
    opt = vo.Shampoo(groups(params, MIXED))
    set_grads(params, 0, 0, 1)
    opt.step()
    before = ([p.detach().clone() for p in params], opt.state_dict())
    opt.param_groups[1].update(change)
    set_grads(params, 1, 0, 1)
    with pytest.raises(RuntimeError, match=match):  # as AdamW and Muon refuse such a step
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, before[0]))
    after = opt.state_dict()["state"]
    for i, state in before[1]["state"].items():
        for k, v in state.items():
            assert torch.equal(after[i][k], v), (i, k)


def test_bare_tensor_is_not_a_parameter_list():
    with pytest.raises(TypeError, match="should be an iterable of Tensors or dicts"):
        vo.Shampoo(torch.zeros(3, 3))


def _refusals(bad):
    out = []
    for kwargs, _ in bad:
        for args, kw in _both_ways(kwargs):
            try:
                vo.Shampoo(*args, **kw)
                out.append(None)
            except Exception as e:  # noqa: BLE001 - the test checks type and message
                out.append((type(e).__name__, str(e)))
    return out


def test_bad_input_on_two_ranks(world):
    for refused in world(2).run(_refusals, BAD):
        for (_, match), got in zip([b for b in BAD for _ in range(2)], refused):
            assert got is not None and got[0] == "ValueError" and re.search(match, got[1]), (match, got)
    assert world(2).run(_train, MIXED, steps=1, state=False)  # the world is still usable


def _nan_tile(steps):
    """A NaN in one gradient element at step 2: that tile's factors stay non-finite."""
    params = make_params()
    opt = vo.Shampoo(groups(params, MIXED))
    kept = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(steps):
            opt.zero_grad()
            set_grads(params, t, opt.rank, opt.world_size)
            if t == 1:
                params[0].grad[0, 0] = float("nan")
            opt.step()
            kept.append(opt.kept_roots)
    return kept, [(str(w.message), w.filename) for w in caught if "inverse root" in str(w.message)]


@pytest.mark.parametrize("world_size", [1, 3])
def test_non_finite_factors_keep_their_roots_counted_and_warned(world, world_size):
    for kept, warned in world(world_size).run(_nan_tile, 3):
        # tile (0, 0) of the 10x7 parameter (tiles of 4): its L and R, at steps 2 and 3
        assert kept == [0, 2, 4]
        assert len(warned) == 2 and "2 factor(s)" in warned[0][0]
        assert all(filename == __file__ for _, filename in warned)  # points at the caller


def _held(steps):
    params = make_params()
    opt = vo.Shampoo(groups(params, MIXED))
    _run(opt, params, range(steps))
    return held_tensor_bytes(opt), opt.local_state_bytes(), opt.local_state_numel(), opt.moved_tiles


@pytest.mark.parametrize("world_size", [1, 3])
def test_local_state_counts_every_tensor_held(world, world_size):
    results = world(world_size).run(_held, 2)
    for held, counted, numel, _ in results:
        assert held == counted == 4 * numel  # fp32 throughout
    assert (results[0][3] > 0) == (world_size > 1)  # tiles that travel hold no buffers either


# --- parameters without a gradient take no step, as in torch ---------------------------------

SKIPPED = {1: {0}, 2: {0, 2}, 3: {2}}  # step -> parameters with no gradient on any rank
PARTIAL = {2: 1}  # step -> a parameter only rank 0 has a gradient for


def _sparse_grads(params, t, rank, world):
    set_grads(params, t, rank, world)
    for i in SKIPPED.get(t, ()):
        params[i].grad = None
    if t in PARTIAL and rank:
        params[PARTIAL[t]].grad = None


def _train_sparse():
    params = make_params()
    opt = vo.Shampoo(groups(params, MIXED))
    for t in range(STEPS):
        opt.zero_grad()
        _sparse_grads(params, t, opt.rank, opt.world_size)
        opt.step()
    return [p.detach().clone() for p in params], opt.state_dict()


@pytest.mark.parametrize("world_size", [1, 3])
def test_parameters_without_a_gradient_take_no_step(world, world_size):
    params = make_params()
    ref = ReferenceShampoo(groups(params, MIXED))
    for t in range(STEPS):
        for i, p in enumerate(params):
            if i in SKIPPED.get(t, ()):
                p.grad = None
            elif t in PARTIAL and i == PARTIAL[t]:  # rank 0's gradient alone, averaged over all ranks
                rank0 = base_grad(t, i, p.shape) - (world_size - 1) / 2 * dyadic(p.shape, 7 + 1000 * t + i)
                p.grad = rank0 / world_size
            else:
                p.grad = base_grad(t, i, p.shape)
        ref.step()
    for got, sd in world(world_size).run(_train_sparse):
        for a, b in zip(got, params):
            torch.testing.assert_close(a, b.detach(), **TOL)
        order = [i for idx, _ in MIXED for i in idx]
        for pos, i in enumerate(order):
            assert float(sd["state"][pos]["step"]) == ref.state[params[i]]["step"], i
