"""Kernel throughput: Triton vs the torch reference vs ``torch.compile`` of the torch reference,
and the optimizers' step on one device (world size 1).

Kernel rows (``backend``: ``triton``, ``torch``, ``compile``): ``newton_schulz`` (5 steps at Muon's
coefficients, and at Polar Express's per-step triples), TFLOP/s counting the dense work of the torch
iteration (``p <= q``: ``2p²q + 2p³ + 2p²q`` a step; the Triton path skips the lower triangles of
the two symmetric products, so its rate on this count can exceed the tensor cores'); ``quantize``
/ ``dequantize`` / ``adamw8bit`` at 256-element blocks, GB/s counting the bytes a call must move.
``% of peak`` is against a dense bf16 rate and HBM bandwidth looked up from the device name;
``max |diff|`` against the torch path on the same input; ``first call s`` includes the JIT.

Step rows: ``vo.AdamW`` (32- and 8-bit), ``vo.Muon`` and ``vo.Shampoo`` on a stack of square
linear layers against ``torch.optim.AdamW`` / ``torch.optim.Muon`` on a copy of the same model and
data: median step time and the largest parameter difference after the same steps (8-bit AdamW and
Shampoo against fp32 AdamW, for scale only). On CPU only the torch and compile rows run, small.

    python benchmarks/kernels.py                    # medians of 5 runs
    python benchmarks/kernels.py --quick            # fewer repeats (benchmarks/gpu_check.sh)
    python benchmarks/kernels.py --no-compile --sections steps --out steps.json
"""

from __future__ import annotations

import copy
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vescale_optim as vo  # noqa: E402
from benchmarks._main import parse  # noqa: E402
from benchmarks._measure import load_average  # noqa: E402
from benchmarks._report import environment, host_line, save_json, table  # noqa: E402
from vescale_optim.kernels import (  # noqa: E402
    adamw8bit_update_,
    dequantize_blockwise,
    newton_schulz,
    quantize_blockwise,
)

# Dense bf16 tensor-core TFLOP/s and HBM TB/s by device-name substring (vendor sheets, SXM parts).
PEAKS = {"H200": (989.0, 4.8), "H100 PCIe": (756.0, 2.0), "H100": (989.0, 3.35), "H800": (989.0, 3.35)}
PEAKS.update({"A100": (312.0, 2.04), "L40S": (362.0, 0.864)})
NS_STEPS = 5
BLOCK_SIZE = 256
SLICE = 1 << 20  # elements per call of the compiled 8-bit update (a multiple of BLOCK_SIZE)
STEP_COLUMNS = ["optimizer", "params", "ms/step", "time / ref", "vs", "max |diff|", "first step s"]
COLUMNS = ["kernel", "shape", "backend", "ms", "first call s", "TFLOP/s", "GB/s", "% of peak", "max |diff|"]


def assumed_peaks(device: torch.device) -> tuple[str, float | None, float | None]:
    if device.type != "cuda":
        return "cpu", None, None
    name = torch.cuda.get_device_name(device)
    for key, (tflops, tbps) in PEAKS.items():
        if key in name:
            return name, tflops, tbps
    return name, None, None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, float]:
    """(median seconds of ``fn``, seconds of the first call, which compiles)."""
    start = time.perf_counter()
    fn()
    _sync(device)
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), first


def ns_flops(shape: tuple[int, ...]) -> float:
    *batch, m, n = shape
    p, q = min(m, n), max(m, n)
    return NS_STEPS * (4 * p * p * q + 2 * p**3) * torch.Size(batch).numel()


def update_bytes(n: int, grad_bytes: int) -> int:
    return n * (4 + 4 + grad_bytes + 2 + 2) + 2 * 2 * 4 * -(-n // BLOCK_SIZE)


def _row(kernel, shape, backend, seconds, first, peak, *, flops=None, nbytes=None, diff=None) -> dict:
    rate = flops / seconds / 1e12 if flops else nbytes / seconds / 1e9
    scale = 1.0 if flops else 1e3  # TFLOP/s vs TFLOP/s; GB/s vs TB/s
    row = {"kernel": kernel, "shape": shape, "backend": backend, "ms": seconds * 1e3, "first call s": first}
    row.update({"TFLOP/s": rate if flops else None, "GB/s": None if flops else rate})
    return {**row, "% of peak": None if peak is None else 100 * rate / (peak * scale), "max |diff|": diff}


def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


NS_KERNELS = {"newton_schulz": "muon", "newton_schulz polar_express": "polar_express"}  # row -> coefficients


def bench_newton_schulz(shapes, backends, device, repeats, peak_tflops) -> list[dict]:
    """Newton–Schulz at Muon's coefficients and at Polar Express's five per-step triples
    (its input scaled by 1/(1.02 ||X||_F)): the same dense work per step."""
    rows = []
    for kernel, coefficients in NS_KERNELS.items():
        given = {} if coefficients == "muon" else {"coefficients": coefficients}
        torch_ns = functools.partial(newton_schulz, backend="torch", **given)
        triton_ns = functools.partial(newton_schulz, backend="triton", **given)
        fns = {"triton": triton_ns, "torch": torch_ns, "compile": _compiled(torch_ns)}
        for shape in shapes:
            x = torch.randn(shape, device=device, dtype=torch.bfloat16)
            reference = torch_ns(x)
            for backend in backends:
                seconds, first = timed(functools.partial(fns[backend], x), device, repeats)
                diff = None if backend == "torch" else _max_diff(fns[backend](x), reference)
                flops, name = ns_flops(shape), "x".join(map(str, shape))
                rows.append(_row(kernel, name, backend, seconds, first, peak_tflops, flops=flops, diff=diff))
    return rows


def bench_quantization(n, backends, device, repeats, peak_tbps) -> list[dict]:
    rows = []
    x = torch.randn(n, device=device)
    q_ref, s_ref = quantize_blockwise(x, BLOCK_SIZE, backend="torch")
    dq_ref = dequantize_blockwise(q_ref, s_ref, BLOCK_SIZE, backend="torch")
    scales = 4 * -(-n // BLOCK_SIZE)
    for backend in backends:
        b = "torch" if backend == "compile" else backend
        quant = functools.partial(quantize_blockwise, block_size=BLOCK_SIZE, backend=b)
        dequant = functools.partial(dequantize_blockwise, block_size=BLOCK_SIZE, backend=b)
        if backend == "compile":
            quant, dequant = _compiled(quant), _compiled(dequant)
        seconds, first = timed(functools.partial(quant, x), device, repeats)
        diff = None if backend == "torch" else _max_diff(quant(x)[0], q_ref)
        rows.append(
            _row("quantize", str(n), backend, seconds, first, peak_tbps, nbytes=n * 5 + scales, diff=diff)
        )
        seconds, first = timed(functools.partial(dequant, q_ref, s_ref), device, repeats)
        diff = None if backend == "torch" else _max_diff(dequant(q_ref, s_ref), dq_ref)
        row = _row("dequantize", str(n), backend, seconds, first, peak_tbps, nbytes=n * 5 + scales, diff=diff)
        rows.append(row)
    return rows


def _update_state(grad: torch.Tensor) -> list[torch.Tensor]:
    g = torch.Generator(device=grad.device).manual_seed(1)
    param = torch.randn(grad.shape, generator=g, device=grad.device)
    qm, sm = quantize_blockwise(0.1 * grad, BLOCK_SIZE)
    qv, sv = quantize_blockwise(0.1 * grad.abs(), BLOCK_SIZE)
    return [param, grad, qm, sm, qv, sv]


def _sliced(update: Callable) -> Callable:
    """`update` over consecutive block-aligned slices of `SLICE` elements: compiled, one graph
    serves every slice (a block's dither does not depend on where the block sits, so the result
    is the whole shard's)."""

    def run(p, g, qm, sm, qv, sv) -> None:
        for lo in range(0, p.numel(), SLICE):
            hi = min(p.numel(), lo + SLICE)
            b0, b1 = lo // BLOCK_SIZE, -(-hi // BLOCK_SIZE)
            update(p[lo:hi], g[lo:hi], qm[lo:hi], sm[b0:b1], qv[lo:hi], sv[b0:b1])

    return run


def bench_update(n, backends, device, repeats, peak_tbps) -> list[dict]:
    """One 8-bit AdamW step per call at a fixed step count (the work does not depend on it,
    and a changing one would recompile the compiled path). The compiled torch path compiles the
    update of one `SLICE` of the shard and runs it slice by slice, as the reference chunks."""
    rows = []
    grad = torch.randn(n, device=device)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, block_size=BLOCK_SIZE, step=10)
    reference = _update_state(grad)
    adamw8bit_update_(*reference, backend="torch", **hyper)
    for backend in backends:
        if backend == "compile":
            update = _sliced(_compiled(functools.partial(adamw8bit_update_, backend="torch", **hyper)))
        else:
            update = functools.partial(adamw8bit_update_, backend=backend, **hyper)
        state = _update_state(grad)
        seconds, first = timed(functools.partial(update, *state), device, repeats)
        check = _update_state(grad)
        update(*check)
        diff = None if backend == "torch" else _max_diff(check[0], reference[0])
        nbytes = update_bytes(n, grad.element_size())
        rows.append(_row("adamw8bit", str(n), backend, seconds, first, peak_tbps, nbytes=nbytes, diff=diff))
    return rows


def _layers(width: int, depth: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(depth)]).to(device)


def _run_steps(model, opt, x, steps, device) -> list[float]:
    times = []
    for _ in range(steps):
        model(x).square().mean().backward()
        _sync(device)
        start = time.perf_counter()
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - start)
        opt.zero_grad()
    return times


def bench_steps(width, depth, device, repeats) -> list[dict]:
    """Each optimizer on its own copy of one model, the same batch every step; the first
    step (allocation, JIT) is left out of the median."""
    base = _layers(width, depth, device)
    x = torch.randn(64, width, device=device)
    kw = dict(lr=1e-3, weight_decay=0.1)
    fused = dict(fused=True) if device.type == "cuda" else dict(foreach=True)
    muon = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    cases = {
        "torch.optim.AdamW": (lambda p: torch.optim.AdamW(p, **kw, **fused), None),
        "vo.AdamW": (lambda p: vo.AdamW(p, **kw), "torch.optim.AdamW"),
        "vo.AdamW 8-bit": (lambda p: vo.AdamW(p, **kw, state_bits=8), "torch.optim.AdamW"),
        "vo.Shampoo": (lambda p: vo.Shampoo(p, **kw), "torch.optim.AdamW"),
        "torch.optim.Muon": (lambda p: torch.optim.Muon(p, **muon), None),
        "vo.Muon": (lambda p: vo.Muon(p, **muon), "torch.optim.Muon"),
    }
    finals, rows = {}, []
    for name, (make, reference) in cases.items():
        model = copy.deepcopy(base)
        times = _run_steps(model, make(model.parameters()), x, repeats + 1, device)
        finals[name] = torch.cat([p.detach().flatten() for p in model.parameters()])
        seconds = statistics.median(times[1:])
        row = {
            "optimizer": name,
            "params": finals[name].numel(),
            "ms/step": seconds * 1e3,
            "first step s": times[0],
        }
        diff = None if reference is None else _max_diff(finals[name], finals[reference])
        rows.append({**row, "vs": reference, "max |diff|": diff})
    for row in rows:
        if row["vs"]:
            ref = next(r for r in rows if r["optimizer"] == row["vs"])
            row["time / ref"] = row["ms/step"] / ref["ms/step"]
    return rows


def main(argv: list[str] | None = None) -> dict:
    args = parse(
        __doc__,
        argv,
        "3 repeats, fewer shapes, smaller step model",
        repeats=(5, "timed runs per row (median)"),
        no_compile=(False, "skip the torch.compile rows"),
        sections=dict(nargs="+", choices=["kernels", "steps"], default=["kernels", "steps"]),
        out=dict(type=Path, help="JSON path (default benchmarks/results/kernels.json)"),
    )
    repeats = 3 if args.quick else args.repeats

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name, peak_tflops, peak_tbps = assumed_peaks(device)
    torch.manual_seed(0)
    if device.type == "cuda":
        backends = ["triton", "torch"]
        shapes = [(4096, 4096), (8, 2048, 2048), (1024, 4096)] + ([] if args.quick else [(64, 128, 128)])
        n, width, depth = 1 << 28, (1024 if args.quick else 2048), 8
    else:
        backends = ["torch"]
        shapes = [(256, 256), (4, 128, 128), (128, 512)]
        n, width, depth = 1 << 20, 128, 4
    if not args.no_compile:
        backends.append("compile")

    rows, steps = [], []
    if "kernels" in args.sections:
        rows += bench_newton_schulz(shapes, backends, device, repeats, peak_tflops)
        rows += bench_quantization(n, backends, device, repeats, peak_tbps)
        rows += bench_update(n, backends, device, repeats, peak_tbps)
    if "steps" in args.sections:
        steps = bench_steps(width, depth, device, repeats)

    load = load_average()
    print(f"device: {name}; assumed peaks: bf16 {peak_tflops} TFLOP/s dense, HBM {peak_tbps} TB/s;")
    print(host_line())
    if rows:
        print(table(rows, COLUMNS))
    if steps:
        print(f"\noptimizer step, {depth} linear layers {width}x{width}, world size 1:")
        print(table(steps, STEP_COLUMNS))
    if device.type != "cuda":
        print("\nTriton rows and % of peak need a CUDA GPU: the torch path (and its compiled form) ran here.")
    result = {
        "env": environment(),
        "device": name,
        "load_average": load,
        "assumed_peak_bf16_tflops": peak_tflops,
    }
    result.update(assumed_peak_hbm_tbps=peak_tbps, ns_steps=NS_STEPS, block_size=BLOCK_SIZE, repeats=repeats)
    result.update(rows=rows, steps=steps)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
        path = args.out
    else:
        path = save_json("kernels_quick" if args.quick else "kernels", result)
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
