"""AdamW with 16- and 8-bit moments: tracks fp32, and 8-bit state does not depend on the world size."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import vescale_optim as vo


def regression(state_bits, steps=200, world=None):
    """Least squares with a 96x128 weight (quantized) and a bias (small: fp32)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 128, generator=g)
    w_true = torch.randn(96, 128, generator=g) / 8
    y = x @ w_true.T + 0.01 * torch.randn(512, 96, generator=g)
    model = torch.nn.Linear(128, 96)
    with torch.no_grad():
        model.weight.copy_(torch.randn(96, 128, generator=g) / 16)
        model.bias.zero_()
    opt = vo.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, state_bits=state_bits)
    losses = []
    for t in range(steps):
        idx = torch.arange(t * 64, t * 64 + 64) % 512
        loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, opt


def test_low_bit_moments_track_fp32():
    """Mean loss over the last 50 steps within 5% (16-bit) and 10% (8-bit) of fp32's."""
    base, _ = regression(32)
    for bits, tol in ((16, 0.05), (8, 0.10)):
        losses, opt = regression(bits)
        tail, ref = sum(losses[-50:]) / 50, sum(base[-50:]) / 50
        assert abs(tail - ref) <= tol * ref, (bits, tail, ref)
        assert losses[-1] < 0.05 * losses[0]
    assert base[-1] < 0.05 * base[0]


def test_state_bytes_shrink():
    _, full = regression(32, steps=1)
    _, half = regression(16, steps=1)
    _, eight = regression(8, steps=1)
    b32, b16, b8 = (o.local_state_bytes() for o in (full, half, eight))
    n = 96 * 128
    assert b32 >= 8 * n and b16 < 0.55 * b32 and b8 < 0.3 * b32


def test_state_dict_exports_fp32_under_torch_names_and_loads_into_torch():
    _, opt = regression(8, steps=5)
    sd = opt.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert sd["state"][0]["exp_avg"].dtype == torch.float32
    model = torch.nn.Linear(128, 96)
    torch.optim.AdamW(model.parameters()).load_state_dict(sd)
    # and back: re-encoding the exported moments reproduces them exactly (idempotent)
    opt.load_state_dict(sd)
    again = opt.state_dict()
    for k in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(again["state"][0][k], sd["state"][0][k], rtol=1e-6, atol=0)


def _same_grads_everywhere(steps):
    """Every rank sees the same gradients (bf16 values, so their mean is exact in fp32 at
    any world size)."""
    g = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(33, 256), (7,), (4096,), (20, 300)]]
    opt = vo.AdamW(params, lr=1e-2, state_bits=8)
    for t in range(steps):
        gg = torch.Generator().manual_seed(100 + t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gg).bfloat16().float()
        opt.step()
    return opt.state_dict(), [p.detach().clone() for p in params]


@pytest.mark.parametrize("world_size", [2, 3])
def test_quantized_state_is_identical_at_any_world_size(world, world_size):
    want, params = world(1).run(_same_grads_everywhere, 3)[0]
    got, got_params = world(world_size).run(_same_grads_everywhere, 3)[0]
    for i, st in want["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(got["state"][i][k], v, rtol=0, atol=0)
    for a, b in zip(got_params, params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _dcp_8bit(path, mode):
    g = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(33, 256), (7,), (20, 300)]]
    opt = vo.AdamW(params, lr=1e-2, state_bits=8)
    names = torch.nn.ParameterList(params)  # the names its state is keyed by
    if mode == "load":
        sd = opt.sharded_state_dict(names)
        dcp.load(sd, checkpoint_id=path)
        opt.load_sharded_state_dict(sd, names)
        return opt.state_dict()
    for t in range(2):
        gg = torch.Generator().manual_seed(100 + t + dist.get_rank())
        for p in params:
            p.grad = torch.randn(p.shape, generator=gg)
        opt.step()
    dcp.save(opt.sharded_state_dict(names), checkpoint_id=path)
    return opt.state_dict()


def test_dcp_round_trip_of_8bit_state(world, tmp_path):
    path = str(tmp_path / "q8")
    saved = world(3).run(_dcp_8bit, path, "save")[0]
    loaded = world(2).run(_dcp_8bit, path, "load")[0]
    for i, st in saved["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(loaded["state"][i][k], v, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [({"state_bits": 4}, "state_bits must be one of"), ({"amsgrad": True, "state_bits": 8}, "amsgrad")],
)
def test_bad_state_bits(kwargs, match):
    with pytest.raises(ValueError, match=match):
        vo.AdamW([torch.nn.Parameter(torch.zeros(4096))], **kwargs)


def _muon_8bit(steps):
    g = torch.Generator().manual_seed(9)
    mats = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(64, 96), (96, 64), (5, 7)]]
    emb = torch.nn.Parameter(torch.randn(40, 128, generator=g))
    opt = vo.Muon([{"params": mats}, {"params": [emb], "use_muon": False}], lr=0.02, state_bits=8)
    for t in range(steps):
        gg = torch.Generator().manual_seed(200 + t)
        for p in [*mats, emb]:
            p.grad = torch.randn(p.shape, generator=gg).bfloat16().float()
        opt.step()
    kinds = sorted({seg.tier for seg in opt.segments})
    return opt.state_dict(), [p.detach().clone() for p in [*mats, emb]], kinds


def test_muon_8bit_momentum_is_identical_at_any_world_size(world):
    want, params, kinds = world(1).run(_muon_8bit, 3)[0]
    got, got_params, _ = world(3).run(_muon_8bit, 3)[0]
    assert kinds == ["fp32", "q8"]
    for i, st in want["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(got["state"][i][k], v, rtol=0, atol=0)
    for a, b in zip(got_params, params):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-4)  # bf16 Newton-Schulz batching
    assert set(want["state"][0]) == {"step", "momentum_buffer"}
    assert set(want["state"][3]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("state_bits", [16, 8])
def test_tensors_under_4096_elements_keep_fp32_moments(state_bits):
    """The cut-off is part of the state format (it decides what a checkpoint holds)."""
    small, large = torch.nn.Parameter(torch.zeros(4095)), torch.nn.Parameter(torch.zeros(64, 64))
    fp32 = 2 * 4 * 4095  # two fp32 moments over the parameter's elements
    assert vo.AdamW([small], state_bits=state_bits).local_state_bytes() == fp32
    per_element = 2 * 2 if state_bits == 16 else 2 * (1 + 4 / 256)  # codes + one fp32 scale per block
    assert vo.AdamW([large], state_bits=state_bits).local_state_bytes() == per_element * 4096


def _float64_low_bit_refused(state_bits):
    with pytest.raises(ValueError, match=r"#0 of param group 0 \(shape \(4096,\)\) is float64"):
        vo.AdamW([torch.nn.Parameter(torch.zeros(4096, dtype=torch.float64))], state_bits=state_bits)


@pytest.mark.parametrize("state_bits", [16, 8])
def test_float64_parameters_refuse_low_bit_state(world, state_bits):
    _float64_low_bit_refused(state_bits)
    world(2).run(_float64_low_bit_refused, state_bits, timeout=60)
