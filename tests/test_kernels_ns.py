"""Newton–Schulz: torch reference vs torch.optim.Muon, Triton kernels vs torch reference.

Triton runs in the interpreter here (conftest sets TRITON_INTERPRET=1), so the Triton
cases are small; ``block=16`` forces several tiles on them to exercise the masks, the
upper-triangular tile table and the mirrored stores. With ``TRITON_INTERPRET=0`` on a
machine with a GPU the same cases run compiled on CUDA, against the same CPU reference.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vescale_optim.kernels import _ns_triton, newton_schulz
from vescale_optim.kernels._dispatch import resolve_backend

COEFFS = (3.4445, -4.775, 2.0315)
DEVICE = torch.device("cpu" if _ns_triton.INTERPRET else "cuda")
needs_triton_device = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="TRITON_INTERPRET=0 needs a GPU"
)

try:
    from torch.optim._muon import _zeropower_via_newtonschulz
except ImportError:  # private: may move between torch releases
    _zeropower_via_newtonschulz = None

needs_torch_ns = pytest.mark.skipif(
    _zeropower_via_newtonschulz is None, reason="torch.optim._muon is not importable"
)


def _muon_ns(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    return _zeropower_via_newtonschulz(x, COEFFS, steps, 1e-7)


def assert_bf16_close(
    actual: torch.Tensor, expected: torch.Tensor, ulps: int = 1, atol: float = 0.0
) -> None:
    """Elementwise ``|actual - expected| <= ulps * ulp(expected) + atol`` in bf16 ulps."""
    assert actual.dtype == torch.bfloat16 and actual.shape == expected.shape
    a, e = actual.float(), expected.float()
    exponent = torch.floor(torch.log2(e.abs().clamp(min=2.0**-126)))
    ulp = torch.exp2(exponent - 7)
    err = (a - e).abs()
    bad = err > ulps * ulp + atol
    assert not bad.any(), f"{int(bad.sum())} elements off by more than {ulps} ulp, max {err.max()}"


@needs_torch_ns
@pytest.mark.parametrize("shape", [(16, 24), (40, 8), (33, 17), (64, 64), (7, 300), (1, 5)])
def test_torch_reference_equals_muon_iteration(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    torch.testing.assert_close(newton_schulz(x, backend="torch"), _muon_ns(x), rtol=0, atol=0)


@needs_torch_ns
@given(m=st.integers(1, 16), n=st.integers(1, 16), steps=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_torch_reference_equals_muon_iteration_any_shape(m, n, steps, seed):
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(seed))
    out = newton_schulz(x, steps=steps, backend="torch")
    torch.testing.assert_close(out, _muon_ns(x, steps), rtol=0, atol=0)


@needs_torch_ns
@given(
    batch=st.lists(st.integers(1, 3), min_size=1, max_size=2),
    m=st.integers(1, 16),
    n=st.integers(1, 16),
    steps=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_torch_reference_batched_equals_muon_per_matrix(batch, m, n, steps, seed):
    """A stack gives every matrix exactly torch.optim.Muon's result, whatever shares its
    batch (Muon's owners batch different matrices at different world sizes)."""
    x = torch.randn(*batch, m, n, generator=torch.Generator().manual_seed(seed))
    out = newton_schulz(x, steps=steps, backend="torch")
    expected = torch.stack([_muon_ns(xi, steps) for xi in x.reshape(-1, m, n)])
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    torch.testing.assert_close(out.reshape(-1, m, n), expected, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(12, 20), (40, 10)])
def test_torch_reference_equals_one_muon_step(shape):
    """With momentum 0, no weight decay and a zero parameter, one Muon step leaves
    ``-lr' * NS(grad)`` in the parameter (``lr' = lr * sqrt(max(1, m/n))``, made 1)."""
    m, n = shape
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    param = torch.nn.Parameter(torch.zeros(shape))
    param.grad = grad.clone()
    lr = 1.0 / max(1.0, m / n) ** 0.5
    opt = torch.optim.Muon([param], lr=lr, weight_decay=0.0, momentum=0.0, nesterov=False)
    opt.step()
    update = -param.detach()
    torch.testing.assert_close(newton_schulz(grad).float(), update, rtol=0, atol=0)


def test_orthogonalizes_well_conditioned_matrix():
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(32, 32, generator=g))
    v, _ = torch.linalg.qr(torch.randn(48, 48, generator=g))
    x = u @ torch.diag(torch.linspace(0.2, 3.0, 32)) @ v[:32]
    s = torch.linalg.svdvals(newton_schulz(x).float())
    assert s.min() > 0.6 and s.max() < 1.3


@needs_triton_device
@pytest.mark.parametrize(
    "shape, dtype, block",
    [
        ((16, 24), torch.float32, None),
        ((2, 32, 16), torch.bfloat16, None),
        ((40, 8), torch.float32, None),
        ((2, 2, 8, 12), torch.bfloat16, None),
        ((2, 24, 40), torch.float32, 16),
        ((33, 17), torch.bfloat16, 16),
    ],
)
def test_triton_matches_torch(shape, dtype, block):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    steps = 5 if block is None else 2
    expected = newton_schulz(x, steps=steps, backend="torch")
    if block is None:
        out = newton_schulz(x.to(DEVICE), steps=steps, backend="triton")
    else:
        out = _ns_triton.newton_schulz_triton(x.to(DEVICE), steps, COEFFS, 1e-7, block=block, block_k=block)
    assert_bf16_close(out.cpu(), expected)


@needs_triton_device
@pytest.mark.parametrize("P, K", [(40, 24), (24, 40), (17, 33)])
def test_symmetric_kernel_matches_matmul(P, K):
    g = torch.Generator().manual_seed(P * K)
    X = torch.randn(2, P, K, generator=g).bfloat16()
    A = torch.empty(2, P, P, dtype=torch.bfloat16, device=DEVICE)
    A = _ns_triton.syrk(X.to(DEVICE), A, block=16, block_k=16).cpu()
    assert_bf16_close(A, X @ X.mT)
    assert torch.equal(A, A.mT)
    B = torch.empty_like(A, device=DEVICE)
    A_dev = A.to(DEVICE)
    B = _ns_triton.syrk(A_dev, B, alpha=COEFFS[2], beta=COEFFS[1], C=A_dev, block=16, block_k=16).cpu()
    assert_bf16_close(B, torch.baddbmm(A, A, A, beta=COEFFS[1], alpha=COEFFS[2]))
    assert torch.equal(B, B.mT)


@needs_triton_device
def test_poly_kernel_writes_transposed_output():
    g = torch.Generator().manual_seed(3)
    B = torch.randn(2, 20, 20, generator=g).bfloat16()
    X = torch.randn(2, 20, 36, generator=g).bfloat16()
    out = torch.empty(2, 36, 20, dtype=torch.bfloat16, device=DEVICE)
    _ns_triton.poly(B.to(DEVICE), X.to(DEVICE), out.mT, a=COEFFS[0], block_m=16, block_n=16, block_k=16)
    assert_bf16_close(out.mT.cpu(), torch.baddbmm(X, B, X, beta=COEFFS[0]))


def test_non_contiguous_and_empty_inputs():
    x = torch.randn(24, 16).T
    torch.testing.assert_close(newton_schulz(x), newton_schulz(x.contiguous()), rtol=0, atol=0)
    empty = newton_schulz(torch.randn(0, 3, 4))
    assert empty.shape == (0, 3, 4) and empty.dtype == torch.bfloat16


def test_auto_picks_torch_on_cpu():
    assert resolve_backend("auto", torch.zeros(1)) == "torch"


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(_ns_triton, "INTERPRET", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        newton_schulz(torch.randn(4, 4), backend="triton")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(x=torch.randn(5)), "m, n"),
        (dict(x=torch.randn(4, 4), steps=0), "steps"),
        (dict(x=torch.randn(4, 4), steps=2.0), "steps"),
        (dict(x=torch.randn(4, 4), backend="cuda"), "backend"),
        (dict(x=torch.randn(4, 4), coefficients=(1.0, 2.0)), "coefficients"),
        (dict(x=torch.randn(4, 4), eps=0.0), "eps"),
        (dict(x=torch.ones(4, 4, dtype=torch.int64)), "floating-point"),
    ],
)
def test_bad_input_raises_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        newton_schulz(**kwargs)
