"""Muon's functional core, as in `torch.optim._muon`: pure functions over flat tensors and
batches of matrices. Per matrix, with gradient g and momentum buffer B:

    B <- mu*B + (1-mu)*g                      momentum_          (on flat runs)
    U  = g + mu*(B - g)  (nesterov) else B    momentum_
    O  = NS(U)                                orthogonalize_     (bf16 Newton–Schulz, batched)
    O  = NorMuon(O, v)  (normuon=True)        normuon_           (per row, then O's norm)
    p <- p*(1 - lr*wd) - adjusted_lr*O        apply_             (on flat runs)

A parameter's matrices are its `blocks` (`param_blocks`): a 3-D stack's matrices, each cut into
the row blocks `split_sizes` or `num_heads` give; every block is orthogonalized, normalized and
scaled as a parameter of its own shape would be.

No processes, no optimizer state objects: `muon.Muon` decides where each piece lies.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

import torch

from ..kernels import newton_schulz
from ..kernels.newton_schulz import ns_schedule

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
CHUNK = 1 << 20  # elements per element-wise call by default: bounds the temporaries of a step

Run = tuple[int, int]  # [lo, hi) of a flat tensor


def adjusted_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """torch.optim.Muon's per-matrix learning-rate scaling."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"unknown adjust_lr_fn {adjust_lr_fn!r}; expected one of {ADJUST_LR_FNS}")


def matrix_view(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(count, rows, cols): a 2-D weight is one matrix, a 3-D stack `count` of them, and a
    4-D convolution weight one `[out, in*kh*kw]` matrix."""
    if len(shape) == 2:
        return 1, shape[0], shape[1]
    if len(shape) == 3:
        return shape[0], shape[1], shape[2]
    return 1, shape[0], math.prod(shape[1:])


def row_blocks(rows: int, split_sizes: Sequence[int] | None, num_heads: int | None) -> tuple[int, ...]:
    """The row counts a matrix of `rows` rows is cut into: `split_sizes` (summing to `rows`),
    `num_heads` equal blocks, or the whole. ValueError when they do not fit."""
    if split_sizes is not None and num_heads is not None:
        raise ValueError(
            f"give split_sizes or num_heads, not both; got {tuple(split_sizes)!r} and {num_heads!r}"
        )
    if split_sizes is not None:
        sizes = tuple(split_sizes) if isinstance(split_sizes, tuple | list) else None
        if not sizes or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
            raise ValueError(f"split_sizes must be a tuple of positive row counts; got {split_sizes!r}")
        if sum(sizes) != rows:
            raise ValueError(f"split_sizes {sizes} sum to {sum(sizes)}, but the matrix has {rows} rows")
        return sizes
    if num_heads is not None:
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads must be an integer >= 1; got {num_heads!r}")
        if rows % num_heads:
            raise ValueError(f"num_heads={num_heads} does not divide the matrix's {rows} rows")
        return (rows // num_heads,) * num_heads
    return (rows,)


def param_blocks(
    shape: tuple[int, ...], split_sizes: Sequence[int] | None = None, num_heads: int | None = None
) -> list[tuple[int, int, int]]:
    """`(offset, rows, cols)` of each block of a parameter of `shape`, in flat order: per matrix
    of `matrix_view`, its row blocks (`row_blocks`); a block is contiguous in the flat tensor."""
    count, rows, cols = matrix_view(shape)
    sizes = row_blocks(rows, split_sizes, num_heads)
    out = []
    for s in range(count):
        at = s * rows * cols
        for n in sizes:
            out.append((at, n, cols))
            at += n * cols
    return out


def group_blocks(shape: tuple[int, ...], group: dict) -> list[tuple[int, int, int]]:
    """`param_blocks` with a param group's `split_sizes` and `num_heads`."""
    return param_blocks(shape, group.get("split_sizes"), group.get("num_heads"))


def ns_steps_of(group: dict) -> int:
    """Newton–Schulz steps a param group runs: `ns_steps`, or its coefficient sequence's length."""
    return len(ns_schedule(group["ns_coefficients"], group["ns_steps"])[0])


NORMUON_EPS = 1e-8


def normuon_(o: torch.Tensor, v: torch.Tensor, beta2: float) -> None:
    """NorMuon (Li et al. 2025, arXiv 2510.05491) on one orthogonalized block `o` (rows x cols),
    in place, with `v` its per-row second moment (fp32, updated in place):
    `v <- lerp(v, mean(O², row), 1 - beta2)`, `O_n = O / (sqrt(v) + 1e-8)` row-wise, and
    `O <- O_n * ||O||_F / max(||O_n||_F, 1e-8)`; computed in fp32, stored in `o`'s dtype."""
    x = o.float()
    norm = torch.linalg.vector_norm(x)
    v.lerp_(x.square().mean(dim=-1), 1 - beta2)
    x = x / (v.sqrt() + NORMUON_EPS).unsqueeze(-1)
    x.mul_(norm / torch.linalg.vector_norm(x).clamp(min=NORMUON_EPS))
    o.copy_(x)


def ns_flops(rows: int, cols: int, steps: int = 5) -> int:
    """FLOPs of `steps` Newton–Schulz steps on an `m x n` matrix, `a = min(m, n)`, `b = max(m, n)`:
    `X Xᵀ` (2a²b) + `A A` (2a³) + `B X` (2a²b) = 4a²b + 2a³ per step."""
    a, b = min(rows, cols), max(rows, cols)
    return steps * (4 * a * a * b + 2 * a * a * a)


def chunks(runs: Iterable[tuple], size: int = CHUNK) -> Iterator[tuple]:
    """Each run `(lo, hi, *rest)` cut into pieces of at most `size` elements, `rest` kept."""
    for lo, hi, *rest in runs:
        for a in range(lo, hi, size):
            yield (a, min(hi, a + size), *rest)


def momentum_(
    buf: torch.Tensor,
    grad: torch.Tensor,
    runs: Sequence[Run],
    momentum: float,
    nesterov: bool,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """`B <- mu*B + (1-mu)*g` on the runs of the flat `buf`, in place; returns the update `U`
    in bf16, as long as `buf` and zero outside the runs. Temporaries stay `chunk`-sized."""
    update = buf.new_empty(buf.numel(), dtype=torch.bfloat16)
    if [tuple(r) for r in runs] != [(0, buf.numel())]:
        update.zero_()
    for lo, hi in chunks(runs, chunk):
        m, g = buf[lo:hi], grad[lo:hi]
        m.lerp_(g, 1 - momentum)
        if nesterov:  # computed in fp32, rounded once into the bf16 update: no fp32 temporary
            torch.lerp(g, m, momentum, out=update[lo:hi])
        else:
            update[lo:hi].copy_(m)
    return update


def orthogonalize_(
    matrices: Sequence[torch.Tensor], steps: int, coefficients, eps: float, backend: str = "auto"
) -> None:
    """`X <- NS(X)` in place for equal-shaped matrices, batched (one matrix takes torch's
    exact path, unstacked); `coefficients` as `newton_schulz` takes them."""
    x = matrices[0] if len(matrices) == 1 else torch.stack(list(matrices))
    out = newton_schulz(x, steps, coefficients, eps, backend)
    rows, cols = matrices[0].shape
    for view, o in zip(matrices, out.view(len(matrices), rows, cols)):
        view.copy_(o)


def merged(
    lo: int, hi: int, update: torch.Tensor, back: torch.Tensor, returned: Sequence[tuple[int, int, int]]
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """`(a, z, O[a:z])` covering `[lo, hi)` of the local slice: from `back` where a result
    came back there (`returned`: `(offset, in back, length)`, sorted), else from `update`."""
    pos = lo
    for offset, at, n in returned:
        a, z = max(lo, offset), min(hi, offset + n)
        if a >= z:
            continue
        if pos < a:
            yield pos, a, update[pos:a]
        yield a, z, back[at + a - offset : at + z - offset]
        pos = z
    if pos < hi:
        yield pos, hi, update[pos:hi]


def apply_(
    params: torch.Tensor,
    runs: Iterable[tuple[int, int, float]],
    lr: float,
    weight_decay: float,
    update: torch.Tensor,
    back: torch.Tensor,
    returned: Sequence[tuple[int, int, int]],
    chunk: int = CHUNK,
) -> None:
    """`p <- p*(1 - lr*wd) - adjusted_lr*O` on the runs `(lo, hi, adjusted_lr)` of the flat
    `params`; `O` as `merged` finds it."""
    decay = 1 - lr * weight_decay
    for lo, hi, alr in chunks(runs, chunk):
        for a, z, values in merged(lo, hi, update, back, returned):
            params[a:z].mul_(decay).add_(values, alpha=-alr)
