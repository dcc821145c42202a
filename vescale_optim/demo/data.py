"""Training text every machine has: the Python standard library's own source, as bytes."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

# Top-level stdlib modules a-m that exist in every CPython from 3.10 on (the ones
# removed in 3.12/3.13 are left out), in sorted order. About 1.5 MB of text.
_STDLIB_NAMES = """
abc argparse ast base64 bdb bisect bz2 calendar cmd code codecs codeop colorsys compileall
configparser contextlib copy copyreg csv dataclasses datetime difflib dis doctest enum filecmp
fileinput fnmatch fractions ftplib functools genericpath getopt getpass gettext glob graphlib gzip
hashlib heapq hmac imaplib inspect io ipaddress keyword linecache locale lzma mailbox mimetypes
modulefinder
"""
STDLIB_MODULES: tuple[str, ...] = tuple(_STDLIB_NAMES.split())


def stdlib_files(modules: tuple[str, ...] = STDLIB_MODULES) -> list[Path]:
    """The existing `<stdlib>/<module>.py` files of `modules`, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [root / f"{m}.py" for m in sorted(modules)]
    found = [f for f in files if f.is_file()]
    if not found:
        raise FileNotFoundError(f"none of the {len(files)} demo modules exist under {root}")
    return found


def load_corpus(val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) uint8 byte tensors; the last `val_fraction` of every file is validation."""
    train, val = [], []
    for f in stdlib_files():
        data = f.read_bytes()
        cut = int(len(data) * (1 - val_fraction))
        train.append(data[:cut])
        val.append(data[cut:])
    as_tensor = lambda parts: torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)
    return as_tensor(train), as_tensor(val)


def batch_generator(seed: int, rank: int, step: int) -> torch.Generator:
    """A CPU generator seeded by (seed, rank, step): each rank and step draws its own batch."""
    return torch.Generator().manual_seed(((seed * 1_000_003) + step) * 65_537 + rank)


def get_batch(
    data: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of `data`: inputs and next-byte targets, both int64 `[batch, seq_len]`."""
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)
    chunk = data[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


class Batches:
    """This rank's training batches, one per step, in an order fixed by (seed, rank, position).

    A checkpoint keeps its `state_dict()` (the seed and how many batches were drawn; the same
    on every rank), so a resumed run reads the batches an uninterrupted one would have.
    """

    def __init__(self, data: torch.Tensor, batch_size: int, seq_len: int, seed: int, rank: int):
        self.data, self.batch_size, self.seq_len = data, batch_size, seq_len
        self.seed, self.rank, self.position = seed, rank, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        gen = batch_generator(self.seed, self.rank, self.position)
        self.position += 1
        return get_batch(self.data, self.batch_size, self.seq_len, gen)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.position = int(state["seed"]), int(state["position"])


def val_windows(data: torch.Tensor, seq_len: int, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed, evenly spread windows of the validation bytes covering about `max_tokens` targets.

    The same windows at every world size, so validation losses are comparable.
    """
    total = (data.numel() - 1) // seq_len
    n = max(1, min(total, max_tokens // seq_len))
    starts = torch.linspace(0, (total - 1) * seq_len, n).long()
    chunk = data[starts[:, None] + torch.arange(seq_len + 1)].long()
    return chunk[:, :-1], chunk[:, 1:]
