"""CheckpointManager: a run saved at step 2 and resumed continues exactly — at the same world
size bit for bit with the uninterrupted run (random states included), at another world size
(or from a 2x2 mesh) bit for bit with continuing from the same state in torch's format — for
AdamW (fp32 and 8-bit), Muon and Shampoo, with and without shard_modules, saved synchronously
or asynchronously; keep-k and the step folders; how a save stages its state (buffers reused,
the values of its step, nothing done on CUDA by the writer)."""

from __future__ import annotations

import contextlib
import copy
import json
import random
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _resume import Counter, assert_same, full, make, train

import vescale_optim as vo
from vescale_optim.checkpoint import MANIFEST
from vescale_optim.checkpoint.dcp_tree import leaves
from vescale_optim.checkpoint.staging import HostStager, Staging, staging
from vescale_optim.shard.dcp import DcpPiece


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@contextlib.contextmanager
def slow_writes(seconds: float):
    """DCP's file writer starts `seconds` late (on this rank)."""
    original = dcp.FileSystemWriter.write_data

    def slow(self, plan, planner):
        time.sleep(seconds)
        return original(self, plan, planner)

    dcp.FileSystemWriter.write_data = slow
    try:
        yield
    finally:
        dcp.FileSystemWriter.write_data = original


def _save_run(kind, directory, config, async_save=False, noise=True):
    """Train 0..4, saving at 2 (and at 4); the state at 2 and at 4, and how long the call
    to save step 2 took. Asynchronous writes start a second late: the save of step 2
    must hold step 2's state although steps 2..3 ran before it was written."""
    rank = _rank()
    torch.manual_seed(100 + rank)
    random.seed(rank)
    model, opt, sched = make(kind, **config)
    counter = Counter()
    manager = vo.CheckpointManager(
        directory, model, opt, sched, stateful={"counter": counter}, async_save=async_save
    )
    with slow_writes(1.0 if async_save else 0.0):
        train(model, opt, sched, counter, 0, 2, noise)
        start = time.perf_counter()
        manager.save(2, extra={"note": "two", "tensor": torch.arange(3)})
        elapsed = time.perf_counter() - start
        at_two = full(model, opt, sched)
        train(model, opt, sched, counter, 2, 4, noise)
        manager.save(4)
        manager.close()
    return at_two, full(model, opt, sched), elapsed


def _resume(kind, directory, config, noise=True):
    """Fresh weights and random states, load the newest-but-one (step 2), train to 4."""
    torch.manual_seed(12345)
    random.seed(12345)
    model, opt, sched = make(kind, seed=7, **config)
    counter = Counter()
    manager = vo.CheckpointManager(directory, model, opt, sched, stateful={"counter": counter})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = manager.load(2)
    assert loaded.step == 2 and loaded.path.name == "step-2"
    assert loaded.extra["note"] == "two" and torch.equal(loaded.extra["tensor"], torch.arange(3))
    assert counter.n == 2
    at_two = full(model, opt, sched)
    train(model, opt, sched, counter, 2, 4, noise)
    return at_two, full(model, opt, sched), [str(w.message) for w in caught]


def _continue_from_full(kind, saved, config):
    """Reference: the same state through torch's format, trained 2..4."""
    model, opt, sched = make(kind, seed=7, **config)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    sched.load_state_dict(saved["sched"])
    train(model, opt, sched, Counter(), 2, 4, False)
    return full(model, opt, sched)


CASES = {
    "adamw": ("adamw", {}),
    "adamw-8bit": ("adamw8", {}),
    "muon": ("muon", {}),
    "shampoo": ("shampoo", {}),
    "adamw-zero2": ("adamw", {"sharded": False}),
    "shampoo-8bit-comm": ("shampoo", {"comm_bits": 8}),
    "muon-8bit-comm": ("muon", {"comm_bits": 8}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_at_the_same_world_size_is_bit_exact(world, tmp_path, case):
    kind, config = CASES[case]
    saved = world(2).run(_save_run, kind, str(tmp_path), config)
    resumed = world(2).run(_resume, kind, str(tmp_path), config)
    for (at_two, final, _), (got_two, got_final, caught) in zip(saved, resumed):
        assert_same(got_two, at_two)
        assert_same(got_final, final)  # random states restored: the noise repeats too
        assert not caught, caught


@pytest.mark.parametrize("case", [c for c in CASES if c != "muon-8bit-comm"])
def test_resume_at_another_world_size_continues_exactly(world, tmp_path, case):
    kind, config = CASES[case]
    at_two = world(2).run(_save_run, kind, str(tmp_path), config, False, False)[0][0]
    want = world(3).run(_continue_from_full, kind, at_two, config)
    resumed = world(3).run(_resume, kind, str(tmp_path), config, False)
    for (got_two, got_final, _), final in zip(resumed, want):
        assert_same(got_two, at_two)
        assert_same(got_final, final)
    assert any(
        "saved by 2 ranks and is loaded by 3: the random states are not restored" in m for m in resumed[0][2]
    )
    if case == "adamw-zero2":  # and in one process, without a process group
        got_two, _, _ = _resume(kind, str(tmp_path), config, False)
        assert_same(got_two, at_two)


def test_a_2x2_mesh_run_resumes_at_3(world, tmp_path):
    at_two = world(4).run(_save_run, "muon", str(tmp_path), {"mesh": (2, 2)}, False, False)[0][0]
    want = world(3).run(_continue_from_full, "muon", at_two, {})
    for (got_two, got_final, _), final in zip(world(3).run(_resume, "muon", str(tmp_path), {}, False), want):
        assert_same(got_two, at_two)
        assert_same(got_final, final)


@pytest.mark.parametrize("kind", ["adamw8", "shampoo"])
def test_an_asynchronous_save_keeps_the_state_of_its_step(world, tmp_path, kind):
    """The save of step 2 runs while steps 2..3 change the state: it holds step 2's."""
    saved = world(2).run(_save_run, kind, str(tmp_path), {}, True)
    resumed = world(2).run(_resume, kind, str(tmp_path), {})
    for (at_two, final, elapsed), (got_two, got_final, _) in zip(saved, resumed):
        assert elapsed < 1.0, elapsed  # returned before the (delayed) write
        assert_same(got_two, at_two)
        assert_same(got_final, final)
    manifest = json.loads((tmp_path / "step-4" / MANIFEST).read_text())
    assert manifest["step"] == 4 and manifest["world_size"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-4"]


def test_keep_the_last_k_and_resave_a_step(tmp_path):
    model, opt, sched = make("adamw")
    manager = vo.CheckpointManager(tmp_path / "run", model, opt, sched, keep=2)
    assert manager.latest() is None and manager.load() is None  # nothing to resume: a fresh start
    for step in (1, 2, 3, 5):
        train(model, opt, sched, Counter(), step - 1, step, False)
        manager.save(step)
    assert manager.steps() == [3, 5] and manager.latest() == 5
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-3", "step-5"]
    # an older step saved again (a run restarted from it) replaces it, keeps newer ones alone
    manager.load(3)
    manager.save(3, extra={"again": True})
    assert manager.steps() == [3, 5] and manager.load(3).extra == {"again": True}
    with pytest.raises(ValueError, match="keep must be a positive number"):
        vo.CheckpointManager(tmp_path, model, opt, keep=0)
    with pytest.raises(TypeError, match="not a vescale_optim optimizer"):
        vo.CheckpointManager(tmp_path, model, torch.optim.SGD(torch.nn.Linear(2, 2).parameters()))
    with pytest.raises(TypeError, match=r"stateful\['x'\] has no state_dict"):
        vo.CheckpointManager(tmp_path, model, opt, stateful={"x": object()})


def test_buffers_are_saved_and_loaded(tmp_path):
    """Persistent module buffers (BatchNorm statistics) come back; non-persistent ones are
    left out, as `model.state_dict()` leaves them out."""

    def net():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
        m.register_buffer("scratch", torch.zeros(3), persistent=False)
        return m

    model = net()
    opt = vo.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    model.scratch.fill_(7)
    vo.CheckpointManager(tmp_path, model, opt).save(1)
    manifest = json.loads((tmp_path / "step-1" / MANIFEST).read_text())
    assert {"1.running_mean", "1.running_var", "1.num_batches_tracked"} <= set(manifest["model"])
    assert "scratch" not in manifest["model"]
    again = net()
    vo.CheckpointManager(tmp_path, again, vo.AdamW(again.parameters(), lr=1e-2)).load()
    assert_same(again.state_dict(), model.state_dict())
    assert torch.equal(again.scratch, torch.zeros(3))


# --- staging: pinned buffers reused, one synchronisation, nothing on the writer thread ----------


def test_the_staging_of_a_tensor_follows_its_device():
    """CUDA tensors go into pinned buffers (synchronous or not), CPU ones are left in place by
    a synchronous save and copied by an asynchronous one, other devices' copied."""
    for asynchronous in (False, True):
        assert staging(torch.device("cuda", 1), asynchronous) is Staging.PINNED
        assert staging("cuda", asynchronous) is Staging.PINNED
        assert staging("xpu:0", asynchronous) is Staging.COPY
    assert staging("cpu", False) is Staging.LIVE
    assert staging(torch.device("cpu"), True) is Staging.COPY


def _stage_values(x):
    """A staged or live leaf's values, copied (a piece's flat range, decoded for a reader)."""
    if isinstance(x, DcpPiece):
        return x._flat(0, x._numel).clone()
    return x.clone() if isinstance(x, torch.Tensor) else copy.deepcopy(x)


def _tensors(sd):
    return {k: v for k, v in leaves(sd) if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("kind", ["adamw", "adamw8"])
def test_staged_buffers_are_reused_and_hold_the_values_of_their_save(kind):
    """The buffer path a CUDA tensor takes, with CPU tensors standing in (plain buffers):
    every tensor and piece (8-bit readers decoded) lands in a buffer of its own; training
    after the staging leaves the staged values alone; the next staging of the same state
    reuses every buffer (no new bytes) and holds the values of that moment."""
    model, opt, sched = make(kind)
    stager = HostStager(policy=lambda device, asynchronous: Staging.PINNED)
    state = lambda: {"model": opt.sharded_model_state_dict(model), "optim": opt.sharded_state_dict(model)}  # noqa: E731
    train(model, opt, sched, Counter(), 0, 1, False)
    first = stager.stage(state(), asynchronous=True)
    live = {k: _stage_values(v) for k, v in _tensors(state()).items()}
    stats = stager.last
    assert stats.buffers == len(live) and stats.reused == 0 and stats.syncs == 0
    assert stats.new_pinned_bytes == stats.pinned_bytes == stats.device_bytes > 0
    assert stats.copied_bytes == 0
    staged = _tensors(first)
    assert staged.keys() == live.keys()
    for k, v in staged.items():
        assert torch.equal(_stage_values(v), live[k]), k
    train(model, opt, sched, Counter(), 1, 2, False)
    changed = {k: _stage_values(v) for k, v in _tensors(state()).items()}
    assert any(not torch.equal(changed[k], live[k]) for k in live)
    for k, v in staged.items():  # the live state moved on; the staged copy did not
        assert torch.equal(_stage_values(v), live[k]), k

    second = _tensors(stager.stage(state(), asynchronous=True))
    again = stager.last
    assert again.reused == again.buffers == stats.buffers and again.new_pinned_bytes == 0
    assert again.pinned_bytes == stats.pinned_bytes
    for k, v in second.items():
        buffer = v._values if isinstance(v, DcpPiece) else v
        before = staged[k]._values if isinstance(staged[k], DcpPiece) else staged[k]
        assert buffer.data_ptr() == before.data_ptr(), k  # the same memory, refilled
        assert torch.equal(_stage_values(v), changed[k]), k
    stager.release()
    assert stager.pinned_bytes == 0


def test_a_cpu_save_stages_as_before(tmp_path):
    """On the CPU nothing is pinned: a synchronous save copies nothing, an asynchronous one
    copies its state once into plain memory; staging seconds are measured."""
    model, opt, sched = make("adamw")
    train(model, opt, sched, Counter(), 0, 1, False)
    sync = vo.CheckpointManager(tmp_path / "sync", model, opt, sched)
    assert sync.last_staging is None
    sync.save(1)
    got = sync.last_staging
    assert (got.device_bytes, got.copied_bytes, got.pinned_bytes, got.buffers, got.syncs) == (0, 0, 0, 0, 0)
    assert got.seconds > 0 and got.device is None
    background = vo.CheckpointManager(tmp_path / "async", model, opt, sched, async_save=True)
    background.save(1)
    background.close()
    got = background.last_staging
    state = {"model": opt.sharded_model_state_dict(model), "optim": opt.sharded_state_dict(model)}
    want = sum(
        v.dtype.itemsize * (v._numel if isinstance(v, DcpPiece) else v.numel())
        for v in _tensors(state).values()
    )
    assert got.copied_bytes == want > 0 and got.pinned_bytes == got.device_bytes == got.syncs == 0


def test_an_asynchronous_save_through_staging_buffers_resumes_exactly(tmp_path):
    """Both saves of a run stage through the buffers (CPU stand-ins for pinned ones); the
    second reuses them while the writes start late, and each checkpoint holds its step."""
    model, opt, sched = make("shampoo")
    manager = vo.CheckpointManager(tmp_path, model, opt, sched, async_save=True)
    manager._stager.policy = lambda device, asynchronous: Staging.PINNED
    with slow_writes(0.5):
        train(model, opt, sched, Counter(), 0, 2, False)
        manager.save(2)
        at_two = full(model, opt, sched)
        first = manager.last_staging
        train(model, opt, sched, Counter(), 2, 4, False)
        manager.save(4)
        at_four = full(model, opt, sched)
        manager.close()
    second = manager.last_staging
    assert first.buffers > 0 and first.reused == 0 and first.new_pinned_bytes > 0
    assert second.reused == second.buffers == first.buffers and second.new_pinned_bytes == 0
    for step, want in ((2, at_two), (4, at_four)):
        model, opt, sched = make("shampoo", seed=7)
        vo.CheckpointManager(tmp_path, model, opt, sched).load(step)
        assert_same(full(model, opt, sched), want)


def test_a_staged_save_does_no_cuda_work_where_cuda_is_available(tmp_path, monkeypatch):
    """DCP's writer takes its overlapping loader, which synchronises the current CUDA stream
    (device 0's on a thread of its own), whenever CUDA is available; the manager's writer
    must not, since what it writes is staged already. Here CUDA claims to be available and
    any call into it fails."""
    model, opt, sched = make("adamw")
    train(model, opt, sched, Counter(), 0, 1, False)

    def touched(*args, **kwargs):
        raise AssertionError("the save touched CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("current_stream", "synchronize", "current_device", "set_device", "Event", "stream"):
        monkeypatch.setattr(torch.cuda, name, touched)
    for async_save in (False, True):
        manager = vo.CheckpointManager(tmp_path / str(async_save), model, opt, sched, async_save=async_save)
        manager.save(1)
        manager.close()
        assert manager.steps() == [1]


def test_a_muon_group_with_split_sizes_resumes(tmp_path):
    """A group's `split_sizes` tuple comes back from the manifest's JSON as a list: still the
    same group (it was refused as another `split_sizes`)."""

    def muon():
        torch.manual_seed(2)
        model = torch.nn.Linear(8, 16, bias=False)
        return model, vo.Muon([{"params": [model.weight], "split_sizes": (4, 12)}], lr=0.02, normuon=True)

    model, opt = muon()
    model.weight.grad = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    opt.step()
    vo.CheckpointManager(tmp_path, model, opt).save(1)
    again, opt_again = muon()
    assert vo.CheckpointManager(tmp_path, again, opt_again).load().step == 1
    assert torch.equal(again.weight, model.weight)
    saved, loaded = opt.state_dict()["state"][0], opt_again.state_dict()["state"][0]
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
