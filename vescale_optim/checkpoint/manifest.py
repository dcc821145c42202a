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

Format 3 keys the optimizer state by parameter name (`optim.sharded_state`) and describes it
by name: `groups` lists every param group of every optimizer of the world (each pipeline
stage's) with its optimizer's class, `state_bits`, state-shaping keys and its parameters'
`names`, and `model` is the whole model's, every stage's parts together. Checkpoints of
formats 1 and 2 hold the state by parameter index; they load into one optimizer over the
world built as the one that saved them (`groups` there: each group's size and keys).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

FORMAT = 3
FORMATS = (1, 2, 3)  # the manifests this version reads
BY_NAME = 3  # the first format whose optimizer state is keyed by parameter name
MANIFEST = "vescale_optim.json"


def qualname(obj) -> str | None:
    return None if obj is None else f"{type(obj).__module__}.{type(obj).__qualname__}"


def _as_json(value):
    """`value` as the manifest's JSON reads back (tuples as lists), so a param group's
    `split_sizes=(4, 12)` compares equal to the `[4, 12]` a saved manifest holds."""
    return json.loads(json.dumps(value))


def describe_groups(optimizer, names: list[str]) -> list[dict]:
    """Each param group of `optimizer` as a manifest of format 3 holds it (`names`: each
    parameter's, in param-group order)."""
    out, at = [], 0
    for gi, g in enumerate(optimizer.param_groups):
        size = len(g["params"])
        shaping = {k: _as_json(g.get(k)) for k in optimizer.structural_keys}
        kind = {"optimizer": qualname(optimizer), "state_bits": optimizer.state_bits, "group": gi}
        out.append({**kind, **shaping, "names": names[at : at + size]})
        at += size
    return out


def describe(step: int, world_size: int, world: dict, scheduler, stateful: list[str]) -> dict:
    """The manifest of a checkpoint at `step` of the whole world's `groups` and `model` (name ->
    shape) as `world` describes them, with the scheduler and the stateful objects."""
    from ..version import __version__

    return {
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        "saved_at": time.time(),
        "vescale_optim": __version__,
        "groups": world["groups"],
        "scheduler": qualname(scheduler),
        "model": {k: list(v) for k, v in world["model"].items()},
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


def _keys(i: int, theirs: dict, ours: dict) -> list[str]:
    """Param group `i`'s state-shaping keys `ours` against `theirs`."""
    return [
        f"param group {i} has {key}={theirs.get(key)!r} there, {ours[key]!r} here (it shapes "
        f"the state: build the optimizer with {key}={theirs.get(key)!r})"
        for key in ours
        if theirs.get(key) != ours[key]
    ]


def _groups(theirs: list[dict], ours: list[dict]) -> list[str]:
    """Groups by position (a manifest of format 1 or 2): their sizes and state-shaping keys."""
    if len(theirs) != len(ours):
        return [f"it has {len(theirs)} param groups, this optimizer {len(ours)}"]
    problems = []
    for i, (t, o) in enumerate(zip(theirs, ours)):
        if t["params"] != o["params"]:
            problems.append(f"param group {i} has {t['params']} parameters there, {o['params']} here")
        problems += _keys(i, t, {k: v for k, v in o.items() if k != "params"})
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


def _shaping(group: dict) -> dict:
    """A format-3 group's state-shaping keys."""
    return {k: v for k, v in group.items() if k not in ("optimizer", "state_bits", "group", "names")}


def _optimizer(theirs: dict, ours: dict) -> list[str]:
    """The optimizer class, then the state's storage, `theirs` against `ours`."""
    if theirs["optimizer"] != ours["optimizer"]:
        return [f"its optimizer is {theirs['optimizer']}, this one is {ours['optimizer']}"]
    bits = theirs.get("state_bits", ours["state_bits"])
    if bits != ours["state_bits"]:
        return [
            f"its optimizer state is stored in {bits} bits, this optimizer's in "
            f"{ours['state_bits']} (build it with state_bits={bits})"
        ]
    return []


def _by_index(theirs: dict, ours: list[dict]) -> list[str]:
    """A checkpoint of format 1 or 2 (state by parameter index) into the world's groups `ours`."""
    if [g["group"] for g in ours] != list(range(len(ours))):  # more than one optimizer
        return [
            "its optimizer state is keyed by parameter index (a checkpoint of format 1 or 2): it loads into "
            "one optimizer over every rank built as the one that saved it, not into pipeline stages"
        ]
    sizes = [{"params": len(g["names"]), **_shaping(g)} for g in ours]
    if not ours:
        return _groups(theirs["groups"], sizes)
    problems = _optimizer(theirs, ours[0])
    if theirs["optimizer"] != ours[0]["optimizer"]:
        return problems
    return problems + _groups(theirs["groups"], sizes)


def _by_name(theirs: list[dict], ours: list[dict]) -> list[str]:
    """A checkpoint of format 3: each of our parameters' group against its saved group, by name."""
    saved = {n: g for g in theirs for n in g["names"]}
    mine = {n for g in ours for n in g["names"]}
    missing = [n for g in ours for n in g["names"] if n not in saved]
    unexpected = [n for n in saved if n not in mine]
    problems = []
    for items, what in ((missing, "it has no optimizer state for"), (unexpected, "this optimizer has no")):
        if items:
            more = f" and {len(items) - 5} more" if len(items) > 5 else ""
            problems.append(f"{what} {', '.join(items[:5])}{more}")
    for g in ours:
        for t in {id(saved[n]): saved[n] for n in g["names"] if n in saved}.values():
            problems += _optimizer(t, g)
            if t["optimizer"] == g["optimizer"]:
                problems += _keys(g["group"], t, _shaping(g))
    return list(dict.fromkeys(problems))


def mismatches(theirs: dict, ours: dict) -> list[str]:
    """Why a checkpoint described by `theirs` cannot be loaded into objects described by `ours`
    (a manifest of this format: the world's groups by name)."""
    if theirs["format"] >= BY_NAME:
        problems = _by_name(theirs["groups"], ours["groups"])
    else:
        problems = _by_index(theirs, ours["groups"])
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
