"""The kernels' numerical stages of `benchmarks/gpu_check.py`: batch invariance of
Shampoo's tile math and Newton-Schulz, NaN/Inf through the 8-bit kernels, large shapes (Newton-Schulz
at Muon's and Polar Express's coefficients)."""

from __future__ import annotations

import itertools
import json
import math
import time
from pathlib import Path

from benchmarks._gpu_common import EPS32, NEEDS_CUDA, SIZES, _torch
from benchmarks._gpu_stages import Result

# Muon's default triple (the checks keep their names) and Polar Express: five triples of their own,
# the input over 1.02 ||X||_F (`vescale_optim.kernels.newton_schulz.POLAR_EXPRESS`).
NS_COEFFICIENTS = {"newton_schulz": (3.4445, -4.775, 2.0315), "newton_schulz.polar_express": "polar_express"}


# --- batch invariance -----------------------------------------------------------------------------


def _rel(a, b) -> float:
    """||a - b||_F / ||b||_F, in float64 (float32 for tensors of over 2^24 elements)."""
    dtype = _torch().float64 if a.numel() <= 1 << 24 else _torch().float32
    a, b = a.to(dtype), b.to(dtype)
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _bf16_ulps(a, b) -> float:
    """The largest elementwise |a - b| in bf16 ulps of b (ulp of |b| clamped at 2^-126)."""
    torch = _torch()
    e = b.float()
    ulp = torch.exp2(torch.floor(torch.log2(e.abs().clamp(min=2.0**-126))) - 7)
    return float(((a.float() - e).abs() / ulp).max())


def stage_batch_invariance(r: Result, *, out: Path, mode: str) -> None:
    """Tile 0 computed alone (K=1) and in a stack of 8 (K=8).

    Shampoo (fp32): factors after 4 `update_factors_` steps, `inverse_roots_`, `precondition`.
    Bounds, relative Frobenius: factors d*eps (a length-d fp32 dot product's error bound);
    roots (1/2) d eps kappa per factor (eigh's backward error ~ d eps, amplified by the
    inverse fourth root's relative condition kappa/4, for either of the two computations;
    kappa = the factor's lambda_max/lambda_min, measured in fp64); the direction: both roots'
    bounds + 2 d eps (two products). On CUDA cuSOLVER may take a batched Jacobi solver for
    small stacks and a per-matrix one alone: the bound allows it; bitwise equality is reported.
    newton_schulz (bf16, at Muon's and at Polar Express's coefficients): 1 bf16 ulp per element,
    the kernel tests' bar between two different implementations (tests/kernels/test_kernels_ns.py),
    which one implementation at two batch sizes must meet.
    """
    torch = _torch()
    # Shampoo's tile math has no public entry point (vo.Shampoo runs it inside step()): this stage
    # validates the internal kernels themselves, the one private import of the benchmarks.
    from benchmarks import _gpu_models as gm
    from vescale_optim.kernels import newton_schulz
    from vescale_optim.optim._shampoo_math import inverse_roots_, precondition, update_factors_

    dev, sz = gm.device_for(mode), SIZES[mode]
    rows = []
    beta2, epsilon, k = 0.999, 1e-12, 8
    for d in sz["shampoo_dims"]:
        g = torch.Generator(device="cpu").manual_seed(d)
        grads = torch.randn(4, k, d, d, generator=g).to(dev)
        mhat, graft = torch.randn(2, k, d, d, generator=g).to(dev).unbind(0)
        res = {}
        for kk in (1, k):
            left = torch.zeros(kk, d, d, device=dev)
            right = torch.zeros_like(left)
            for t in range(4):
                update_factors_(left, right, grads[t, :kk], beta2)
            lroot, rroot = torch.zeros_like(left), torch.zeros_like(left)
            kept = inverse_roots_(lroot, left, step=4, beta2=beta2, epsilon=epsilon, dtype=torch.float32)
            kept += inverse_roots_(rroot, right, step=4, beta2=beta2, epsilon=epsilon, dtype=torch.float32)
            direction = precondition(lroot, mhat[:kk], rroot, graft[:kk])
            res[kk] = dict(L=left[0], R=right[0], L_root=lroot[0], R_root=rroot[0], direction=direction[0])
            res[kk]["kept"] = kept
        kappa = {}
        for f in ("L", "R"):
            lam = torch.linalg.eigvalsh(res[k][f].double())
            kappa[f] = float(lam.max() / lam.min().clamp_min(1e-300))
        bound = {"L": d * EPS32, "R": d * EPS32, "L_root": 0.5 * d * EPS32 * kappa["L"]}
        bound["R_root"] = 0.5 * d * EPS32 * kappa["R"]
        bound["direction"] = bound["L_root"] + bound["R_root"] + 2 * d * EPS32
        for name in ("L", "R", "L_root", "R_root", "direction"):
            a, b = res[1][name], res[k][name]
            rel, bitwise = _rel(a, b), bool(torch.equal(a, b))
            diff = float((a - b).abs().max())
            rows.append(dict(op=f"shampoo.{name}", d=d, rel_diff=rel, max_abs_diff=diff, bitwise=bitwise))
            rows[-1]["bound"] = bound[name]
            what = f"bitwise {'equal' if bitwise else 'different'}"
            what += f"; kappa {kappa[name[0]]:.3g}" if "root" in name else ""
            r.check(f"shampoo.d{d}.{name}", rel <= bound[name], measured=rel, bound=bound[name], detail=what)
        kept = [res[1]["kept"], res[k]["kept"]]
        r.check(f"shampoo.d{d}.no kept roots", kept == [0, 0], measured=kept, bound=0)
    m, n = sz["ns_shape"]
    x = torch.randn(k, m, n, generator=torch.Generator().manual_seed(5)).to(dev)
    for (name, coefficients), backend in itertools.product(NS_COEFFICIENTS.items(), ("triton", "torch")):
        alone = newton_schulz(x[:1], coefficients=coefficients, backend=backend)[0]
        batched = newton_schulz(x, coefficients=coefficients, backend=backend)[0]
        ulps, bitwise = _bf16_ulps(alone, batched), bool(torch.equal(alone, batched))
        diff = float((alone.float() - batched.float()).abs().max())
        rows.append(dict(op=f"{name}.{backend}", shape=f"{m}x{n}", max_ulps=ulps, max_abs_diff=diff))
        rows[-1]["bitwise"] = bitwise
        what = f"bf16 ulps, {m}x{n} alone vs in {k}; bitwise {'equal' if bitwise else 'different'}"
        what += "" if dev.type == "cuda" or backend == "torch" else " (Triton interpreter)"
        r.check(f"{name}.{backend}", ulps <= 1, measured=ulps, bound=1, detail=what)
    r.measure(rows=rows, device=str(dev))
    print(json.dumps(rows, indent=1))


# --- nan ------------------------------------------------------------------------------------------


def _same(a, b) -> tuple[bool, int]:
    """(equal, with NaN where NaN; how many elements differ)."""
    torch = _torch()
    if a.shape != b.shape:
        return False, -1
    if a.is_floating_point():
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        differ = (nan_a != nan_b) | (~nan_a & ~nan_b & (a != b))
    else:
        differ = a != b
    count = int(differ.sum())
    return count == 0, count


def _close(a, b, rtol: float, atol: float) -> dict:
    """Non-finite positions (NaN, +Inf, -Inf) must match exactly; finite values within tolerance."""
    torch = _torch()
    nonfinite = {
        name: int((f(a) != f(b)).sum())
        for name, f in (("nan", torch.isnan), ("posinf", torch.isposinf), ("neginf", torch.isneginf))
    }
    both = torch.isfinite(a) & torch.isfinite(b)
    diff = (a[both].double() - b[both].double()).abs()
    outside = int((diff > atol + rtol * b[both].double().abs()).sum())
    largest = float(diff.max()) if diff.numel() else 0.0
    return dict(nonfinite_positions_differ=nonfinite, outside_tolerance=outside, max_abs_diff=largest)


def stage_nan(r: Result, *, out: Path, mode: str) -> None:
    """NaN, +Inf and -Inf, alone in a block and together with finite values, through
    quantize_blockwise, dequantize_blockwise and adamw8bit_update_ (in the gradient and in the
    parameter), Triton against the torch reference. Bounds, those of tests/kernels/test_kernels_quant.py
    for the two backends: quantize and dequantize equal element for element (NaN = NaN); the
    8-bit update: the same non-finite positions, finite parameters within rtol 1e-6 + atol 1e-7,
    scales within rtol 1e-5, codes at most 1 apart in under 1% of the elements, and equal codes
    wherever the gradient was not finite."""
    torch = _torch()
    from benchmarks import _gpu_models as gm
    from vescale_optim.kernels import adamw8bit_update_, dequantize_blockwise, quantize_blockwise

    dev, n, bs = gm.device_for(mode), SIZES[mode]["nan_n"], 256
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, generator=g)
    poison = {5: math.nan, 300: math.inf, 301: -math.inf, 700: math.nan, 701: math.inf, n - 1: math.nan}
    for i, v in poison.items():
        x[i] = v
    x[3 * bs : 4 * bs] = math.nan  # a block of NaN only
    x[4 * bs : 5 * bs] = math.inf  # a block of +Inf only
    x = x.to(dev)
    bad = ~torch.isfinite(x)
    found = {}
    out_q = {b: quantize_blockwise(x, bs, backend=b) for b in ("triton", "torch")}
    for i, name in enumerate(("codes", "scales")):
        ok, count = _same(out_q["triton"][i], out_q["torch"][i])
        found[f"quantize.{name}"] = count
        r.check(f"quantize.{name}", ok, measured=count, bound=0, detail="elements that differ (NaN = NaN)")
    q, s = out_q["torch"]
    deq = {b: dequantize_blockwise(q, s, bs, backend=b) for b in ("triton", "torch")}
    ok, count = _same(deq["triton"], deq["torch"])
    found["dequantize"] = count
    r.check("dequantize", ok, measured=count, bound=0, detail=f"{int(torch.isnan(deq['torch']).sum())} NaN")
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=3, block_size=bs)
    p0 = torch.randn(n, generator=g)
    p0[9], p0[2 * bs + 1] = math.nan, math.inf
    p0 = p0.to(dev)
    clean = torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
    qm, sm = quantize_blockwise(0.1 * clean, bs)
    qv, sv = quantize_blockwise(0.1 * clean.abs(), bs)
    states = {}
    for b in ("triton", "torch"):
        state = [p0.clone(), x, qm.clone(), sm.clone(), qv.clone(), sv.clone()]
        adamw8bit_update_(*state, backend=b, **hyper)
        states[b] = state
    (p_t, _, qm_t, sm_t, qv_t, sv_t), (p_r, _, qm_r, sm_r, qv_r, sv_r) = states["triton"], states["torch"]
    for name, a, b, rtol, atol in (
        ("param", p_t, p_r, 1e-6, 1e-7),
        ("exp_avg.scales", sm_t, sm_r, 1e-5, 0.0),
        ("exp_avg_sq.scales", sv_t, sv_r, 1e-5, 0.0),
    ):
        c = _close(a, b, rtol, atol)
        found[f"adamw8bit.{name}"] = c
        ok = not any(c["nonfinite_positions_differ"].values()) and not c["outside_tolerance"]
        bound = f"same non-finite positions; rtol {rtol:g}, atol {atol:g}"
        r.check(f"adamw8bit.{name}", ok, measured=c, bound=bound)
    for name, a, b in (("exp_avg.codes", qm_t, qm_r), ("exp_avg_sq.codes", qv_t, qv_r)):
        apart = (a.int() - b.int()).abs()
        c = dict(max_apart=int(apart.max()), fraction_apart=float((apart > 0).float().mean()))
        c["apart_where_grad_not_finite"] = int((apart[bad] > 0).sum())
        found[f"adamw8bit.{name}"] = c
        ok = c["max_apart"] <= 1 and c["fraction_apart"] < 0.01 and c["apart_where_grad_not_finite"] == 0
        bound = "<= 1 apart in < 1%, equal where the gradient is not finite"
        r.check(f"adamw8bit.{name}", ok, measured=c, bound=bound)
    nan_param = int(torch.isnan(p_r).sum())
    triton = "compiled" if dev.type == "cuda" else "interpreter"
    r.measure(n=n, block_size=bs, poisoned=int(bad.sum()), found=found, nan_in_updated_param=nan_param)
    r.measure(triton=triton)


# --- large shapes ---------------------------------------------------------------------------------


def stage_large_shapes(r: Result, *, out: Path, mode: str) -> None:
    """Newton-Schulz of a Llama-70B-sized MLP matrix (8192 x 28672) and a GPT-OSS-like expert
    stack (32 x 2880 x 5760) in bf16, and quantize / dequantize of more than 2^31 elements
    (int32 indexing would overflow), Triton against the torch reference.

    Newton-Schulz runs twice, at Muon's coefficients and at Polar Express's (five triples of their
    own, the input over 1.02 ||X||_F: the per-iteration path of the Triton kernel), each with these
    bounds. Newton-Schulz bound: relative Frobenius difference <= 2^-5. Each of the 5 iterations
    rounds A, B and X to bf16 (relative 2^-8 per ulp); two implementations whose fp32
    accumulations differ in order may round any element one ulp apart, which over 15 roundings
    adds up to about sqrt(15) * 2^-8 = 0.015 in quadrature; the bound leaves 2x. Both outputs
    must be finite and orthogonalised (mean squared singular value ||X||_F^2 / min(m, n) in
    [0.5, 1.5]; Muon's coefficients put singular values in about [0.7, 1.2]).
    Quantization: codes, scales and dequantized values equal (the two compute the same
    function: `tests/kernels/test_kernels_quant.py`).
    """
    torch = _torch()
    from benchmarks import _gpu_models as gm
    from vescale_optim.kernels import dequantize_blockwise, newton_schulz, quantize_blockwise

    dev, sz = gm.device_for(mode), SIZES[mode]
    cuda = dev.type == "cuda"
    rows = []
    for shape in sz["big_ns"]:
        gen = torch.Generator(dev).manual_seed(3)
        x = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=gen)
        for name, coefficients in NS_COEFFICIENTS.items():
            rows.append(_big_newton_schulz(r, x, name, coefficients, newton_schulz, dev))
        del x
        if cuda:
            torch.cuda.empty_cache()
    n = sz["big_quant"]
    need = 14 * n  # bytes at the peak: codes n, dequantized 4n + 4n, the reference's 4n, comparisons
    free = torch.cuda.mem_get_info(dev)[0] if cuda else None
    if cuda and free < need * 1.15:
        r.skip("quantize.2^31", f"needs about {need / 2**30:.0f} GiB free, {free / 2**30:.0f} GiB are")
    else:
        rows.append(_big_quantize(r, n, dev, quantize_blockwise, dequantize_blockwise, cuda))
    if not cuda:
        big = (1 << 31) + (1 << 20)
        what = f"{big:,} elements ({14 * big / 2**30:.0f} GiB of device memory); rehearsed at {n:,} elements"
        r.skip("quantize.2^31", f"{NEEDS_CUDA}: {what} in the interpreter")
    r.measure(rows=rows, device=str(dev))
    print(json.dumps(rows, indent=1, default=str))


def _big_newton_schulz(r: Result, x, name: str, coefficients, newton_schulz, dev) -> dict:
    """One coefficient schedule on `x`, Triton against torch: the bounds of `stage_large_shapes`."""
    torch = _torch()
    from benchmarks import _gpu_models as gm

    shape, cuda = tuple(x.shape), dev.type == "cuda"
    label = "x".join(map(str, shape))
    outs, seconds = {}, {}
    for backend in ("triton", "torch"):
        for call in ("first", "second"):  # the first compiles the Triton kernels for this shape
            outs.pop(backend, None)
            gm.synchronize(dev)
            t0 = time.perf_counter()
            outs[backend] = newton_schulz(x, coefficients=coefficients, backend=backend)
            gm.synchronize(dev)
            seconds[f"{backend} {call}"] = round(time.perf_counter() - t0, 4)
    rel = _rel(outs["triton"], outs["torch"])
    msv = {b: float(o.float().square().sum()) / (o.numel() // max(shape[-2:])) for b, o in outs.items()}
    finite = all(bool(torch.isfinite(o).all()) for o in outs.values())
    what = f"relative Frobenius, Triton vs torch; Triton {seconds['triton second']:.3f} s, torch "
    what += f"{seconds['torch second']:.3f} s (warm)" + ("" if cuda else " (interpreter; CPU sizes)")
    r.check(f"{name}.{label}", finite and rel <= 2.0**-5, measured=rel, bound=2.0**-5, detail=what)
    ok, what = all(0.5 <= v <= 1.5 for v in msv.values()), "||X||_F^2 / min(m, n) per backend"
    r.check(f"{name}.{label}.orthogonalised", ok, measured=msv, bound=[0.5, 1.5], detail=what)
    return dict(op=name, shape=label, rel_diff=rel, mean_sq_singular=msv, finite=finite, seconds=seconds)


def _big_quantize(r: Result, n: int, dev, quantize_blockwise, dequantize_blockwise, cuda: bool) -> dict:
    torch = _torch()
    from benchmarks import _gpu_models as gm

    bs = 256
    label = "2^31" if n > 2**31 else str(n)
    x = torch.randn(n, device=dev, generator=torch.Generator(dev).manual_seed(4))
    x[-1], x[n // 2] = 1e30, -1e-30  # something in the last block, beyond 2^31 on CUDA
    t0 = time.perf_counter()
    q_t, s_t = quantize_blockwise(x, bs, backend="triton")
    gm.synchronize(dev)
    t_triton = time.perf_counter() - t0
    q_r, s_r = quantize_blockwise(x, bs, backend="torch")
    del x
    tail = n - (1 << 31) if n > (1 << 31) else n // 4
    codes_ok, codes_diff = _same(q_t, q_r)
    tail_ok, tail_diff = _same(q_t[-tail:], q_r[-tail:])
    scales_ok, scales_diff = _same(s_t, s_r)
    del q_r, s_r
    if cuda:
        torch.cuda.empty_cache()
    d_t = dequantize_blockwise(q_t, s_t, bs, backend="triton")
    d_r = dequantize_blockwise(q_t, s_t, bs, backend="torch")
    deq_ok, deq_diff = _same(d_t, d_r)
    del d_t, d_r, q_t, s_t
    if cuda:
        torch.cuda.empty_cache()
    what = f"{n:,} elements; {tail_diff} differ in the last {tail:,}; Triton {t_triton:.3f} s"
    r.check(f"quantize.{label}.codes", codes_ok, measured=codes_diff, bound=0, detail=what)
    what = f"codes of the last {tail:,} elements" + (" (beyond 2^31)" if n > 2**31 else "")
    r.check(f"quantize.{label}.tail", tail_ok, measured=tail_diff, bound=0, detail=what)
    r.check(f"quantize.{label}.scales", scales_ok, measured=scales_diff, bound=0)
    r.check(f"dequantize.{label}", deq_ok, measured=deq_diff, bound=0)
    row = dict(op="quantize", n=n, codes_differ=codes_diff, scales_differ=scales_diff)
    return row | dict(dequant_differ=deq_diff, triton_quantize_s=t_triton)
