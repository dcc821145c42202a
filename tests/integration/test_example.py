"""examples/train_torchrun.py under torchrun on 2 gloo ranks: it trains fully sharded, saves
checkpoints through CheckpointManager (synchronously and asynchronously), resumes from one
exactly, and a 2-rank checkpoint resumes in one process.
examples/hf_llama.py (a Hugging Face Llama under Muon) trains, resumes exactly and writes a
folder that transformers loads with the same weights.
README.md's complete torchrun script runs on 2 ranks too, and the HSDP script of docs/guide.md on
a 2x2 mesh (each the one ```python block of README.md and docs/*.md that has what it needs)."""

from __future__ import annotations

import ast
import hashlib
import math
import re
import shutil
import sys
from pathlib import Path

import pytest
from _docs import blocks_with
from _launch import fingerprint, run_script

pytestmark = pytest.mark.slow  # make test-fast leaves it out

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_torchrun.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
SMALL = ["--dim", "32", "--layers", "2", "--batch-size", "8", "--seq-len", "16"]
HF_EXAMPLE = ROOT / "examples" / "hf_llama.py"
HF_SMALL = [
    "--vocab",
    "64",
    "--hidden",
    "32",
    "--intermediate",
    "48",
    "--layers",
    "2",
    "--batch-size",
    "4",
    "--seq-len",
    "16",
]


def _losses(out: str) -> dict[int, float]:
    return {int(s): float(x) for s, x in re.findall(r"step (\d+): loss ([\d.]+) \(mean over all ranks", out)}


@pytest.mark.timeout(480)
def test_example_trains_saves_and_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = [str(EXAMPLE), *SMALL, "--log-every", "4", "--save-every", "4", "--checkpoint-dir", str(ckpt)]
    first = run_script([*TORCHRUN, *args, "--steps", "8"], tmp_path)
    assert "on 2 rank(s), cpu; from scratch" in first
    assert f"saved {ckpt / 'step-4'}" in first and f"saved {ckpt / 'step-8'}" in first
    losses = _losses(first)
    assert list(losses) == [4, 8] and losses[8] < min(losses[4], math.log(256)), losses
    assert "unsharded 0 KiB" in first

    # resume from step 4 (as if the run had stopped there), saving asynchronously: the same weights
    shutil.rmtree(ckpt / "step-8")
    resumed = run_script([*TORCHRUN, *args, "--steps", "8", "--async-save"], tmp_path)
    assert f"resumed from {ckpt / 'step-4'}" in resumed and f"saving {ckpt / 'step-8'}" in resumed
    assert _losses(resumed)[8] == losses[8]
    assert fingerprint(resumed) == fingerprint(first)

    # a checkpoint written by 2 ranks loads in one process, without torchrun
    alone = run_script([sys.executable, *args, "--steps", "10"], tmp_path)
    assert f"on 1 rank(s), cpu; resumed from {ckpt / 'step-8'}" in alone
    assert 10 in _losses(alone)


@pytest.mark.timeout(300)
def test_hf_example_trains_resumes_and_writes_a_hugging_face_folder(tmp_path):
    pytest.importorskip("transformers")
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    args = [
        str(HF_EXAMPLE),
        *HF_SMALL,
        "--steps",
        "4",
        "--log-every",
        "2",
        "--save-every",
        "2",
        "--checkpoint-dir",
        str(ckpt),
        "--out",
        str(out),
    ]
    first = run_script([*TORCHRUN, *args], tmp_path)
    assert "in 3 units on 2 rank(s), cpu; from scratch" in first
    assert f"saved {ckpt / 'step-2'}" in first and f"saved {ckpt / 'step-4'}" in first
    losses = _losses(first)
    assert list(losses) == [2, 4] and losses[4] < min(losses[2], math.log(64)), losses

    # resume from step 2 (as if the run had stopped there): the same losses and weights
    shutil.rmtree(ckpt / "step-4")
    resumed = run_script([*TORCHRUN, *args], tmp_path)
    assert f"resumed from {ckpt / 'step-2'}" in resumed and f"wrote {out}" in resumed
    assert _losses(resumed)[4] == losses[4]
    assert fingerprint(resumed) == fingerprint(first)

    # transformers loads the folder rank 0 wrote, with the weights the run ended with
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    data = b"".join(v.float().numpy().tobytes() for v in model.state_dict().values())
    assert hashlib.sha256(data).hexdigest()[:16] == fingerprint(first)


def _readme_torchrun_script() -> str:
    found = blocks_with("init_distributed", "shard_modules", "dcp.save")
    assert len(found) == 1, f"README.md and docs/ show one complete torchrun script: {[n for n, _ in found]}"
    return found[0][1]


@pytest.mark.timeout(240)
def test_readme_torchrun_script_runs_on_two_ranks(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_readme_torchrun_script())
    out = run_script([*TORCHRUN, str(script)], tmp_path)
    assert (tmp_path / "checkpoint" / ".metadata").exists(), out[-2000:]


@pytest.mark.timeout(240)
def test_readme_hsdp_script_runs_as_two_replicas_of_two_shards(tmp_path):
    found = blocks_with("init_device_mesh", '"replicate"')
    assert len(found) == 1, f"README.md and docs/ show one HSDP script: {[name for name, _ in found]}"
    script = tmp_path / "hsdp.py"
    script.write_text(found[0][1])
    out = run_script([*TORCHRUN[:-3], "--nproc-per-node", "4", "--standalone", str(script)], tmp_path)
    # the 4 ranks print into one pipe: a rank's number and its dict may be split by another's line
    stats = [ast.literal_eval(p) for p in re.findall(r"\{'ns_matrices'[^}]*\}", out)]
    assert len(stats) == 4, out[-2000:]
    assert sum(s["ns_matrices"] for s in stats) == 6  # 3 blocks x 2 matrices, once in the world
