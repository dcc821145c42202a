"""examples/train_tp.py under torchrun on 4 gloo ranks (dp2 x tp2), with vo.AdamW and with
vo.Muon: it trains, saves through CheckpointManager, and a run resumed from its step-4
checkpoint ends with the same losses and weights, bit for bit, as the run that never stopped."""

from __future__ import annotations

import math
import re
import shutil
import sys
from pathlib import Path

import pytest
from _launch import fingerprint, run_script

pytestmark = pytest.mark.slow  # make test-fast leaves it out

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_tp.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone"]
SMALL = ["--dim", "32", "--layers", "2", "--batch-size", "4", "--seq-len", "16", "--tp", "2"]


def _losses(out: str) -> dict[int, float]:
    return {int(s): float(x) for s, x in re.findall(r"step (\d+): loss ([\d.]+) \(mean over dp", out)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_tp_example_trains_saves_and_resumes_exactly(tmp_path, optimizer):
    ckpt = tmp_path / "ckpt"
    args = [
        str(EXAMPLE),
        *SMALL,
        "--optimizer",
        optimizer,
        "--steps",
        "8",
        "--log-every",
        "4",
        "--save-every",
        "4",
        "--checkpoint-dir",
        str(ckpt),
    ]
    first = run_script([*TORCHRUN, *args], tmp_path)
    assert f"{optimizer} on dp2 x tp2, cpu; from scratch" in first
    assert f"saved {ckpt / 'step-4'}" in first and f"saved {ckpt / 'step-8'}" in first
    losses = _losses(first)
    assert list(losses) == [4, 8] and losses[8] < min(losses[4], math.log(256)), losses
    if optimizer == "muon":
        assert "Newton-Schulz on rank 0:" in first

    # resume from step 4 (as if the run had stopped there): the same losses and weights
    shutil.rmtree(ckpt / "step-8")
    resumed = run_script([*TORCHRUN, *args], tmp_path)
    assert f"resumed from {ckpt / 'step-4'}" in resumed
    assert _losses(resumed)[8] == losses[8]
    assert fingerprint(resumed) == fingerprint(first)
