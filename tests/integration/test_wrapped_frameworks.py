"""The library's optimizers inside the data-parallel wrappers of the frameworks users run, on 2
gloo ranks launched as users launch them (test_frameworks.py runs the same frameworks in one
process): HF Trainer and an accelerate loop under torch.distributed.run, a Lightning Trainer with
strategy="ddp" started as a plain script. DistributedDataParallel averages the gradients and the
optimizer shards only its state (ZeRO-1), so each run must end where the same launch with
torch.optim ends. The launch scripts are in wrapped/; each rank trains on rows of its own.

accelerate's FSDP2 plugin too: its prepare(model, opt) builds the optimizer's FSDP2 layout by
swapping the optimizer's parameters for FSDP2's DTensors in place, which the library follows
before its first step (the launch script sets the distributed type accelerate takes on a GPU
only). FSDP2 averages the gradients and the optimizer steps FSDP2's shards."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import torch
from _launch import run_script

pytestmark = pytest.mark.slow  # make test-fast leaves it out

ROOT = Path(__file__).resolve().parents[2]
WRAPPED = Path(__file__).resolve().parent / "wrapped"
# --standalone: torchrun's rendezvous takes a free port of its own (Lightning's, MASTER_PORT, is ours)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
TIMEOUT = 240
# AdamW, and Muon too: vo.Muon orthogonalizes each whole matrix with torch.optim.Muon's bf16
# operations, and both sides run them on one thread each, so the matrices came out bitwise equal
# and the biases (AdamW) within 4e-9 in the accelerate runs here (not the 2e-3 floor against a
# one-thread reference of other tests)
TOL = dict(rtol=1e-5, atol=1e-6)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], cwd: Path) -> str:
    """Run `cmd` (`_launch.run_script`) with one thread per rank, a free port for Lightning's
    rendezvous and this tree on the path."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])  # this tree's
    return run_script(cmd, cwd, TIMEOUT, env, tail=6000)


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """`launch(script, *args)`: rank 0's result of one 2-rank run of wrapped/`script`, cached, so
    each torch reference runs once for the variants compared with it."""
    root = tmp_path_factory.mktemp("wrapped")
    done: dict[tuple, dict] = {}

    def run(script: str, *args: str) -> dict:
        if (script, *args) not in done:
            out = root / f"{len(done)}.pt"
            launcher = [sys.executable] if script.startswith("lightning") else TORCHRUN  # Lightning: its own
            said = _run([*launcher, str(WRAPPED / script), *args, "--out", str(out)], root)
            done[(script, *args)] = {**torch.load(out), "output": said}
        return done[(script, *args)]

    return run


def _same(got: dict, want: dict, sharded_over: int | None = 2) -> None:
    """`got` (the library's run) ended where `want` (torch's) did, its state sharded over both ranks."""
    assert got["sharded_over"] == sharded_over, got["sharded_over"]
    assert len(got["params"]) == len(want["params"])
    for i, (a, b) in enumerate(zip(got["params"], want["params"])):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, i=i: f"parameter {i}: {m}")
    if want["grad_norms"] is not None:
        assert max(want["grad_norms"]) > 0.5  # clipping acted
        torch.testing.assert_close(torch.tensor(got["grad_norms"]), torch.tensor(want["grad_norms"]), **TOL)


@pytest.mark.parametrize("built", ["after", "before"])
def test_hf_trainer_under_torchrun_trains_like_torch_adamw(launch, built):
    """vo.AdamW built after TrainingArguments (the process group exists) or before it (none yet)."""
    want = launch("hf_trainer.py", "--opt", "torch")
    got = launch("hf_trainer.py", "--opt", "vo_adamw", "--built", built)
    # built before the process group: one process's optimizer (DDP averages), said once at its first step
    _same(got, want, sharded_over=2 if built == "after" else 1)
    unbound = "built before torch.distributed's process group existed"
    assert (unbound in got["output"]) == (built == "before"), got["output"][-3000:]


# torch.optim under gradient_as_bucket_view=True ends bitwise where it ends without: one reference
@pytest.mark.parametrize("wrap", ["ddp", "bucket_view"])
@pytest.mark.parametrize("opt, torch_opt", [("vo_adamw", "torch"), ("vo_muon", "torch_muon")])
def test_accelerate_loop_under_torchrun_trains_like_torch(launch, opt, torch_opt, wrap):
    want = launch("accelerate_loop.py", "--opt", torch_opt)
    _same(launch("accelerate_loop.py", "--opt", opt, "--wrap", wrap), want)


def test_accelerate_fsdp2_plugin_trains_like_torch(launch):
    """AdamW against torch.optim.AdamW under the same FSDP2 launch. Muon against torch.optim.Muon
    under DDP: torch's Muon on FSDP2's shards would orthogonalize each rank's rows apart (not
    Muon), while the library's brings each matrix whole to one owner, so it must end where
    whole-matrix Muon does (FSDP2 and DDP average the same two gradients)."""
    _same(
        launch("accelerate_loop.py", "--opt", "vo_adamw", "--wrap", "fsdp2"),
        launch("accelerate_loop.py", "--opt", "torch", "--wrap", "fsdp2"),
    )
    _same(
        launch("accelerate_loop.py", "--opt", "vo_muon", "--wrap", "fsdp2"),
        launch("accelerate_loop.py", "--opt", "torch_muon"),
    )


@pytest.mark.parametrize("wrap", ["ddp", "bucket_view"])
def test_lightning_ddp_trains_like_torch_adamw(launch, wrap):
    want = launch("lightning_ddp.py", "--opt", "torch")
    _same(launch("lightning_ddp.py", "--opt", "vo_adamw", "--wrap", wrap), want)
