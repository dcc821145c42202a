"""The Muon family: Polar Express coefficients, NorMuon, fused-QKV `split_sizes` and per-head
`num_heads`, against references written here from the published formulas, and the same numbers
at every world size and layout (ZeRO-2, ZeRO-3, HSDP, 8-bit state, resumed at another size)."""

import pytest
import torch
from _muon_cases import normuon_reference
from hypothesis import given
from hypothesis import strategies as st

import vescale_optim as vo
from vescale_optim.kernels import newton_schulz
from vescale_optim.kernels.newton_schulz import POLAR_EXPRESS
from vescale_optim.optim._muon_math import adjusted_lr
from vescale_optim.optim._muon_plan import FREE_COMM

HYPER = dict(lr=0.02, weight_decay=0.1)


# --- references from the papers ----------------------------------------------------------------


def polar_express_reference(g: torch.Tensor, dtype=torch.float64, scale: float = 1.02) -> torch.Tensor:
    """Amsel et al. 2025, Algorithm 1 with its five triples: `X / (1.02 ||X||_F)`, then per step
    `S = X Xᵀ`, `X <- a X + (b S + c S²) X`, in `dtype`."""
    x = g.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (x.norm() * scale).clamp(min=1e-7)
    for a, b, c in POLAR_EXPRESS:
        s = x @ x.mT
        x = a * x + (b * s + c * s @ s) @ x
    return x.mT if tall else x


def _bf16_in_torchs_order(g: torch.Tensor) -> torch.Tensor:
    """The same iteration in bf16 with torch.optim.Muon's operation order (`addmm`), which the
    library keeps: bit for bit."""
    x = g.bfloat16()
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (torch.linalg.vector_norm(x) * 1.02).clamp(min=1e-7)
    for a, b, c in POLAR_EXPRESS:
        s = x @ x.mT
        x = torch.addmm(x, torch.addmm(s, s, s, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


@given(st.integers(2, 24), st.integers(2, 24), st.integers(0, 2**16))
def test_polar_express_matches_the_paper(m, n, seed):
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(m, min(m, n), generator=g))
    v, _ = torch.linalg.qr(torch.randn(n, min(m, n), generator=g))
    x = (u * (0.3 + 0.7 * torch.rand(min(m, n), generator=g))) @ v.T  # well conditioned
    got = newton_schulz(x, coefficients="polar_express")
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, _bf16_in_torchs_order(x))
    # against the float64 iteration: bf16 rounding, amplified by the large first steps
    want = polar_express_reference(x)
    assert (got.double() - want).norm() <= 0.25 * want.norm()
    assert 0.7 <= torch.linalg.svdvals(got.double()).min() <= torch.linalg.svdvals(got.double()).max() <= 1.25


def test_coefficient_forms_agree_and_the_default_stays_torchs():
    x = torch.randn(12, 7, generator=torch.Generator().manual_seed(1))
    triple = (3.4445, -4.775, 2.0315)
    assert torch.equal(newton_schulz(x, 5, triple), newton_schulz(x, 1, [triple] * 5))
    assert torch.equal(newton_schulz(x, 3, POLAR_EXPRESS), newton_schulz(x, 5, POLAR_EXPRESS))
    assert not torch.equal(newton_schulz(x, coefficients=POLAR_EXPRESS), newton_schulz(x, 9, "polar_express"))
    with pytest.raises(ValueError, match="unknown ns_coefficients name 'polar'"):
        newton_schulz(x, coefficients="polar")


def _one_process(normuon: bool, coefficients, steps: int = 3):
    """vo.Muon on one matrix against the loop written out: torch's momentum, the library's
    Newton–Schulz (checked against torch elsewhere), NorMuon from the paper."""
    g = torch.Generator().manual_seed(5)
    p = torch.nn.Parameter(torch.randn(10, 6, generator=g))
    ref = p.detach().clone()
    opt = vo.Muon([p], **HYPER, ns_coefficients=coefficients, normuon=normuon, normuon_beta2=0.9)
    buf, v = torch.zeros_like(ref), torch.zeros(10)
    for _ in range(steps):
        grad = torch.randn(10, 6, generator=g)
        p.grad = grad.clone()
        opt.step()
        buf.lerp_(grad, 0.05)
        o = newton_schulz(grad.lerp(buf, 0.95), 5, coefficients)
        if normuon:
            o, v = normuon_reference(o, v, 0.9)
            o = o.bfloat16()
        ref.mul_(1 - 0.02 * 0.1).add_(o, alpha=-adjusted_lr(0.02, None, 10, 6))
    return p.detach(), ref, opt


@pytest.mark.parametrize("coefficients", [(3.4445, -4.775, 2.0315), "polar_express"])
def test_normuon_and_polar_express_match_the_written_out_loop(coefficients):
    got, want, opt = _one_process(True, coefficients)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    state = opt.state_dict()["state"][0]
    assert state["variance_neuron"].shape == (10,) and state["variance_neuron"].min() > 0
    plain, want_plain, _ = _one_process(False, "polar_express")
    torch.testing.assert_close(plain, want_plain, rtol=0, atol=1e-6)
    assert not torch.allclose(got, plain)


# --- fused QKV and heads -----------------------------------------------------------------------

D, Q, KV = 8, 8, 4  # grouped-query attention: K and V narrower than Q


def _qkv_grads(steps: int = 3):
    g = torch.Generator().manual_seed(11)
    return [torch.randn(Q + 2 * KV, D, generator=g) for _ in range(steps)]


def _fused(grads, **group):
    w = torch.nn.Parameter(torch.randn(Q + 2 * KV, D, generator=torch.Generator().manual_seed(3)))
    opt = vo.Muon([{"params": [w], **group}], **HYPER, adjust_lr_fn="match_rms_adamw")
    for grad in grads:
        w.grad = grad.clone()
        opt.step()
    return w.detach(), opt


def test_split_sizes_equal_separate_q_k_v_under_torch_muon():
    grads = _qkv_grads()
    fused, _ = _fused(grads, split_sizes=(Q, KV, KV))
    w = torch.randn(Q + 2 * KV, D, generator=torch.Generator().manual_seed(3))
    parts = [torch.nn.Parameter(t.clone()) for t in w.split((Q, KV, KV))]
    opt = torch.optim.Muon(parts, **HYPER, adjust_lr_fn="match_rms_adamw")
    for grad in grads:
        for part, gr in zip(parts, grad.split((Q, KV, KV))):
            part.grad = gr.clone()
        opt.step()
    assert torch.equal(fused, torch.cat([p.detach() for p in parts]))
    whole, _ = _fused(grads)
    assert not torch.equal(fused, whole)


def test_num_heads_equals_its_split_sizes_and_normuon_per_block():
    grads = _qkv_grads()
    heads, _ = _fused(grads, num_heads=4)
    assert torch.equal(heads, _fused(grads, split_sizes=(4, 4, 4, 4))[0])
    normed, opt = _fused(grads, split_sizes=(Q, KV, KV), normuon=True)
    state = opt.state_dict()["state"][0]
    assert [state[f"variance_neuron_{b}"].shape for b in range(3)] == [(Q,), (KV,), (KV,)]


# --- checks ------------------------------------------------------------------------------------


def _build(group=None, adam=None, cls=vo.Muon, **kwargs):
    g = torch.Generator().manual_seed(0)
    w, b = (
        torch.nn.Parameter(torch.randn(12, 4, generator=g)),
        torch.nn.Parameter(torch.randn(4, generator=g)),
    )
    if cls is vo.AdamW:
        return cls([{"params": [w, b], "param_names": ["w", "b"], **(group or {})}], **kwargs)
    groups = [
        {"params": [w], "param_names": ["w"], **(group or {})},
        {"params": [b], "param_names": ["b"], "use_muon": False, **(adam or {})},
    ]
    return cls(groups, **kwargs)


REFUSED = [
    (
        dict(group=dict(split_sizes=(4, 4))),
        r"param group 0, parameter 'w' #0 .*sum to 8, but the matrix has 12",
    ),
    (dict(group=dict(num_heads=5)), r"parameter 'w' #0 .*num_heads=5 does not divide"),
    (dict(group=dict(num_heads=3, split_sizes=(4, 8))), "not both"),
    (dict(group=dict(split_sizes=(12.0,))), "positive row counts"),
    (dict(ns_coefficients="polar"), "unknown ns_coefficients name 'polar'"),
    (dict(group=dict(ns_coefficients=[(1.0, 2.0, 3.0), (1.0, 2.0)])), "Coefficients must be"),
    (dict(group=dict(normuon="yes")), "normuon must be True or False"),
    (dict(normuon_beta2=1.0), "normuon_beta2"),
    (dict(adam=dict(normuon=True)), "param group 1: normuon=True is a Muon option"),
    (dict(adam=dict(split_sizes=(4,))), "split_sizes=.* is a Muon option"),
    (dict(cls=vo.AdamW, group=dict(normuon=True)), "normuon=True is a Muon option"),
]


@pytest.mark.parametrize("kwargs, match", REFUSED)
def test_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _build(**kwargs)


def test_other_keys_pass_through_and_normuon_on_muon_groups_only():
    opt = _build(group=dict(my_tag="attn", normuon=True), adam=dict(my_tag="bias"), normuon=True)
    assert opt.param_groups[0]["normuon"] and not opt.param_groups[1]["normuon"]


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(ns_coefficients="polar"), "param group 0: unknown ns_coefficients name"),
        (dict(normuon_beta2=-0.5), "param group 0: normuon_beta2"),
        (dict(split_sizes=(4, 8)), "param group 0: 'split_sizes' changed"),
        (dict(normuon=True), "param group 0: 'normuon' changed"),
    ],
)
def test_refused_at_a_step_changes_nothing(change, match):
    opt = _build()
    w = opt.param_groups[0]["params"][0]
    before = w.detach().clone()
    opt.param_groups[0].update(change)
    w.grad = torch.ones_like(w)
    with pytest.raises(RuntimeError, match=match):  # every rank refuses the step together
        opt.step()
    assert torch.equal(w.detach(), before)


# --- every world size and layout ---------------------------------------------------------------

SHAPES = [(Q + 2 * KV, D), (6, 10), (2, 6, 4), (12, 5)]
ADAM = [(5,)]
VARIANTS = {
    "polar": ({"ns_coefficients": "polar_express"}, {}),
    "normuon_qkv": ({"normuon": True}, {0: {"split_sizes": (Q, KV, KV)}, 3: {"num_heads": 3}}),
    "normuon_8bit": ({"normuon": True, "state_bits": 8}, {0: {"num_heads": 2}}),
}  # SHAPES are below state_tiers.QUANT_MIN_NUMEL (fp32 tier at state_bits=8); Q8_SHAPES reach the q8 tier


def _params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES + ADAM]


def _grad(shape, step, i):
    """The same on every rank and bf16-exact, so the mean over any world size is exact."""
    g = torch.Generator().manual_seed(7919 * step + i)
    return torch.randn(shape, generator=g).bfloat16().float()


def _optimizer(params, variant, **sharding):
    defaults, per_param = VARIANTS[variant]
    muon = params[: len(SHAPES)]
    groups = [{"params": [p], **per_param.get(i, {})} for i, p in enumerate(muon)]
    groups.append({"params": params[len(SHAPES) :], "use_muon": False})
    return vo.Muon(groups, **HYPER, **defaults, **sharding)


def _train(variant, steps=3, start=0, state=None, values=None, **sharding):
    params = _params()
    if values is not None:
        with torch.no_grad():
            for p, v in zip(params, values):
                p.copy_(v)
    opt = _optimizer(params, variant, **sharding)
    if state is not None:
        opt.load_state_dict(state)
    for t in range(start, start + steps):
        for i, p in enumerate(params):
            p.grad = _grad(p.shape, t, i)
        opt.step()
    return [p.detach().clone() for p in params], opt.state_dict()


@pytest.fixture(scope="module")
def single():
    return {v: _train(v) for v in VARIANTS}


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_same_numbers_at_every_world_size(world, single, world_size):
    for variant, (want, want_state) in single.items():
        for got, state in world(world_size).run(_train, variant):
            for a, b in zip(got, want):
                assert torch.equal(a, b), variant
            for i, st_ in want_state["state"].items():
                for key, value in st_.items():
                    assert torch.equal(state["state"][i][key], value), (variant, i, key)


def _split_groups(variant):
    """A world of 4 with communication free: the plan splits the big matrices (not NorMuon's)."""
    got, _ = _train(variant, cost_model=FREE_COMM, bucket_cap_numel=1)
    return got


def test_split_newton_schulz_takes_polar_express(world, single):
    for got in world(4).run(_split_groups, "polar"):
        for a, b in zip(got, single["polar"][0]):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-4)
    for got in world(4).run(_split_groups, "normuon_qkv"):
        for a, b in zip(got, single["normuon_qkv"][0]):
            assert torch.equal(a, b)


class _FusedQKVNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(D, Q + 2 * KV, bias=False)
        self.out = torch.nn.Linear(Q + 2 * KV, D)


def _modules(layout: str = "zero2"):
    """Three steps of a fused-QKV layer and an output layer (NorMuon, per-block and per-head)
    from one input, under `layout`; the model's full state dict after."""
    net = _FusedQKVNet()
    groups = [
        {"params": [net.qkv.weight], "split_sizes": (Q, KV, KV)},
        {"params": [net.out.weight], "num_heads": 2},
        {"params": [net.out.bias], "use_muon": False},
    ]
    sharding = {}
    if layout == "zero3":
        sharding["shard_modules"] = [net.qkv, net.out]
    if layout == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        sharding["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    opt = vo.Muon(groups, **HYPER, normuon=True, **sharding)
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        net.out(net.qkv(x)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in opt.full_model_state_dict(net).items()}


@pytest.mark.parametrize("world_size, layout", [(2, "zero2"), (2, "zero3"), (4, "zero3"), (4, "hsdp")])
def test_zero2_zero3_and_hsdp_agree(world, world_size, layout):
    want = _modules()
    for got in world(world_size).run(_modules, layout):
        for k in want:
            assert torch.equal(got[k], want[k]), k


def _resume(variant, state, values):
    got, _ = _train(variant, steps=2, start=2, state=state, values=values)
    return got


def test_resume_at_another_world_size(world):
    for variant in ("normuon_qkv", "normuon_8bit"):
        straight, _ = _train(variant, steps=4)
        halfway, state = world(2).run(_train, variant, 2)[0]
        for got in world(3).run(_resume, variant, state, halfway):
            for a, b in zip(got, straight):
                assert torch.equal(a, b), variant
        assert torch.equal(_resume(variant, state, halfway)[0], straight[0])


# --- 8-bit NorMuon: v in int8 codes and scales, as momentum is -----------------------------------

Q8_SHAPES = [(64, 96), (80, 64), (6, 10)]  # two of 4096+ elements (q8 tier), one below (fp32)


def _normuon_q8(steps=3, start=0, state=None, values=None, normuon=True):
    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in Q8_SHAPES]
    if values is not None:
        with torch.no_grad():
            for p, v in zip(params, values):
                p.copy_(v)
    opt = vo.Muon(params, **HYPER, normuon=normuon, state_bits=8)
    if state is not None:
        opt.load_state_dict(state)
    for t in range(start, start + steps):
        for i, p in enumerate(params):
            p.grad = _grad(p.shape, t, i)
        opt.step()
    return [p.detach().clone() for p in params], opt.state_dict(), opt.memory_stats()["state"]


def test_8bit_normuon_stores_v_as_int8_codes_and_scales():
    _, state, with_v = _normuon_q8(1)
    _, _, without = _normuon_q8(1, normuon=False)
    # rows int8 codes + one fp32 scale per 256 rows for the q8 matrices, fp32 for the small one
    assert with_v - without == (64 + 4) + (80 + 4) + 4 * 6
    assert [tuple(st["variance_neuron"].shape) for st in state["state"].values()] == [(64,), (80,), (6,)]


def test_8bit_normuon_is_identical_at_every_world_size_and_resumed(world):
    want, want_state, _ = _normuon_q8(4)
    for world_size in (2, 3):
        for got, state, _ in world(world_size).run(_normuon_q8, 4):
            assert all(torch.equal(a, b) for a, b in zip(got, want)), world_size
            for i, st_ in want_state["state"].items():
                for key, value in st_.items():
                    assert torch.equal(state["state"][i][key], value), (world_size, i, key)
    halfway, state, _ = world(2).run(_normuon_q8, 2)[0]
    for got, _, _ in [*world(3).run(_normuon_q8, 2, 2, state, halfway), _normuon_q8(2, 2, state, halfway)]:
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def _normuon_q8_dcp(path, mode):
    """Two 8-bit NorMuon steps saved with DCP (`mode="save"`), or a fresh optimizer loading them."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in Q8_SHAPES]
    opt = vo.Muon(params, **HYPER, normuon=True, state_bits=8)
    names = torch.nn.ParameterList(params)  # the names its state is keyed by
    if mode == "load":
        sd = opt.sharded_state_dict(names)
        dcp.load(sd, checkpoint_id=path)
        opt.load_sharded_state_dict(sd, names)
        return opt.state_dict()
    for t in range(2):
        for i, p in enumerate(params):
            p.grad = _grad(p.shape, t, i)
        opt.step()
    dcp.save(opt.sharded_state_dict(names), checkpoint_id=path)
    return opt.state_dict()


def test_8bit_normuon_v_through_dcp_at_another_world_size(world, tmp_path):
    path = str(tmp_path / "normuon_q8")
    saved = world(3).run(_normuon_q8_dcp, path, "save")[0]
    loaded = world(2).run(_normuon_q8_dcp, path, "load")[0]
    for i, st_ in saved["state"].items():
        for key, value in st_.items():
            assert torch.equal(loaded["state"][i][key], value), (i, key)
