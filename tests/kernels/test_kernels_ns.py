"""Newton–Schulz: torch reference vs a torch.optim.Muon step, Triton kernels vs torch reference.

Triton runs in the interpreter here (conftest sets TRITON_INTERPRET=1), so the Triton
cases are small; ``block=16`` forces several tiles on them to exercise the masks, the
upper-triangular tile table and the mirrored stores. With ``TRITON_INTERPRET=0`` on a
machine with a GPU the same cases run compiled on CUDA, against the same CPU reference.

Tolerances follow from the arithmetic, so they hold compiled as well as interpreted: each
launch is one fp32-accumulated product (plus epilogue) rounded once to bf16, so it is
compared with the exact value within the fp32 summation bound and half a bf16 ulp
(``assert_one_rounding``), launch by launch; the whole iteration only normwise, since
it amplifies any one rounding that falls the other way (see
``test_triton_matches_torch``).
"""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from vescale_optim.kernels import _ns_triton, newton_schulz
from vescale_optim.kernels._dispatch import resolve_backend
from vescale_optim.kernels._triton_common import Launch
from vescale_optim.kernels.newton_schulz import POLAR_EXPRESS, as_stack

COEFFS = (3.4445, -4.775, 2.0315)
DEVICE = torch.device("cpu" if _ns_triton.INTERPRET else "cuda")
needs_triton_device = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="TRITON_INTERPRET=0 needs a GPU"
)

LR = 0.5


def _muon_step(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The parameter after one public ``torch.optim.Muon`` step from zero with gradient ``x``
    (momentum 0, no Nesterov, no weight decay): ``-lr' * NS(x)`` in fp32, NS(x) in bf16."""
    param = torch.nn.Parameter(torch.zeros(x.shape))
    param.grad = x.float().clone()  # Muon's iteration starts from the gradient in bf16
    opt = torch.optim.Muon(
        [param],
        lr=LR,
        weight_decay=0.0,
        momentum=0.0,
        nesterov=False,
        ns_coefficients=COEFFS,
        eps=1e-7,
        ns_steps=steps,
    )
    opt.step()
    return param.detach()


def _as_muon_step(update: torch.Tensor) -> torch.Tensor:
    """What that step leaves for an orthogonalized ``update`` (m x n): torch's default
    adjust_lr_fn ("original", torch.optim.Muon's docs) makes ``lr' = lr * sqrt(max(1, m/n))``,
    added once in fp32 to the zero parameter. Distinct bf16 updates give distinct fp32
    products, so comparing these bit for bit compares the updates bit for bit."""
    m, n = update.shape
    return torch.zeros(m, n).add_(update, alpha=-LR * math.sqrt(max(1, m / n)))


U = 2.0**-24
"""fp32 unit roundoff."""


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers (8 significant bits) at ``|x|``."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp(min=2.0**-126))) - 7)


def assert_one_rounding(actual: torch.Tensor, exact: torch.Tensor, terms: torch.Tensor, k: int) -> None:
    """``actual`` (bf16) is ``exact`` (float64) summed in fp32 and rounded once to bf16.

    ``exact`` is a sum of ``k`` products of bf16 numbers (exact in fp32) plus an epilogue
    of at most three fp32 operations; ``terms`` is the same sum of absolute values. Summed in
    fp32 in any order, it errs by at most ``(k + 2) U terms`` (recursive summation); tensor
    cores may truncate instead of rounding inside the sum, so twice that; rounding to bf16
    adds at most half an ulp of the result.
    """
    assert actual.dtype == torch.bfloat16 and actual.shape == exact.shape
    err = (actual.double() - exact).abs()
    bound = 0.5 * _bf16_ulp(actual.double()) + 2 * (k + 2) * U * terms
    bad = err > bound
    assert not bad.any(), f"{int(bad.sum())} elements off, worst {(err / bound).max():.2f}x the bound"


def _check_syrk(L, out, alpha=1.0, beta=0.0, C=None):
    """``out`` is one rounding of ``alpha * L Lᵀ (+ beta * C)``."""
    L = L.cpu().double()
    exact = alpha * L @ L.mT
    terms = abs(alpha) * L.abs() @ L.abs().mT
    if C is not None:
        exact, terms = exact + beta * C.cpu().double(), terms + abs(beta) * C.cpu().double().abs()
    assert_one_rounding(out.cpu(), exact, terms, L.shape[-1])


def _check_poly(B, X, out, a):
    """``out`` is one rounding of ``a * X + B X``."""
    B, X = B.cpu().double(), X.cpu().double()
    exact, terms = a * X + B @ X, abs(a) * X.abs() + B.abs() @ X.abs()
    assert_one_rounding(out.cpu(), exact, terms, B.shape[-1])


@pytest.mark.parametrize("shape", [(16, 24), (40, 8), (33, 17), (64, 64), (7, 300), (1, 5)])
def test_torch_reference_equals_muon_iteration(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    out = newton_schulz(x, backend="torch")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(_as_muon_step(out), _muon_step(x), rtol=0, atol=0)


@given(m=st.integers(1, 16), n=st.integers(1, 16), steps=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_torch_reference_equals_muon_iteration_any_shape(m, n, steps, seed):
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(seed))
    out = newton_schulz(x, steps=steps, backend="torch")
    torch.testing.assert_close(_as_muon_step(out), _muon_step(x, steps), rtol=0, atol=0)


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
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    got = torch.stack([_as_muon_step(oi) for oi in out.reshape(-1, m, n)])
    expected = torch.stack([_muon_step(xi, steps) for xi in x.reshape(-1, m, n)])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


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


TRITON_CASES = [
    ((16, 24), torch.float32, None),
    ((2, 32, 16), torch.bfloat16, None),
    ((40, 8), torch.float32, None),
    ((2, 2, 8, 12), torch.bfloat16, None),
    ((2, 24, 40), torch.float32, 16),
    ((33, 17), torch.bfloat16, 16),
]


def _triton_case(shape, dtype, block):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    return x, (5 if block is None else 2)


@needs_triton_device
@pytest.mark.parametrize("shape, dtype, block", TRITON_CASES)
def test_triton_matches_torch(shape, dtype, block):
    """The whole iteration, normwise: within 2**-5 of the reference's Frobenius norm.

    Launch by launch the kernels round where the reference does (next test), but the
    iteration is chaotic at bf16 precision: once one rounding falls the other way (a fp32
    sum in another order), the runs separate. Simulated for these inputs with fp32 sums
    off by up to their bound ``k U terms`` before each rounding, they separate by up to 1.6 %
    of the norm after five steps (0.08 % after two); 2**-5 (3.1 %) is twice that, and
    still far below what a wrong tile, coefficient or buffer does (order 1).
    """
    x, steps = _triton_case(shape, dtype, block)
    expected = newton_schulz(x, steps=steps, backend="torch")
    if block is None:
        out = newton_schulz(x.to(DEVICE), steps=steps, backend="triton")
    else:
        out = _ns_triton.newton_schulz_triton(x.to(DEVICE), steps, COEFFS, 1e-7, block=block, block_k=block)
    assert out.dtype == torch.bfloat16 and out.shape == expected.shape
    err = (out.cpu().double() - expected.double()).norm() / expected.double().norm()
    assert err <= 2**-5, err


@needs_triton_device
@pytest.mark.parametrize("shape, dtype, block", TRITON_CASES)
def test_triton_launches_round_where_torch_does(shape, dtype, block):
    """Run the plan one launch at a time: each reads what the reference iteration reads at
    that point (the normalized, zero-padded input, then the previous launches' outputs),
    and writes one rounding of the reference's operation on it (``assert_one_rounding``);
    the output is the last iterate, unpadded and transposed back, exactly."""
    x, steps = _triton_case(shape, dtype, block)
    a, b, c = COEFFS
    out, plan = _ns_triton.newton_schulz_launches(
        x.to(DEVICE), steps, COEFFS, 1e-7, block=block, block_k=block
    )
    X, tall = as_stack(x, 1e-7)
    X = X.reshape(-1, *X.shape[-2:])
    p, q = X.shape[-2:]
    X = F.pad(X, (0, -q % 16, 0, -p % 16))
    launches = [launch for launch in plan if isinstance(launch, Launch)]
    assert len(launches) == 3 * steps
    for step in range(steps):
        gram, poly2, poly = launches[3 * step : 3 * step + 3]
        assert torch.equal(gram.args[0].cpu(), X)
        gram()
        A = gram.args[2].cpu()
        _check_syrk(X, A)
        assert torch.equal(A, A.mT)
        assert poly2.args[0] is gram.args[2] and poly2.args[1] is gram.args[2]
        poly2()
        Bm = poly2.args[2].cpu()
        _check_syrk(A, Bm, alpha=c, beta=b, C=A)
        assert poly.args[0] is poly2.args[2] and torch.equal(poly.args[1].cpu(), X)
        poly()
        X_next = poly.args[2].cpu()
        _check_poly(Bm, X, X_next, a)
        X = X_next
    for launch in plan:
        if not isinstance(launch, Launch):
            launch()
    X = X[:, :p, :q]
    X = X.mT if tall else X
    assert torch.equal(out.cpu().reshape(X.shape), X)


@needs_triton_device
@pytest.mark.parametrize("shape, block", [((24, 16), 16), ((2, 16, 40), None)])
def test_triton_takes_per_step_coefficients(shape, block):
    """Polar Express through the kernels: each step launches with its own triple and the input
    is scaled by 1 / (1.02 ||X||_F); checked launch by launch (one rounding each), since the
    iteration itself amplifies one rounding that falls the other way."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    out, plan = _ns_triton.newton_schulz_launches(
        x.to(DEVICE), 1, "polar_express", 1e-7, block=block, block_k=block
    )
    X, tall = as_stack(x, 1e-7, 1.02)
    X = X.reshape(-1, *X.shape[-2:])
    p, q = X.shape[-2:]
    X = F.pad(X, (0, -q % 16, 0, -p % 16))
    launches = [launch for launch in plan if isinstance(launch, Launch)]
    assert len(launches) == 3 * len(POLAR_EXPRESS)
    for step, (a, b, c) in enumerate(POLAR_EXPRESS):
        gram, poly2, poly = launches[3 * step : 3 * step + 3]
        assert torch.equal(gram.args[0].cpu(), X)
        gram()
        A = gram.args[2].cpu()
        _check_syrk(X, A)
        poly2()
        Bm = poly2.args[2].cpu()
        _check_syrk(A, Bm, alpha=c, beta=b, C=A)
        poly()
        X_next = poly.args[2].cpu()
        _check_poly(Bm, X, X_next, a)
        X = X_next
    for launch in plan:
        if not isinstance(launch, Launch):
            launch()
    X = X[:, :p, :q]
    assert torch.equal(out.cpu().reshape((X.mT if tall else X).shape), X.mT if tall else X)


@needs_triton_device
@pytest.mark.parametrize("P, K", [(40, 24), (24, 40), (17, 33)])
def test_symmetric_kernel_matches_matmul(P, K):
    g = torch.Generator().manual_seed(P * K)
    X = torch.randn(2, P, K, generator=g).bfloat16()
    A = torch.empty(2, P, P, dtype=torch.bfloat16, device=DEVICE)
    A = _ns_triton.syrk(X.to(DEVICE), A, block=16, block_k=16).cpu()
    _check_syrk(X, A)
    assert torch.equal(A, A.mT)
    B = torch.empty_like(A, device=DEVICE)
    A_dev = A.to(DEVICE)
    B = _ns_triton.syrk(A_dev, B, alpha=COEFFS[2], beta=COEFFS[1], C=A_dev, block=16, block_k=16).cpu()
    _check_syrk(A, B, alpha=COEFFS[2], beta=COEFFS[1], C=A)
    assert torch.equal(B, B.mT)


@needs_triton_device
def test_poly_kernel_writes_transposed_output():
    g = torch.Generator().manual_seed(3)
    B = torch.randn(2, 20, 20, generator=g).bfloat16()
    X = torch.randn(2, 20, 36, generator=g).bfloat16()
    out = torch.empty(2, 36, 20, dtype=torch.bfloat16, device=DEVICE)
    _ns_triton.poly(B.to(DEVICE), X.to(DEVICE), out.mT, a=COEFFS[0], block_m=16, block_n=16, block_k=16)
    _check_poly(B, X, out.mT, COEFFS[0])


CUDA_GRID = (2**31 - 1, 65535, 65535)  # CUDA's limits on grid axes x, y, z


def _launches(x):
    _, plan = _ns_triton.newton_schulz_launches(x, 1, COEFFS, 1e-7)
    return [launch for launch in plan if isinstance(launch, Launch)]


@pytest.mark.parametrize("shape", [(70000, 16, 16), (3, 70000, 16, 24), (2**17, 32, 48), (32768, 32768)])
def test_any_batch_and_tile_count_plans_a_launchable_grid(shape):
    """A stack of more than 65535 matrices (or one matrix of more than 65535 tiles) plans
    grids CUDA can launch, with one program per tile of every matrix (planned on meta
    tensors, nothing runs)."""
    x = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    nb = x[..., 0, 0].numel()
    P, Q = sorted(x.shape[-2:])
    for launch in _launches(x):
        grid = launch.grid
        assert len(grid) <= 3 and all(0 < g <= cap for g, cap in zip(grid, CUDA_GRID)), grid
        if launch.kernel is _ns_triton._poly_kernel:
            m, n = launch.meta["BLOCK_M"], launch.meta["BLOCK_N"]
            tiles = -(-P // m) * -(-Q // n)
        else:
            t = -(-P // launch.meta["BLOCK"])
            tiles = t * (t + 1) // 2
        assert launch.grid[0] * (launch.grid[1] if len(launch.grid) > 1 else 1) == nb * tiles


def test_a_grid_cuda_cannot_launch_is_refused_when_planned():
    with pytest.raises(ValueError, match="grid"):
        Launch(_ns_triton._poly_kernel, (1, 70000), (), {})
    with pytest.raises(ValueError, match="grid"):
        Launch(_ns_triton._poly_kernel, (2**31,), (), {})


WIDE_OFFSETS = textwrap.dedent(
    """
    import sys
    import torch
    from vescale_optim.kernels import _ns_triton

    # 16 x 16 matrices whose rows are S elements apart in one buffer, so the last row
    # starts past 2**31 elements; the buffer is virtual memory but for the rows written.
    P = 16
    S = -(-(2**31) // (P - 1) // 16) * 16
    big = torch.empty((P - 1) * S + 4 * P, dtype=torch.bfloat16, device=sys.argv[1])

    def slot(i, transposed=False):
        return big.as_strided((1, P, P), (P * S, 1, S) if transposed else (P * S, S, 1), i * P)

    g = torch.Generator().manual_seed(0)
    X, B, A, A2 = slot(0), slot(1), slot(2), slot(3)
    X.copy_(torch.randn(1, P, P, generator=g))
    B.copy_(torch.randn(1, P, P, generator=g))
    _ns_triton.syrk(X, A)
    _ns_triton.syrk(A, A2, alpha=2.0315, beta=-4.775, C=A)
    Xc, Bc = X.contiguous(), B.contiguous()
    Ac = _ns_triton.syrk(Xc, torch.empty_like(Xc))
    A2c = _ns_triton.syrk(Ac, torch.empty_like(Ac), alpha=2.0315, beta=-4.775, C=Ac)
    assert torch.equal(A, Ac) and torch.equal(A2, A2c), "syrk"
    Yc = _ns_triton.poly(Bc, Xc, torch.empty_like(Xc), a=3.4445)
    Y = _ns_triton.poly(B, X, slot(3, transposed=True), a=3.4445)  # columns S elements apart
    assert torch.equal(Y, Yc), "poly"
    print("ok")
    """
)


@needs_triton_device
def test_offsets_past_two_to_the_31_elements():
    """Rows that start past 2**31 elements (the last row of a (16, 16) view whose row stride
    is 2**31 / 15) are read and written where they are: the same results as on a contiguous
    copy, bit for bit. With int32 offsets the last row's address wraps, and the process
    crashes or reads elsewhere, so it runs in a subprocess."""
    proc = subprocess.run(
        [sys.executable, "-c", WIDE_OFFSETS, DEVICE.type],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "TRITON_INTERPRET": "1" if _ns_triton.INTERPRET else "0"},
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stderr[-3000:])


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
