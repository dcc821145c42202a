"""State tiers are codecs a segment holds: the optimizers, the base and the state dicts name no
tier; each codec round-trips its state; step statistics are each optimizer's own; the step's
phase across segments runs once a step, and Muon plans its matrices at construction only."""

import ast
from pathlib import Path

import pytest
import torch

import vescale_optim as vo
from vescale_optim.kernels import dequantize_blockwise, quantize_blockwise
from vescale_optim.optim import _muon_setup, _step_stats, state_tiers
from vescale_optim.units.segment import FROZEN, StateSpec

OPTIM = Path(vo.__file__).resolve().parent / "optim"
TIERS = {state_tiers.FP32.tier, state_tiers.BF16.tier, state_tiers.Q8.tier}


def tier_names(source: str) -> list[tuple[int, str]]:
    """`(line, literal)` of every string literal in `source` that is a tier's name."""
    return [
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and node.value in TIERS
    ]


def test_the_tier_names_are_the_ones_this_test_looks_for():
    assert sorted(TIERS) == ["bf16", "fp32", "q8"]
    assert tier_names('if kind == "q8":\n    x = {"bf16": 1}\n') == [(1, "q8"), (2, "bf16")]  # it can fail
    assert tier_names('"""bf16 moments"""\nx = "fp32 state"\n') == []  # prose is not a name


def test_no_optimizer_module_names_a_tier_outside_the_codecs():
    found = {path.name: tier_names(path.read_text()) for path in sorted(OPTIM.glob("*.py"))}
    assert "base.py" in found and "adamw.py" in found and "state_dict.py" in found
    assert found.pop("state_tiers.py"), "the codec definitions name their tiers"
    assert {name: hits for name, hits in found.items() if hits} == {}


@pytest.mark.parametrize("codec", [state_tiers.FP32, state_tiers.BF16, state_tiers.Q8], ids=lambda c: c.tier)
@pytest.mark.parametrize("sqrt", [False, True])
def test_a_codec_round_trips_within_its_precision(codec, sqrt):
    spec, n = StateSpec("v", stored_as_sqrt=sqrt), 3 * state_tiers.BLOCK + 17
    x = torch.rand(n, generator=torch.Generator().manual_seed(0)) + 0.5
    state = codec.allocate([spec], n, torch.device("cpu"), torch.float32)
    assert not codec.decode(state, spec).any()
    codec.encode_(state, spec, x.clone())
    got = codec.decode(state, spec)
    tol = {True: 0, False: 1e-2}[codec.exact] if codec.block is None else 2e-2
    torch.testing.assert_close(got, x, rtol=tol, atol=tol)
    stored = {t.data_ptr() for t in state.values()}
    assert (codec.decode(state, spec).data_ptr() in stored) == codec.exact  # exact: the state itself
    for start, stop in ((0, n), (5, 300), (state_tiers.BLOCK, 2 * state_tiers.BLOCK + 3), (n - 4, n)):
        assert torch.equal(codec.decode_range(state, spec, start, stop), got[start:stop])


def test_an_8_bit_codec_stores_a_square_root_spec_as_its_root():
    plain, root, n = StateSpec("m"), StateSpec("v", stored_as_sqrt=True), state_tiers.BLOCK
    x = torch.linspace(0, 4, n)
    state = state_tiers.Q8.allocate([plain, root], n, torch.device("cpu"), torch.float32)
    state_tiers.Q8.encode_(state, root, x)
    codes, scales = state_tiers.Q8.parts(state, "v")
    want_codes, want_scales = quantize_blockwise(x.sqrt(), state_tiers.BLOCK)
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)
    assert torch.equal(state_tiers.Q8.decode(state, root), dequantize_blockwise(codes, scales, n).square())
    assert not state_tiers.Q8.parts(state, "m")[0].any()  # each spec its own codes


def test_tiers_by_size_and_state_bits():
    small, large = torch.zeros(state_tiers.QUANT_MIN_NUMEL - 1), torch.zeros(state_tiers.QUANT_MIN_NUMEL)
    assert [state_tiers.codec_for(small, b) for b in state_tiers.STATE_BITS] == [state_tiers.FP32] * 3
    tiers = [state_tiers.FP32, state_tiers.BF16, state_tiers.Q8]
    assert [state_tiers.codec_for(large, b) for b in state_tiers.STATE_BITS] == tiers
    assert state_tiers.codec_of(FROZEN) is state_tiers.FP32
    assert state_tiers.Q8.granule(torch.zeros(3 * state_tiers.BLOCK), 7) == state_tiers.BLOCK
    block = state_tiers.BLOCK
    assert state_tiers.Q8.granule(torch.zeros(block + 1), 7) == block + 1  # whole on one rank
    assert state_tiers.FP32.granule(large, 7) == state_tiers.BF16.granule(large, 7) == 7


@pytest.mark.parametrize("state_bits", [32, 16, 8])
def test_a_segment_reads_and_writes_state_through_its_codec(state_bits):
    model = torch.nn.Linear(128, 64)
    opt = vo.AdamW(model.parameters(), lr=1e-2, state_bits=state_bits)
    model(torch.randn(8, 128)).square().mean().backward()
    opt.step()
    sd = opt.state_dict()["state"]
    seg = next(s for s in opt.segments if s.params[0] is model.weight)
    lo, hi = seg.local_range(0)
    for name in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(seg.read(name)[lo:hi].view(64, 128), sd[0][name], rtol=0, atol=0)
    v = seg.read("exp_avg_sq") * 4
    seg.store("exp_avg_sq", v)
    assert (seg.read("exp_avg_sq") - v).abs().max() <= 0.01 * v.abs().max()  # 8-bit: to its block's max


def test_each_optimizer_counts_its_own_step_stats_and_all_report_the_same_keys():
    assert vo.AdamW.step_stat_names == ()
    assert vo.Muon.step_stat_names == ("ns_matrices", "ns_flops")
    assert vo.Shampoo.step_stat_names == ("roots",)
    assert vo.SOAP.step_stat_names == ("bases", "kept_bases")
    keys = ["ns_matrices", "ns_flops", "roots", "bases", "kept_bases", *_step_stats.COMMON]
    for cls in (vo.AdamW, vo.Muon, vo.Shampoo, vo.SOAP):
        assert list(cls([torch.nn.Parameter(torch.randn(8, 8))]).step_stats) == keys
    assert _step_stats.COMMON == ("bytes_sent", "bytes_received", "gather_bytes", "reduce_bytes")


def test_the_step_phase_runs_once_a_step_after_every_segment_update():
    calls = []

    class Logged(vo.AdamW):
        def _update(self, seg, grads):
            calls.append(("update", seg))
            return super()._update(seg, grads)

        def _step_phase(self, segments):
            calls.append(("phase", list(segments)))
            return []

    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    opt = Logged([*a.parameters(), *b.parameters()], bucket_cap_numel=1)
    a(torch.randn(2, 4)).sum().backward()  # b gets no gradient: its segments do not step
    opt.step()
    stepping = [seg for seg in opt.segments if seg.any_active]
    assert stepping and len(stepping) < len(opt.segments)
    assert calls == [*[("update", seg) for seg in stepping], ("phase", stepping)]


def test_muon_plans_at_construction_only(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(32, 8, bias=False))
    opt = vo.Muon(model.parameters(), lr=0.02)

    def refused(*args, **kwargs):
        raise AssertionError("planned during a step")

    for name in ("plan_matrices", "plan_owners", "matrix_work", "spread_homes", "keep_homes"):
        monkeypatch.setattr(_muon_setup, name, refused)
    for _ in range(2):
        model(torch.randn(4, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert opt.step_stats["ns_matrices"] == 2
