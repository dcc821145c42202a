"""How the checkpoint manager walks, loads into and checks a state dict as DCP sees it
(copies for a save are `staging`'s).

DCP flattens nested dicts (and lists of dicts) into dotted keys; a leaf is a tensor, a
`DcpPiece` (this rank's piece of a sharded tensor) or any other value (one pickled item).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from ..shard.dcp import DcpPiece


def leaves(x, prefix: str = ""):
    """(key, value) of every leaf as DCP flattens a state dict: dicts always, lists when
    they hold dicts or lists."""
    if isinstance(x, Mapping):
        for k, v in x.items():
            yield from leaves(v, f"{prefix}{k}.")
    elif isinstance(x, list) and any(isinstance(v, (Mapping, list)) for v in x):
        for i, v in enumerate(x):
            yield from leaves(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], x


def map_leaves(x, fn):
    if isinstance(x, Mapping):
        return {k: map_leaves(v, fn) for k, v in x.items()}
    if isinstance(x, list):
        return [map_leaves(v, fn) for v in x]
    return fn(x)


def blank(x):
    """Somewhere for `dcp.load` to put `x`'s saved value without touching `x`."""
    if isinstance(x, DcpPiece):
        return x.blank("cpu")
    if isinstance(x, torch.Tensor):
        return torch.zeros(x.shape, dtype=x.dtype)
    return copy.deepcopy(x)


def take(live, loaded):
    """Write what `loaded` (a `blank` copy of `live` that DCP filled) holds into `live`'s
    memory; returns the new value of a leaf that is not a tensor."""
    if isinstance(live, Mapping):
        for k in live:
            live[k] = take(live[k], loaded[k])
        return live
    if isinstance(live, list):
        for i in range(len(live)):
            live[i] = take(live[i], loaded[i])
        return live
    if isinstance(live, DcpPiece):
        live.load_from(loaded)
        return live
    if isinstance(live, torch.Tensor):
        live.copy_(loaded)
        return live
    return loaded


def _metadata(path: Path):
    """DCP's metadata of the checkpoint in `path`, or why it cannot be read (a str)."""
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - any failure to read it means a damaged checkpoint
        return f"its metadata cannot be read ({type(e).__name__}: {e})"


def _storage(path: Path, md) -> list[str]:
    """Every file DCP's metadata `md` points into must be there and long enough."""
    problems, need = [], {}
    for info in md.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        f = path / name
        if not f.is_file():
            problems.append(f"{name} is missing")
        elif f.stat().st_size < size:
            have = f.stat().st_size
            problems.append(f"{name} is truncated ({have:,} bytes; the metadata needs {size:,})")
    return problems


def check_storage(path: Path) -> list[str]:
    """DCP's metadata must be readable and every file it points into whole (what can be
    checked of a checkpoint whose manifest records no files: format 1)."""
    md = _metadata(path)
    return [md] if isinstance(md, str) else _storage(path, md)


def check_files(path: Path, live: dict) -> list[str]:
    """DCP's metadata must be readable, list every key we load with its shape, and
    every file it points into must be whole."""
    md = _metadata(path)
    if isinstance(md, str):
        return [md]
    problems = _storage(path, md)
    saved = md.state_dict_metadata
    for key, value in leaves(live):
        entry = saved.get(key)
        if entry is None:
            problems.append(f"it lacks {key}")
        elif isinstance(value, torch.Tensor):
            shape = getattr(entry, "size", None)
            if shape is None:
                problems.append(f"{key} is not a tensor there")
            elif tuple(shape) != tuple(value.shape):
                problems.append(f"{key} has shape {tuple(shape)} there, {tuple(value.shape)} here")
    return problems[:8] + ([f"and {len(problems) - 8} more"] if len(problems) > 8 else [])


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers `model.state_dict()` holds, by name, without gathering any parameter."""
    out = {}
    for prefix, module in model.named_modules():
        skip = module._non_persistent_buffers_set  # what state_dict() itself leaves out
        for name, b in module.named_buffers(recurse=False):
            if b is not None and name not in skip:
                out[f"{prefix}.{name}" if prefix else name] = b
    return out
