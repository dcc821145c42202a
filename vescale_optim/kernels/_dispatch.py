"""Backend choice shared by the kernels: Triton on CUDA, the torch reference elsewhere."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

BACKENDS = ("auto", "torch", "triton")


def _triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    """Return ``"torch"`` or ``"triton"`` for a tensor living where ``x`` lives.

    ``"auto"`` takes Triton for CUDA tensors when Triton is installed and the torch
    reference otherwise. ``"triton"`` on a CPU tensor only works when the kernels run
    in the Triton interpreter (``TRITON_INTERPRET=1`` set before they are imported).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if x.is_cuda and _triton_available() else "torch"
    if not _triton_available():
        raise RuntimeError("backend='triton' needs the `triton` package, which is not installed")
    return "triton"


def triton_module(name: str, x: torch.Tensor) -> ModuleType:
    """Import the Triton kernel module ``name`` and check it can run on ``x``'s device."""
    module = importlib.import_module(f"{__package__}.{name}")
    if not x.is_cuda and not module.INTERPRET:
        raise RuntimeError(
            f"backend='triton' got a {x.device.type} tensor: Triton kernels need CUDA, or "
            "TRITON_INTERPRET=1 set before vescale_optim.kernels is imported to run them in "
            "the Triton interpreter (slow, for tests)"
        )
    return module
