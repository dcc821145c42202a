"""This process's random states, to save with a checkpoint and restore on resume."""

from __future__ import annotations

import random
import warnings

import torch


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def rng_state() -> dict:
    """torch's (CPU, and CUDA when in use), Python's and numpy's random states."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = _numpy()
    if np is not None:
        state["numpy"] = np.random.get_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state()` returned (CUDA's only for the same number of devices)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            warnings.warn(
                f"the checkpoint has the random states of {len(cuda)} CUDA devices, this process "
                f"sees {torch.cuda.device_count()}: CUDA's random states are not restored",
                stacklevel=3,
            )
        else:
            torch.cuda.set_rng_state_all(cuda)
    np = _numpy()
    if "numpy" in state and np is not None:
        np.random.set_state(state["numpy"])
