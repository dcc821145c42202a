"""Block-wise int8 quantization and the fused 8-bit AdamW update.

The torch reference is checked against its definition (error bounds, idempotence,
torch.optim.AdamW's math); the Triton kernels (interpreted, small sizes) against the
torch reference. With ``TRITON_INTERPRET=0`` on a machine with a GPU the Triton cases run
compiled on CUDA, against the same CPU reference.

Tolerances follow from the arithmetic, so they hold compiled as well as interpreted:
quantize and dequantize are exact (an exact max, correctly rounded divisions, exact
rounding and products), so they are compared bit for bit; the fused update is a chain
of fp32 operations that the compiler may contract into FMAs where torch rounds twice,
so it is compared within the error bound of that chain (``_update_tolerance``), and
quantities derived from it within what that error can move (one scale step, one code).
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from vescale_optim.kernels import (
    _quant_triton,
    adamw8bit_update_,
    dequantize_blockwise,
    quantize_blockwise,
)
from vescale_optim.kernels.quant import _dither, _quantize_rows

BLOCK_SIZES = st.sampled_from([1, 3, 32, 64, 100, 256])
FLOATS = arrays(
    np.float32,
    st.integers(0, 700),
    elements=st.floats(-(2.0**100), 2.0**100, width=32, allow_nan=False, allow_infinity=False),
)
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
U = 2.0**-24
"""fp32 unit roundoff: one correctly rounded fp32 operation errs by at most ``U`` relative."""
SCALE_STEP = 2.0**-15
"""A scale keeps 15 explicit mantissa bits (the low 8 are cleared), so neighbouring scales
are at most ``2**-15`` of their value apart: one step."""
NAN, INF = float("nan"), float("inf")
DEVICE = torch.device("cpu" if _quant_triton.INTERPRET else "cuda")
needs_triton_device = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="TRITON_INTERPRET=0 needs a GPU"
)


def _to(device, tensors):
    return [t.to(device) for t in tensors]


def _dev(backend):
    return DEVICE if backend == "triton" else torch.device("cpu")


def _per_element(scales: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    return scales.repeat_interleave(block_size)[:n]


def _state(n: int, block_size: int, seed: int = 0, backend: str = "torch"):
    """A parameter, a gradient and quantized moments as after a few AdamW steps."""
    g = torch.Generator().manual_seed(seed)
    p, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    m = 0.1 * torch.randn(n, generator=g)
    root = 0.1 * torch.rand(n, generator=g) ** 2
    qm, sm = _to("cpu", quantize_blockwise(m.to(_dev(backend)), block_size, backend))
    qv, sv = _to("cpu", quantize_blockwise(root.to(_dev(backend)), block_size, backend))
    return [p, grad, qm, sm, qv, sv]


@given(x=FLOATS, block_size=BLOCK_SIZES)
def test_error_is_at_most_half_a_step(x, block_size):
    x = torch.from_numpy(x)
    q, scales = quantize_blockwise(x, block_size)
    assert q.dtype == torch.int8 and q.shape == (x.numel(),)
    assert scales.dtype == torch.float32 and scales.numel() == math.ceil(x.numel() / block_size)
    assert (q.abs() <= 127).all()
    step = _per_element(scales, x.numel(), block_size)
    err = (x - dequantize_blockwise(q, scales, block_size)).abs()
    # Half a step, plus the rounding of y = x / s (|y| <= 128: 128 U = 2**-17 steps) and of
    # the subtraction (U of err); 1e-38 covers scales flushed to subnormals.
    assert (err <= step * (0.5 + 2**-17 + U) + 1e-38).all()


@given(x=FLOATS, block_size=BLOCK_SIZES)
def test_round_trip_is_idempotent(x, block_size):
    once = dequantize_blockwise(*quantize_blockwise(torch.from_numpy(x), block_size), block_size)
    twice = dequantize_blockwise(*quantize_blockwise(once, block_size), block_size)
    assert torch.equal(once, twice)


def test_zero_blocks_and_partial_last_block():
    x = torch.cat([torch.zeros(256), torch.linspace(-3, 5, 256), torch.zeros(10), -torch.ones(34)])
    q, scales = quantize_blockwise(x, 256)
    assert scales.shape == (3,) and scales[0] == 0 and (q[:256] == 0).all()
    # absmax / 127 with the low 8 mantissa bits cleared: at most one step below it.
    torch.testing.assert_close(scales[1:], torch.tensor([5 / 127, 1 / 127]), rtol=SCALE_STEP, atol=0)
    assert q[256:512].max() == 127 and (q[-34:] == -127).all()
    dq = dequantize_blockwise(q, scales, 256, shape=(4, 139), dtype=torch.bfloat16)
    assert dq.shape == (4, 139) and dq.dtype == torch.bfloat16
    assert (dq.reshape(-1)[:256] == 0).all()


def test_quantize_accepts_any_shape_and_dtype():
    x = torch.randn(3, 5, 7).bfloat16()
    q, s = quantize_blockwise(x, 16)
    torch.testing.assert_close(q, quantize_blockwise(x.float().reshape(-1), 16)[0], rtol=0, atol=0)
    dq = dequantize_blockwise(q, s, 16, shape=x.shape)
    assert dq.shape == x.shape and dq.dtype == torch.float32


@needs_triton_device
@pytest.mark.parametrize("n, block_size", [(1024, 256), (1000, 256), (77, 32), (300, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_quantize_matches_torch(n, block_size, dtype):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4).to(dtype)
    x[: min(n, block_size)] = 0
    q, s = _to("cpu", quantize_blockwise(x.to(DEVICE), block_size, backend="triton"))
    q_ref, s_ref = quantize_blockwise(x, block_size, backend="torch")
    # Exact, compiled too: the max is exact, both divisions correctly rounded (div_rn, and
    # IEEE division in torch), the rounding exact and q * s exact (see quant.py).
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    for out in (torch.float32, torch.bfloat16):
        dq = dequantize_blockwise(q.to(DEVICE), s.to(DEVICE), block_size, backend="triton", dtype=out)
        assert torch.equal(dq.cpu(), dequantize_blockwise(q, s, block_size, backend="torch", dtype=out))


@needs_triton_device
@settings(max_examples=20)
@given(x=FLOATS, block_size=BLOCK_SIZES)
def test_triton_quantize_matches_torch_any_input(x, block_size):
    x = torch.from_numpy(x)
    q, s = _to("cpu", quantize_blockwise(x.to(DEVICE), block_size, backend="triton"))
    q_ref, s_ref = quantize_blockwise(x, block_size, backend="torch")
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


def _specials(n: int, block_size: int, seed: int = 0) -> torch.Tensor:
    """Random values with NaN and Inf placed block by block: a NaN; +Inf; -Inf; a NaN and an
    Inf together; NaNs whose payload sits only in the low mantissa bits (clearing the
    scale's low bits must not turn them into Inf), one of them negative; then finite blocks,
    and a NaN as the last element of a partial last block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    low_nan = torch.tensor([0x7F800001, -0x007FFFFF], dtype=torch.int32).view(torch.float32)
    x[1] = NAN
    x[block_size + 1] = INF
    x[2 * block_size] = -INF
    x[3 * block_size], x[4 * block_size - 1] = INF, NAN
    x[4 * block_size : 4 * block_size + 2] = low_nan[: min(2, block_size)]
    x[-1] = NAN
    return x


INTERPRETER_NAN_WARNINGS = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
"""The interpreter computes with numpy, which warns about the NaN these tests are about."""


@needs_triton_device
@INTERPRETER_NAN_WARNINGS
@pytest.mark.parametrize("block_size", [3, 32, 100, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_quantize_propagates_nan_and_inf_like_torch(block_size, dtype):
    """A block holding a NaN gets a NaN scale and one holding an Inf an Inf scale, codes
    and round trips as the torch reference's, bit for bit (NaN for NaN): compiled, a
    NaN-dropping max would give such a block a finite scale and finite codes (see
    test_kernels_aot for the compiled instructions)."""
    x = _specials(7 * block_size + 2, block_size).to(dtype)
    q, s = _to("cpu", quantize_blockwise(x.to(DEVICE), block_size, backend="triton"))
    q_ref, s_ref = quantize_blockwise(x, block_size, backend="torch")
    assert s_ref[[0, 3, 4, -1]].isnan().all() and s_ref[[1, 2]].isinf().all()
    assert s_ref[5:-1].isfinite().all()
    assert torch.equal(q, q_ref)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0, equal_nan=True)
    for out in (torch.float32, torch.bfloat16):
        dq = dequantize_blockwise(q.to(DEVICE), s.to(DEVICE), block_size, backend="triton", dtype=out)
        dq_ref = dequantize_blockwise(q, s, block_size, backend="torch", dtype=out)
        assert dq_ref.isnan().sum() == 5 * block_size + 2  # blocks 0-4 and the last
        torch.testing.assert_close(dq.cpu(), dq_ref, rtol=0, atol=0, equal_nan=True)


@needs_triton_device
@INTERPRETER_NAN_WARNINGS
@pytest.mark.parametrize("block_size", [32, 100])
def test_triton_update_propagates_nan_and_inf_like_torch(block_size):
    """NaN and Inf in the gradient (and a NaN moment scale) reach the parameter and both
    moments' scales exactly where the torch reference puts them."""
    n = 7 * block_size + 2
    ref = _state(n, block_size, seed=block_size)
    ref[1] = _specials(n, block_size, seed=1)
    ref[5][5] = NAN  # a second-moment block whose stored scale is already NaN
    state = [t.clone() for t in ref]
    kw = dict(HYPER, step=2, block_size=block_size)
    tol = _update_tolerance(ref, **kw)
    adamw8bit_update_(*ref, backend="torch", **kw)
    assert ref[0].isnan().any() and ref[3].isnan().any() and ref[3].isinf().any()
    assert ref[5].isnan().any() and ref[0].isfinite().any()
    state = _to(DEVICE, state)
    adamw8bit_update_(*state, backend="triton", **kw)
    _assert_states_close(_to("cpu", state), ref, tol)


def _assert_within(actual: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor) -> None:
    """NaN where ``expected`` is NaN, the same infinities, and ``|actual - expected| <= tol``
    elsewhere."""
    assert torch.equal(actual.isnan(), expected.isnan()), "NaN in different places"
    special = ~expected.isfinite()
    assert torch.equal(actual[special & ~expected.isnan()], expected[special & ~expected.isnan()])
    finite = ~special
    err = (actual[finite].double() - expected[finite].double()).abs()
    bad = err > tol.expand_as(expected)[finite].double()
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} off, worst {err.max():.3e}"


def _update_tolerance(state, block_size, *, lr, beta1, beta2, eps, weight_decay, step, **_):
    """How far apart two correct fp32 evaluations of one AdamW step may put each parameter.

    Each evaluation rounds each fp32 operation once (``U`` relative), except that the
    compiler may contract ``a * b + c`` into one FMA where torch rounds twice: so each
    errs from the exact step by at most one ``U`` per operation, relative to the magnitude
    of the terms it combines (first order, the moments are exact dequantized values):

    - ``m = m0 + w1 (g - m0)``: 3 operations on terms of size ``M = |m0| + w1 |g - m0|``;
    - ``v = r0² β2 + w2 g²`` (non-negative terms): 3 deep, so ``3 U`` relative; its square
      root ``1.5 U + U``, ``denom = root / bc2 + eps`` another ``2 U``: ``4.5 U``;
    - ``u = (-step_size m) / denom``: ``2 U`` of ``|u|``, plus ``m``'s and ``denom``'s;
    - ``p = p0 decay + u``: ``U`` of ``|p0 decay|`` and ``U`` of ``|p|``.

    Two evaluations differ by at most the sum of both errors; the bound is doubled again
    to stay clear of second-order terms.
    """
    p0, grad, qm, sm, qv, sv = (t.double() for t in state)
    n = p0.numel()
    w1, w2 = 1.0 - beta1, 1.0 - beta2
    m0 = qm * _per_element(sm, n, block_size)
    r0 = qv * _per_element(sv, n, block_size)
    magnitude_m = m0.abs() + w1 * (grad - m0).abs()
    m = m0 + w1 * (grad - m0)
    denom = (r0 * r0 * beta2 + w2 * grad * grad).sqrt() / math.sqrt(1.0 - beta2**step) + eps
    scale_u = lr / (1.0 - beta1**step) / denom
    u = scale_u * m.abs()
    p_decayed = p0.abs() * (1.0 - lr * weight_decay)
    one_side = U * (p_decayed + (p_decayed + u) + 6.5 * u + 3.0 * scale_u * magnitude_m)
    return 4.0 * one_side


def _assert_states_close(state, ref, tol, max_code_diff=1):
    """``state`` and ``ref`` after the same update evaluated two ways: parameters within
    ``tol`` (``_update_tolerance``); each scale within one step of the other (a moment off
    by a few ``U`` moves its block's absmax by as much, which can cross to the next scale);
    codes within one (a code moves only where its value was that close to a rounding
    boundary: with the scale a step off, ``y`` moves by up to ``127 * 2**-15`` codes, so at
    most ``2 * 127 * 2**-15`` (0.8 %) of a block's codes move, far fewer otherwise)."""
    p, _, qm, sm, qv, sv = state
    p_ref, _, qm_ref, sm_ref, qv_ref, sv_ref = ref
    _assert_within(p, p_ref, tol)
    for s, s_ref in ((sm, sm_ref), (sv, sv_ref)):
        _assert_within(s, s_ref, SCALE_STEP * s_ref.abs())
    for q, q_ref in ((qm, qm_ref), (qv, qv_ref)):
        diff = (q.int() - q_ref.int()).abs()
        assert diff.max() <= max_code_diff and (diff > 0).float().mean() < 0.01


@needs_triton_device
@pytest.mark.parametrize("n, block_size", [(1024, 256), (1000, 256), (77, 32), (300, 100)])
@pytest.mark.parametrize("maximize", [False, True])
def test_triton_update_matches_torch(n, block_size, maximize):
    ref = _state(n, block_size, seed=n)
    state = [t.clone() for t in ref]
    state[1] = state[1].bfloat16()
    ref[1] = state[1].clone()
    kw = dict(HYPER, step=3, maximize=maximize, block_size=block_size)
    tol = _update_tolerance(ref, **kw)
    adamw8bit_update_(*ref, backend="torch", **kw)
    state = _to(DEVICE, state)
    adamw8bit_update_(*state, backend="triton", **kw)
    _assert_states_close(_to("cpu", state), ref, tol)


@needs_triton_device
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("n, block_size, step, maximize", [(1000, 256, 1, False), (300, 64, 7, True)])
def test_update_is_one_torch_adamw_step(backend, n, block_size, step, maximize):
    """Dequantize, run torch.optim.AdamW itself, requantize: the fused update agrees."""
    state = _state(n, block_size, seed=step)
    p0, grad, qm, sm, qv, sv = (t.clone() for t in state)
    param = torch.nn.Parameter(p0.clone())
    param.grad = grad.clone()
    opt = torch.optim.AdamW([param], **_adamw_kwargs(HYPER), maximize=maximize, foreach=False)
    opt.state[param] = dict(
        step=torch.tensor(float(step - 1)),
        exp_avg=dequantize_blockwise(qm, sm, block_size),
        exp_avg_sq=dequantize_blockwise(qv, sv, block_size).square(),
    )
    opt.step()
    tol = _update_tolerance(state, block_size, **HYPER, step=step)
    state = _to(_dev(backend), state)
    adamw8bit_update_(*state, **HYPER, step=step, maximize=maximize, block_size=block_size, backend=backend)
    p, _, qm_new, sm_new, qv_new, sv_new = _to("cpu", state)
    # torch.optim.AdamW runs the same chain of fp32 operations (see _update_tolerance).
    _assert_within(p, param.detach(), tol)
    m_ref, s_ref = quantize_blockwise(opt.state[param]["exp_avg"], block_size)
    _assert_within(sm_new, s_ref, SCALE_STEP * s_ref)  # see _assert_states_close
    assert (qm_new.int() - m_ref.int()).abs().max() <= 1
    root = opt.state[param]["exp_avg_sq"].sqrt()
    _, sv_ref = quantize_blockwise(root, block_size)
    _assert_within(sv_new, sv_ref, SCALE_STEP * sv_ref)
    # Stochastic rounding gives floor(y) or floor(y) + 1 of the kernel's own y, which is
    # within 127 * (2**-15 + a few U) < 2**-7 codes of the reference's y.
    y = root / _per_element(sv_ref, n, block_size)
    code = qv_new.float()
    assert ((code >= torch.floor(y - 2**-7)) & (code <= torch.floor(y + 2**-7) + 1)).all()
    assert (code[root > 0] >= 1).all()


def _adamw_kwargs(hyper):
    return dict(
        lr=hyper["lr"],
        betas=(hyper["beta1"], hyper["beta2"]),
        eps=hyper["eps"],
        weight_decay=hyper["weight_decay"],
    )


def test_second_moment_rounding_is_unbiased_and_never_zero():
    """Over many salts, stochastic rounding of sqrt(v) averages to the exact value;
    a tiny positive value next to a large one keeps code 1, not 0."""
    values = 0.05 + 0.9 * torch.rand(253, generator=torch.Generator().manual_seed(0))
    root = torch.cat([torch.tensor([1.0, 1e-6, 0.0]), values]).reshape(1, -1)
    scale = quantize_blockwise(root.reshape(-1), 256)[1]
    samples = torch.stack(
        [_quantize_rows(root, _dither(scale, 256, salt))[0][0].float() for salt in range(400)]
    )
    assert (samples[:, 1] == 1).all() and (samples[:, 2] == 0).all()
    exact = root[0] / scale
    bias = samples[:, 3:].mean(0) - exact[3:]
    assert bias.abs().max() < 4 * 0.5 / math.sqrt(400)
    assert bias.mean().abs() < 0.01


def _least_squares_curve(eight_bit: bool, steps: int = 200) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    X, W_true = torch.randn(256, 64, generator=g), torch.randn(64, 32, generator=g)
    Y = X @ W_true + 0.01 * torch.randn(256, 32, generator=g)
    hyper = dict(HYPER, weight_decay=0.01)
    W = torch.nn.Parameter(torch.zeros(64, 32))
    opt = torch.optim.AdamW([W], **_adamw_kwargs(hyper), foreach=False)
    qm, sm = quantize_blockwise(torch.zeros(W.numel()))
    qv, sv = quantize_blockwise(torch.zeros(W.numel()))
    curve = []
    with torch.no_grad():
        for step in range(1, steps + 1):
            residual = X @ W - Y
            curve.append(residual.square().mean().item())
            W.grad = X.T @ residual * (2 / residual.numel())
            if eight_bit:
                adamw8bit_update_(W.view(-1), W.grad.view(-1), qm, sm, qv, sv, **hyper, step=step)
            else:
                opt.step()
        curve.append((X @ W - Y).square().mean().item())
    return torch.tensor(curve)


def test_8bit_adamw_tracks_fp32_on_least_squares():
    """200 steps on a 64x32 least-squares problem: the 8-bit loss stays within 5 % of
    fp32 AdamW's at every step (measured: within 1.7 %, final loss 0.8 % lower)."""
    fp32, eight_bit = _least_squares_curve(False), _least_squares_curve(True)
    assert fp32[-1] < 0.05 * fp32[0]
    ratio = eight_bit / fp32
    assert (ratio - 1).abs().max() < 0.05, ratio


@needs_triton_device
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_update_does_not_depend_on_where_blocks_sit(backend):
    """Updating two block-aligned halves separately equals one update of the whole,
    as on two ranks: the stochastic rounding depends on nothing positional. Exact, also
    compiled: every operation is elementwise or an exact max within a block, so a block's
    result cannot depend on where it sits in a tile."""
    whole = _to(_dev(backend), _state(1000, 100, seed=5))
    halves = [t.clone() for t in whole]
    adamw8bit_update_(*whole, **HYPER, step=4, block_size=100, backend=backend)
    for elements, blocks in ((slice(0, 500), slice(0, 5)), (slice(500, 1000), slice(5, 10))):
        part = [t[blocks] if i in (3, 5) else t[elements] for i, t in enumerate(halves)]
        adamw8bit_update_(*part, **HYPER, step=4, block_size=100, backend=backend)
    for a, b in zip(halves, whole):
        assert torch.equal(a, b)


def test_torch_reference_works_in_chunks(monkeypatch):
    """The reference touches a bounded number of blocks at a time; chunking is invisible."""
    ref = _state(1000, 32, seed=1)
    state = [t.clone() for t in ref]
    adamw8bit_update_(*ref, **HYPER, step=2, block_size=32, backend="torch")
    monkeypatch.setattr("vescale_optim.kernels.quant._CHUNK_ELEMENTS", 96)
    adamw8bit_update_(*state, **HYPER, step=2, block_size=32, backend="torch")
    for a, b in zip(state, ref):
        assert torch.equal(a, b)


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(_quant_triton, "INTERPRET", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        quantize_blockwise(torch.randn(10), backend="triton")


def _update_with(**overrides):
    n, bs = 300, 100
    args = dict(
        zip(["param_fp32", "grad", "q_exp_avg", "s_exp_avg", "q_exp_avg_sq", "s_exp_avg_sq"], _state(n, bs))
    )
    kw = dict(HYPER, step=1, block_size=bs)
    for key, value in overrides.items():
        (args if key in args else kw)[key] = value
    adamw8bit_update_(*args.values(), **kw)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: quantize_blockwise(torch.randn(8), block_size=0), "block_size"),
        (lambda: quantize_blockwise(torch.arange(8)), "floating-point"),
        (lambda: quantize_blockwise(torch.randn(8), backend="gpu"), "backend"),
        (lambda: dequantize_blockwise(torch.zeros(8), torch.ones(1), 8), "int8"),
        (lambda: dequantize_blockwise(torch.zeros(9, dtype=torch.int8), torch.ones(1), 8), "2"),
        (
            lambda: dequantize_blockwise(torch.zeros(8, dtype=torch.int8), torch.ones(1), 8, shape=(3, 3)),
            "shape",
        ),
        (
            lambda: dequantize_blockwise(
                torch.zeros(8, dtype=torch.int8), torch.ones(1), 8, dtype=torch.int32
            ),
            "dtype",
        ),
        (lambda: _update_with(step=0), "step"),
        (lambda: _update_with(lr=-1.0), "lr"),
        (lambda: _update_with(beta2=1.0), "betas"),
        (lambda: _update_with(param_fp32=torch.zeros(300, dtype=torch.bfloat16)), "param_fp32"),
        (lambda: _update_with(grad=torch.zeros(299)), "grad"),
        (lambda: _update_with(q_exp_avg=torch.zeros(300)), "q_exp_avg"),
        (lambda: _update_with(s_exp_avg_sq=torch.zeros(4)), "s_exp_avg_sq"),
        (lambda: _update_with(block_size=64), "s_exp_avg"),
    ],
)
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
