"""Kernels with torch reference implementations: Newton–Schulz and block-wise 8-bit
quantization with a fused 8-bit AdamW update, and the packed 8-bit wire format of the
unit collectives (``pack_blockwise``, ``unpack_blockwise``, ``unpack_sum_blockwise``),
which ``wire`` registers as the "q8" codec of ``gather_bits=8`` / ``reduce_bits=8``.

Every function takes ``backend="auto" | "torch" | "triton"``; ``"auto"`` runs Triton
on CUDA tensors and the torch reference elsewhere. Triton is imported only when used.
"""

from .newton_schulz import newton_schulz
from .packed import pack_blockwise, packed_width, unpack_blockwise, unpack_sum_blockwise
from .quant import adamw8bit_update_, dequantize_blockwise, quantize_blockwise

__all__ = [
    "adamw8bit_update_",
    "dequantize_blockwise",
    "newton_schulz",
    "pack_blockwise",
    "packed_width",
    "quantize_blockwise",
    "unpack_blockwise",
    "unpack_sum_blockwise",
]
