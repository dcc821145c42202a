"""What the stages of `benchmarks/gpu_check.py` share: sizes by mode, the force switch, the
reason a CUDA-only check is skipped, rounding units, NCCL's version, `torch.cuda._sleep` cycles."""

from __future__ import annotations

KERNEL_TESTS = [
    "tests/kernels/test_kernels_ns.py",
    "tests/kernels/test_kernels_quant.py",
    "tests/kernels/test_kernels_qcomm.py",
    "tests/kernels/test_kernels_no_triton.py",
]
FORCE = {"VESCALE_OPTIM_FORCE_COLLECTIVES": "1"}
NEEDS_CUDA = "needs CUDA"
EPS32 = 2.0**-24  # fp32 unit roundoff
BF16_ULP = 2.0**-8  # one bf16 ulp, relative (8 bits of significand)

# Sizes by mode: (the GPU's, tiny ones for the CPU rehearsal: the Triton interpreter is slow).
_SIZES = {
    "dim": (64, 32),
    "blocks": (3, 2),
    "batch": ((8, 32), (4, 16)),
    "overlap_dim": (2048, 32),
    "overlap_batch": ((16, 512), (4, 16)),
    "mem_dim": (1024, 32),
    "mem_batch": ((8, 256), (4, 16)),
    "shampoo_dims": ((32, 128), (16, 32)),
    "ns_shape": ((1024, 4096), (16, 48)),
    "nan_n": ((1 << 20) + 123, 2048 + 37),
    "big_ns": ([(8192, 28672), (32, 2880, 5760)], [(32, 112), (4, 24, 48)]),
    "big_quant": ((1 << 31) + (1 << 20), (1 << 16) + 256),
}
SIZES = {mode: {k: v[i] for k, v in _SIZES.items()} for i, mode in enumerate(("gpu", "cpu"))}


def _torch():
    import torch

    return torch


def nccl_version() -> str | int | None:
    """NCCL's version ("2.27.5"), None where torch has no NCCL."""
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return None
    version = _torch().cuda.nccl.version()
    return version if isinstance(version, int) else ".".join(map(str, version))


def sleep_cycles(ms: float) -> int:
    """`torch.cuda._sleep` cycles of about `ms` milliseconds on this device (measured)."""
    torch = _torch()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(ms * 10_000_000 / max(start.elapsed_time(end), 1e-3))
