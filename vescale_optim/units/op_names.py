"""Tables of torch functions, written as lines of names.

The `__torch_function__` handlers of this package (the sharded gradients of `reduced_grad`,
the stand-ins of `stand_in` and `shard_init`) sort each call by which table holds its
function: metadata, casts, element-wise ops, reductions. Written as names, a table of thirty
functions reads as a few lines of text rather than a screen of `torch.Tensor.x` attributes."""

from __future__ import annotations

import functools

import torch


def names(text: str) -> set[str]:
    """The names `text` lists, separated by spaces."""
    return set(text.split())


def tensor_attrs(text: str) -> set:
    """The `torch.Tensor` attributes `text` lists (space-separated). A dotted name reaches
    further: `shape.__get__` is the property's getter, what `__torch_function__` receives for
    `t.shape`."""
    return {functools.reduce(getattr, name.split("."), torch.Tensor) for name in text.split()}


def funcs(text: str, pattern: str = "{}") -> set:
    """The functions `text` lists (space-separated, each filled into `pattern`), as methods of
    `torch.Tensor` and as functions of `torch`, where either exists."""
    found = set()
    for name in text.split():
        for owner in (torch.Tensor, torch):
            f = getattr(owner, pattern.format(name), None)
            if f is not None:
                found.add(f)
    return found
