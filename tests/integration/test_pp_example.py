"""examples/train_pp.py under torchrun on 4 gloo ranks: vo.Muon per stage at pp2 x dp2 (1F1B, two
micro-batches) saves through CheckpointManager, and the checkpoint resumes exactly without
pipelining at pp1 x dp4 and at pp4 x dp1 (GPipe).

Exact, as the example's docstring says, means two things, each checked bit for bit:
- the loaded state is the saved state: the state fingerprint (every parameter, optimizer state
  tensor and hyperparameter by name, the step, the LR schedule) a resumed run prints after its
  load equals the one the pp2 x dp2 run printed when it saved;
- the run goes on as its own layout would from that state: resumed again at pp1 x dp4 from its
  own step-6, it ends with the same losses and weights as the pp1 x dp4 run that did not stop.
The losses of two layouts differ by rounding only (another order of the same additions), so
they are held close, not equal."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
from _launch import fingerprint, run_script

pytestmark = pytest.mark.slow  # make test-fast leaves it out

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_pp.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone"]
SMALL = ["--optimizer", "muon", "--dim", "32", "--batch-size", "8", "--seq-len", "16", "--microbatches", "2"]
SMALL += ["--log-every", "1"]


def _run(tmp_path: Path, folder: str, *args: str, start_from: Path | None = None) -> str:
    """The example with `SMALL` and `args`, checkpoints in `tmp_path / folder` (resumed from a copy of
    the checkpoint `start_from`, when given); its output."""
    ckpt = tmp_path / folder
    if start_from is not None:
        ckpt.mkdir()
        shutil.copytree(start_from, ckpt / start_from.name)
        args = (*args, "--resume")
    return run_script([*TORCHRUN, str(EXAMPLE), *SMALL, *args, "--checkpoint-dir", str(ckpt)], tmp_path)


def _losses(out: str) -> dict[int, float]:
    return {int(s): float(x) for s, x in re.findall(r"step (\d+): loss ([\d.]+) \(mean over dp", out)}


def _saved(out: str) -> dict[int, str]:
    return {int(s): f for s, f in re.findall(r"saved \S+step-(\d+); state fingerprint (\w+)", out)}


def _loaded(out: str) -> str:
    found = re.findall(r"resumed from \S+; state fingerprint (\w+)", out)
    assert len(found) == 1, out[-2000:]
    return found[0]


@pytest.mark.timeout(240)
def test_pp2_dp2_checkpoint_resumes_exactly_at_pp1_dp4_and_pp4_dp1(tmp_path):
    first = _run(tmp_path, "pp2", "--pp", "2", "--dp", "2", "--steps", "4", "--save-every", "4")
    assert "muon on pp2 x dp2 (1f1b, 2 micro-batches), cpu; from scratch" in first
    assert "Newton-Schulz on rank 0:" in first
    saved = _saved(first)
    assert list(saved) == [4] and list(_losses(first)) == [1, 2, 3, 4]

    # without pipelining at dp4: the state as saved, then a run of pp1 x dp4's own
    wide = _run(
        tmp_path, "pp1", "--pp", "1", "--steps", "8", "--save-every", "2", start_from=tmp_path / "pp2/step-4"
    )
    assert "muon on pp1 x dp4 (no pipelining), cpu; resumed from" in wide
    assert _loaded(wide) == saved[4]
    losses = _losses(wide)
    assert list(losses) == [5, 6, 7, 8] and losses[8] < _losses(first)[1], (losses, _losses(first))

    # pp1 x dp4 resumed again from its own step 6 ends as the run that did not stop, bit for bit
    again = _run(tmp_path, "pp1-again", "--pp", "1", "--steps", "8", start_from=tmp_path / "pp1/step-6")
    assert _loaded(again) == _saved(wide)[6]
    assert _losses(again) == {7: losses[7], 8: losses[8]}
    assert fingerprint(again) == fingerprint(wide)

    # four stages of one layer each, over dp1, GPipe: the state as saved, and from it the same
    # loss as pp1 x dp4 up to rounding
    deep = _run(
        tmp_path,
        "pp4",
        "--pp",
        "4",
        "--schedule",
        "gpipe",
        "--steps",
        "5",
        start_from=tmp_path / "pp2/step-4",
    )
    assert "muon on pp4 x dp1 (gpipe, 2 micro-batches), cpu; resumed from" in deep
    assert _loaded(deep) == saved[4]
    assert _losses(deep)[5] == pytest.approx(losses[5], rel=1e-5)
