"""Small Triton helpers shared by the kernels, and whether they run in the interpreter."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

_knobs = getattr(triton, "knobs", None)
INTERPRET: bool = (
    bool(_knobs.runtime.interpret)
    if _knobs is not None
    else os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")
)
"""True when ``TRITON_INTERPRET=1`` was set before this module was imported."""


@dataclass(frozen=True)
class Launch:
    """One planned kernel launch: ``kernel[grid](*args, **meta)``.

    The launchers plan, then call; ``kernels.aot`` plans the same launches on meta
    tensors and compiles them for a GPU target, so both see one configuration choice.
    """

    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    meta: dict

    def __post_init__(self) -> None:
        check_grid(self.grid)

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.meta)


MAX_GRID = (2**31 - 1, 65535, 65535)
"""Programs a CUDA launch may have along grid axes 0, 1 and 2 (CUDA C++ Programming
Guide, "Technical Specifications per Compute Capability": maximum x-, y- and
z-dimension of a grid of thread blocks)."""


def check_grid(grid: tuple[int, ...]) -> None:
    """Refuse a grid CUDA cannot launch, at planning time (a launch would fail with an
    invalid-argument error, and the interpreter would run it regardless)."""
    if not 1 <= len(grid) <= 3 or any(not 0 <= g <= limit for g, limit in zip(grid, MAX_GRID)):
        raise ValueError(f"grid {grid} exceeds CUDA's limits {MAX_GRID[: len(grid)]} programs per axis")


def device_of(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make ``t``'s GPU current for a launch (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@triton.jit
def cast_rne(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """Cast fp32 ``x`` to ``dtype`` rounding to nearest-even, as compiled kernels do.

    The interpreter truncates fp32 -> bf16, and mangles subnormals doing so; here the
    fp32 bits are rounded and their top half is the bf16 (a bitcast), so interpreted
    results match the hardware bit for bit. A NaN becomes the quiet NaN ``0x7FC0``
    (rounding its bits could carry into the exponent or the sign and make it an Inf or
    -0), so it stays a NaN, as in ``cvt.rn.bf16.f32``.
    """
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = tl.where(x == x, bits + 0x7FFF + ((bits >> 16) & 1), 0x7FC00000)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def upcast(x, INTERPRETED: tl.constexpr):
    """``x`` as fp32 (exact for every float input). The interpreter's bf16 -> fp32
    conversion mangles subnormals; there a bf16's bits become the fp32's top half."""
    if INTERPRETED and x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)
