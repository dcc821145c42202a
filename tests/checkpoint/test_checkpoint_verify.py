"""CheckpointManager verifies what it loads: every file's checksum, recorded in the manifest as the
file is written (on the writer thread of an asynchronous save), is checked by the ranks sharing the
files out; a damaged file is a CheckpointError on every rank naming the file and the step, and
`latest()` / `load()` without a step skip a damaged or incomplete newest checkpoint (with a warning)
for the previous sound one. A manifest of format 1 (no checksums) still loads, with a warning."""

from __future__ import annotations

import io
import json
import shutil
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _resume import Counter, assert_same, full, make, train

import vescale_optim as vo
from vescale_optim.checkpoint import MANIFEST, checksum

LEGACY = Path(__file__).parent / "legacy_index"  # a checkpoint of format 2, state keyed by index


def _flip_a_tensor_bit(step_dir) -> str:
    """Flip one mantissa bit in the middle of the largest fp32 tensor's data (a finite value
    changes a little, the file's structure does not): the data file's name."""
    md = dcp.FileSystemReader(step_dir).read_metadata()
    tensors = [
        (info.length, info)
        for index, info in md.storage_data.items()
        if getattr(md.state_dict_metadata[index.fqn], "properties", None) is not None
        and md.state_dict_metadata[index.fqn].properties.dtype == torch.float32
    ]
    _, info = max(tensors, key=lambda t: t[0])
    path = step_dir / info.relative_path
    data = bytearray(path.read_bytes())
    item = bytes(data[info.offset : info.offset + info.length])
    raw = torch.load(io.BytesIO(item)).contiguous().numpy().tobytes()
    start = item.find(raw)
    assert start >= 0 and len(raw) >= 8
    element = (len(raw) // 8) * 4  # an element halfway through
    data[info.offset + start + element + 2] ^= 1 << 6  # the top bit of its mantissa
    path.write_bytes(bytes(data))
    return info.relative_path


def _save_two(directory: str):
    """Steps 1 and 2 saved; the model at step 1."""
    model, opt, sched = make("adamw")
    manager = vo.CheckpointManager(directory, model, opt, sched, keep=None)
    train(model, opt, sched, Counter(), 0, 1, False)
    manager.save(1)
    at_one = full(model, opt, sched)["model"]
    train(model, opt, sched, Counter(), 1, 2, False)
    manager.save(2)
    return at_one


def _verdicts(directory: str):
    """Another run loads step 2 (refused), asks latest(), loads without a step: (the error,
    latest, the step loaded, the warnings, the model loaded)."""
    model, opt, sched = make("adamw", seed=7)
    manager = vo.CheckpointManager(directory, model, opt, sched)
    error = None
    try:
        manager.load(2)
    except vo.CheckpointError as e:
        error = str(e)
    latest = manager.latest()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = manager.load()
        state = full(model, opt, sched)["model"]
        manager.save(1)  # again: the skipped step 2 is no newer checkpoint that latest() would choose
    said = [str(w.message) for w in caught]
    return error, latest, loaded.step, said, state


@pytest.mark.timeout(240)
@pytest.mark.parametrize("damage", ["flipped bit", "deleted .metadata"])
def test_a_damaged_newest_step_is_named_on_every_rank_and_skipped(world, tmp_path, damage):
    at_one = world(2).run(_save_two, str(tmp_path), timeout=120)
    step_dir = tmp_path / "step-2"
    if damage == "flipped bit":
        name, what = _flip_a_tensor_bit(step_dir), "is damaged: its crc32 is"
    else:
        (step_dir / ".metadata").unlink()
        name, what = ".metadata", "is missing"
    results = world(2).run(_verdicts, str(tmp_path), timeout=120)
    for rank, (error, latest, step, said, model) in enumerate(results):
        assert error is not None, f"rank {rank} loaded the damaged step 2"
        assert f"cannot load step 2 from {step_dir}: {name} {what}" in error, error
        assert "Nothing was changed." in error
        assert latest == 1 and step == 1
        assert_same(model, at_one[rank])
        assert not [m for m in said if "holds newer checkpoints" in m], said
        skipped = [m for m in said if "skipped step-2" in m]
        if rank == 0:
            assert len(skipped) == 1, said
            assert f"{name} {what}" in skipped[0] and "loading step-1" in skipped[0], said
        else:
            assert not skipped  # said once, by rank 0


def test_a_manifest_without_checksums_still_loads_with_a_warning(tmp_path):
    """Format 1 (before checksums, the optimizer state keyed by parameter index): it loads, warning
    that nothing verified its bytes; its files are still checked for presence and size through DCP's
    metadata. Made from the format-2 fixture of legacy_index/ (see its make.py), checksums taken out."""
    from legacy_index import make

    shutil.copytree(LEGACY / f"step-{make.STEP}", tmp_path / f"step-{make.STEP}")
    file = tmp_path / f"step-{make.STEP}" / MANIFEST
    old = json.loads(file.read_text())
    assert old["format"] == 2 and old["checksum"] == "crc32"
    assert set(old["files"]) == {p.name for p in (tmp_path / f"step-{make.STEP}").iterdir()} - {MANIFEST}
    old = {k: v for k, v in old.items() if k not in ("files", "checksum")} | {"format": 1}
    file.write_text(json.dumps(old))

    model, opt = make.model_and_optimizer()
    manager = vo.CheckpointManager(tmp_path, model, opt)
    assert manager.latest() == make.STEP
    with pytest.warns(UserWarning, match="records no checksums .a manifest of format 1"):
        assert manager.load().step == make.STEP
    want = torch.load(LEGACY / "expected.pt")["model"]
    assert_same(opt.full_model_state_dict(), want)
    next(p for p in (tmp_path / f"step-{make.STEP}").glob("*.distcp")).unlink()
    with pytest.raises(vo.CheckpointError, match=r"cannot load step 3 from .*__0_0.distcp is missing"):
        manager.load(make.STEP)
    assert manager.latest() is None


def test_an_async_save_checksums_every_file_on_its_writer_thread(tmp_path, monkeypatch):
    threads = set()
    update = checksum.Crc32.update

    def recording(self, data):
        threads.add(threading.current_thread().name)
        update(self, data)

    monkeypatch.setattr(checksum.Crc32, "update", recording)
    model, opt, sched = make("adamw")
    train(model, opt, sched, Counter(), 0, 2, False)
    with vo.CheckpointManager(tmp_path, model, opt, sched, async_save=True) as manager:
        manager.save(2)
        assert threading.current_thread().name not in threads  # nothing summed on this thread
        manager.wait()
    assert threads and all(t.startswith("vescale-checkpoint") for t in threads), threads
    files = json.loads((tmp_path / "step-2" / MANIFEST).read_text())["files"]
    on_disk = sorted(p.name for p in (tmp_path / "step-2").iterdir() if p.name != MANIFEST)
    assert sorted(files) == on_disk and ".metadata" in files
    monkeypatch.setattr(checksum.Crc32, "update", update)
    for name, (size, digest) in files.items():  # what was summed while writing is what is on disk
        assert checksum.of_file(tmp_path / "step-2" / name) == (size, digest), name


def test_verify_false_records_and_checks_sizes_only(tmp_path):
    model, opt, sched = make("adamw")
    manager = vo.CheckpointManager(tmp_path, model, opt, sched, verify=False)
    manager.save(1)
    files = json.loads((tmp_path / "step-1" / MANIFEST).read_text())["files"]
    assert files and all(digest is None for _, digest in files.values())
    _flip_a_tensor_bit(tmp_path / "step-1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert manager.load().step == 1  # not verified, as asked
