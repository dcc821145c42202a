"""What a checkpoint folder says about itself, and whether it fits the objects loading it.

The manifest (`vescale_optim.json`) is written last, by rank 0, once every rank's part of
the checkpoint is on disk: a folder without it is incomplete. It names the optimizer and
scheduler classes, the param groups' sizes and the hyperparameters that shape the state,
the state's storage (`state_bits`), the model's names and shapes and the stateful objects,
so a checkpoint of something else is refused before anything is read.

Format 2 adds `files`: every file of the folder (DCP's data files and `.metadata`) with its
size and its checksum (`checksum.ALGORITHM`, computed while the file was written; None
when the save was made with `verify=False`), so a load can tell a damaged or incomplete
checkpoint from a sound one. A manifest of format 1 (written before checksums) still
loads: its files are checked for presence and size through DCP's metadata only, and the
load warns that nothing verified their bytes.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

FORMAT = 2
FORMATS = (1, 2)  # the manifests this version reads
MANIFEST = "vescale_optim.json"


def qualname(obj) -> str | None:
    return None if obj is None else f"{type(obj).__module__}.{type(obj).__qualname__}"


def _as_json(value):
    """`value` as the manifest's JSON reads back (tuples as lists), so a param group's
    `split_sizes=(4, 12)` compares equal to the `[4, 12]` a saved manifest holds."""
    return json.loads(json.dumps(value))


def describe(step: int, world_size: int, optimizer, scheduler, model: dict, stateful: list[str]) -> dict:
    """The manifest of a checkpoint of these objects at `step` (`model`: name -> shape)."""
    from ..version import __version__

    return {
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        "saved_at": time.time(),
        "vescale_optim": __version__,
        "optimizer": qualname(optimizer),
        "state_bits": optimizer.state_bits,
        "groups": [
            {"params": len(g["params"]), **{k: _as_json(g.get(k)) for k in optimizer.structural_keys}}
            for g in optimizer.param_groups
        ],
        "scheduler": qualname(scheduler),
        "model": {k: list(v) for k, v in model.items()},
        "stateful": sorted(stateful),
    }


def read(path: Path, step: int) -> tuple[dict | None, list[str]]:
    """The manifest of the checkpoint in `path`, or why there is none usable."""
    file = path / MANIFEST
    if not file.is_file():
        return None, [f"it has no {MANIFEST}: not complete" if path.exists() else "no such checkpoint"]
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        return None, [f"{file} is damaged ({e})"]
    ok = isinstance(manifest, dict) and manifest.get("format") in FORMATS and manifest.get("step") == step
    if not ok:
        return None, [f"{file} is not a manifest of format {' or '.join(map(str, FORMATS))} for step {step}"]
    files = manifest.get("files")
    if manifest["format"] >= 2 and not (
        isinstance(files, dict) and all(isinstance(v, list) and len(v) == 2 for v in files.values())
    ):
        return None, [f"{file} is damaged (its files are not a table of sizes and checksums)"]
    return manifest, []


def _groups(theirs: list[dict], ours: list[dict]) -> list[str]:
    if len(theirs) != len(ours):
        return [f"it has {len(theirs)} param groups, this optimizer {len(ours)}"]
    problems = []
    for i, (t, o) in enumerate(zip(theirs, ours)):
        if t["params"] != o["params"]:
            problems.append(f"param group {i} has {t['params']} parameters there, {o['params']} here")
        for key in o.keys() - {"params"}:
            if t.get(key) != o[key]:
                problems.append(
                    f"param group {i} has {key}={t.get(key)!r} there, {o[key]!r} here (it shapes "
                    f"the state: build the optimizer with {key}={t.get(key)!r})"
                )
    return problems


def _model(theirs: dict, ours: dict) -> list[str]:
    missing, unexpected = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    shapes = [f"{k} {theirs[k]} there, {v} here" for k, v in ours.items() if theirs.get(k, v) != v]
    problems = []
    for items, what in ((missing, "it lacks"), (unexpected, "this model has no"), (shapes, "shapes:")):
        if items:
            more = f" and {len(items) - 5} more" if len(items) > 5 else ""
            problems.append(f"another model: {what} {', '.join(items[:5])}{more}")
    return problems


def mismatches(theirs: dict, ours: dict) -> list[str]:
    """Why a checkpoint described by `theirs` cannot be loaded into objects described by `ours`."""
    problems = []
    if theirs["optimizer"] != ours["optimizer"]:
        problems.append(f"its optimizer is {theirs['optimizer']}, this one is {ours['optimizer']}")
    else:  # the same class: its param groups and storage must match too
        problems += _groups(theirs["groups"], ours["groups"])
        bits = theirs.get("state_bits", ours["state_bits"])
        if bits != ours["state_bits"]:
            problems.append(
                f"its optimizer state is stored in {bits} bits, this optimizer's in "
                f"{ours['state_bits']} (build it with state_bits={bits})"
            )
    if theirs["scheduler"] != ours["scheduler"]:
        problems.append(f"its LR scheduler is {theirs['scheduler']}, this one is {ours['scheduler']}")
    problems += _model(theirs["model"], ours["model"])
    absent = sorted(set(ours["stateful"]) - set(theirs["stateful"]))
    if absent:
        problems.append(f"it has no state for stateful {absent}")
    return problems


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (a rename in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
