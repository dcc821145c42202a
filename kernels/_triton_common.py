"""Small Triton helpers shared by the kernels, and whether they run in the interpreter."""

from __future__ import annotations

import triton
import triton.language as tl

INTERPRET: bool = bool(triton.knobs.runtime.interpret)
"""True when ``TRITON_INTERPRET=1`` was set before this module was imported."""


@triton.jit
def cast_rne(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """Cast fp32 ``x`` to ``dtype`` rounding to nearest-even, as compiled kernels do.

    The interpreter truncates fp32 -> bf16; rounding the fp32 bits first makes the
    truncation exact, so interpreted results match the hardware bit for bit.
    """
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
