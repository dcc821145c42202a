"""Kernel throughput: Newton–Schulz (Triton vs torch) and the fused 8-bit AdamW update.

Newton–Schulz is timed for 5 steps at Muon's coefficients. TFLOP/s counts the dense
work of the torch iteration per matrix (``p <= q``): ``X Xᵀ`` ``2p²q``, ``A²`` ``2p³``,
``B X`` ``2p²q`` per step — the Triton path skips the lower triangles of the two
symmetric products (about a quarter of the work when ``p = q``), so its rate on this
count can exceed what the tensor cores run. The fraction is of an assumed dense bf16
peak looked up from the device name.

The 8-bit update counts the bytes one step must move: fp32 parameter read + written,
gradient read, two int8 moments read + written, two fp32 scales per block read +
written; GB/s is that over the median time, compared with an assumed HBM bandwidth.

On CUDA both backends run at the sizes of the brief (4096², 8x2048², 1024x4096; 2**28
parameters). On CPU only the torch reference runs, at small sizes so it finishes in
well under a minute; the Triton rows need a GPU.

    python benchmarks/kernels.py               # medians of 5 runs
    python benchmarks/kernels.py --repeats 9
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import environment, save_json, table  # noqa: E402
from vescale_optim.kernels import (  # noqa: E402
    adamw8bit_update_,
    newton_schulz,
    quantize_blockwise,
)

# Dense bf16 tensor-core TFLOP/s and HBM TB/s by device-name substring (vendor sheets, SXM parts).
PEAKS = {
    "H200": (989.0, 4.8),
    "H100 PCIe": (756.0, 2.0),
    "H100": (989.0, 3.35),
    "H800": (989.0, 3.35),
    "A100": (312.0, 2.04),
    "L40S": (362.0, 0.864),
}
NS_STEPS = 5
BLOCK_SIZE = 256


def assumed_peaks(device: torch.device) -> tuple[str, float | None, float | None]:
    if device.type != "cuda":
        return "cpu", None, None
    name = torch.cuda.get_device_name(device)
    for key, (tflops, tbps) in PEAKS.items():
        if key in name:
            return name, tflops, tbps
    return name, None, None


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time of ``fn`` after one warm-up call (compilation, caches)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ns_flops(shape: tuple[int, ...]) -> float:
    *batch, m, n = shape
    p, q = min(m, n), max(m, n)
    return NS_STEPS * (4 * p * p * q + 2 * p**3) * (torch.Size(batch).numel())


def update_bytes(n: int, grad_bytes: int) -> int:
    return n * (4 + 4 + grad_bytes + 2 + 2) + 2 * 2 * 4 * -(-n // BLOCK_SIZE)


def bench_newton_schulz(shapes, backends, device, repeats, peak_tflops) -> list[dict]:
    rows = []
    for shape in shapes:
        x = torch.randn(shape, device=device, dtype=torch.bfloat16)
        reference = newton_schulz(x, backend="torch")
        for backend in backends:
            out = newton_schulz(x, backend=backend)
            run = functools.partial(newton_schulz, x, backend=backend)
            seconds = median_seconds(run, device, repeats)
            tflops = ns_flops(shape) / seconds / 1e12
            rows.append(
                {
                    "kernel": "newton_schulz",
                    "shape": "x".join(map(str, shape)),
                    "backend": backend,
                    "ms": seconds * 1e3,
                    "TFLOP/s": tflops,
                    "GB/s": None,
                    "% of peak": None if peak_tflops is None else 100 * tflops / peak_tflops,
                    "max abs diff vs torch": None
                    if backend == "torch"
                    else (out.float() - reference.float()).abs().max().item(),
                }
            )
    return rows


def update_runner(grad: torch.Tensor, backend: str) -> Callable[[], None]:
    """One 8-bit AdamW step per call on fresh state, the step count advancing."""
    param = torch.randn_like(grad)
    qm, sm = quantize_blockwise(0.1 * grad, BLOCK_SIZE)
    qv, sv = quantize_blockwise(0.1 * grad.abs(), BLOCK_SIZE)
    steps = iter(range(1, 1 << 30))

    def run() -> None:
        adamw8bit_update_(
            param, grad, qm, sm, qv, sv, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
            weight_decay=0.1, step=next(steps), block_size=BLOCK_SIZE, backend=backend,
        )

    return run


def bench_update(n, backends, device, repeats, peak_tbps) -> list[dict]:
    rows = []
    grad = torch.randn(n, device=device)
    for backend in backends:
        seconds = median_seconds(update_runner(grad, backend), device, repeats)
        gbps = update_bytes(n, grad.element_size()) / seconds / 1e9
        rows.append(
            {
                "kernel": "adamw8bit_update_",
                "shape": str(n),
                "backend": backend,
                "ms": seconds * 1e3,
                "TFLOP/s": None,
                "GB/s": gbps,
                "% of peak": None if peak_tbps is None else 100 * gbps / (peak_tbps * 1e3),
                "max abs diff vs torch": None,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per row (median)")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name, peak_tflops, peak_tbps = assumed_peaks(device)
    if device.type == "cuda":
        backends = ["triton", "torch"]
        shapes = [(4096, 4096), (8, 2048, 2048), (1024, 4096)]
        n = 1 << 28
    else:
        torch.manual_seed(0)
        backends = ["torch"]
        shapes = [(256, 256), (4, 128, 128), (128, 512)]
        n = 1 << 20

    rows = bench_newton_schulz(shapes, backends, device, args.repeats, peak_tflops)
    rows += bench_update(n, backends, device, args.repeats, peak_tbps)

    print(f"device: {name}; assumed peaks: bf16 {peak_tflops} TFLOP/s dense, HBM {peak_tbps} TB/s")
    print(table(rows))
    if device.type != "cuda":
        print("\nTriton rows (and % of peak) need a CUDA GPU: only the torch reference ran here.")
    path = save_json(
        "kernels",
        {
            "env": environment(),
            "device": name,
            "assumed_peak_bf16_tflops": peak_tflops,
            "assumed_peak_hbm_tbps": peak_tbps,
            "ns_steps": NS_STEPS,
            "block_size": BLOCK_SIZE,
            "repeats": args.repeats,
            "rows": rows,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
