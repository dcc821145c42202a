"""Smoke tests of the demo: in-process training at world size 1 (ZeRO-3 and ZeRO-2 train the
same model; bf16 gathered parameters with --param-dtype bf16), the default run (AdamW and Muon
from the same weights, plotted against step and wall time), the command line's help, and
2-rank CLI runs of both modes with their memory; a run resumed from a checkpoint ends bit for
bit as an uninterrupted one."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from vescale_optim.demo.__main__ import build_parser, parse_args
from vescale_optim.demo.config import TrainConfig
from vescale_optim.demo.data import batch_generator, get_batch, load_corpus, val_windows
from vescale_optim.demo.model import GPT
from vescale_optim.demo.optimizers import (
    DEFAULT_OPTIMIZERS,
    OPTIMIZERS,
    lr_multiplier,
    mixed_precision,
    optimizer_names,
)
from vescale_optim.demo.train import train

pytestmark = pytest.mark.slow  # make test-fast leaves it out

ROOT = Path(__file__).resolve().parents[2]
TINY = TrainConfig(
    optimizer="adamw", batch_size=8, seq_len=32, d_model=32, n_layers=1, n_heads=2, warmup=3, val_tokens=1024
)
TINY_FLAGS = ["--batch-size", "4", "--seq-len", "32", "--d-model", "32", "--n-layers", "1", "--n-heads", "2"]


@pytest.fixture
def one_thread():
    """Train on one thread (fast and steady on a busy machine); restore afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _check_outputs(out: Path, names: list[str], steps: int, world_size: int) -> dict:
    png = (out / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width > 2 * height, (width, height)  # two panels side by side: loss vs step, vs wall time
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == world_size
    assert list(summary["runs"]) == names
    starts = {run["init_params_sha256"] for run in summary["runs"].values()}
    assert len(starts) == 1, "every optimizer starts from the same weights"
    for run in summary["runs"].values():
        assert len(run["loss"]) == steps
        assert all(math.isfinite(x) for x in run["loss"])
        seconds = run["time_s"]
        assert len(seconds) == steps and all(0 < a <= b for a, b in zip(seconds, seconds[1:]))
        assert math.isfinite(run["val_loss"]) and run["tokens_per_s"] > 0
        assert [m["rank"] for m in run["peak_memory"]] == list(range(world_size))
        assert all(m["rss_mib"] > 0 for m in run["peak_memory"])
        assert len(run["held_bytes"]) == world_size
        assert all(b["unsharded"] == 0 for b in run["held_bytes"]), "nothing gathered between steps"
    return summary


def test_help_shows_every_default():
    text = build_parser().format_help()
    options = re.split(r"\n  (?=--)", text.split("options:", 1)[1])[1:]
    assert len(options) >= 15
    for option in options:
        assert "(default" in option, option


def test_batches_and_schedule():
    train_data, val_data = load_corpus()
    assert train_data.numel() > 500_000 and val_data.numel() > 50_000
    x, y = get_batch(train_data, 4, 16, batch_generator(0, rank=1, step=7))
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    x2, _ = get_batch(train_data, 4, 16, batch_generator(0, rank=0, step=7))
    assert not torch.equal(x, x2), "ranks must read different batches"
    vx, vy = val_windows(val_data, 16, 256)
    assert vx.shape == (16, 16) and torch.equal(vx[:, 1:], vy[:, :-1])
    assert lr_multiplier(9, 10, 100) == 1.0
    assert lr_multiplier(100, 10, 100) == pytest.approx(0.1)


@pytest.mark.timeout(60)
def test_train_in_process_loss_decreases(tmp_path, one_thread):
    cfg = replace(TINY, steps=30, lr=1e-2, out=str(tmp_path), progress=False)
    summary = train(cfg)
    _check_outputs(tmp_path, ["adamw"], 30, 1)
    loss = summary["runs"]["adamw"]["loss"]
    assert loss[0] == pytest.approx(math.log(256), abs=0.3)
    assert sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 - 1.0
    assert summary["runs"]["adamw"]["val_loss"] < loss[0] - 1.0


@pytest.mark.timeout(90)
def test_the_default_run_trains_adamw_and_muon_from_the_same_weights(tmp_path, one_thread):
    """No --optimizer: AdamW and Muon, each from the seeded weights on the same batches (the same
    first loss), plotted against step and wall time; AdamW alone with a checkpoint directory."""
    flags = ["--steps", "12", "--warmup", "3", "--val-tokens", "512", "--no-progress", "--out", str(tmp_path)]
    cfg, _ = parse_args([*TINY_FLAGS, *flags])
    assert cfg.optimizer is None and optimizer_names(cfg) == list(DEFAULT_OPTIMIZERS) == ["adamw", "muon"]
    runs = train(cfg)["runs"]
    _check_outputs(tmp_path, ["adamw", "muon"], 12, 1)
    adamw, muon = runs["adamw"], runs["muon"]
    assert adamw["init_params_sha256"] == muon["init_params_sha256"]
    assert adamw["loss"][0] == muon["loss"][0]  # before any step: the same weights on the same batch
    assert adamw["loss"][1:] != muon["loss"][1:] and adamw["params_sha256"] != muon["params_sha256"]
    for run in (adamw, muon):
        assert sum(run["loss"][-3:]) / 3 < run["loss"][0] - 0.5
    # a checkpointed run is one optimizer's: AdamW unless --optimizer names one
    assert optimizer_names(parse_args(["--checkpoint-dir", "d"])[0]) == ["adamw"]
    assert optimizer_names(parse_args(["--checkpoint-dir", "d", "--optimizer", "muon"])[0]) == ["muon"]
    assert optimizer_names(parse_args(["--optimizer", "muon,adamw"])[0]) == ["muon", "adamw"]
    assert optimizer_names(parse_args(["--optimizer", "all"])[0]) == list(OPTIMIZERS)
    for bad in (
        ["--optimizer", "sgd"],
        ["--optimizer", "adamw,adamw"],
        ["--optimizer", "adamw,"],
        ["--checkpoint-dir", "d", "--optimizer", "adamw,muon"],
    ):
        with pytest.raises(SystemExit):
            parse_args(bad)


@pytest.mark.timeout(90)
def test_param_dtype_bf16_trains_on_cpu(tmp_path, one_thread):
    """`--param-dtype bf16` on the CPU (fp32 is its default there, bf16 on CUDA): every
    optimizer gathers bf16 parameters over fp32 shards, and the run's loss falls."""
    assert parse_args([])[0].param_dtype is None
    cfg = parse_args([*TINY_FLAGS, "--param-dtype", "bf16"])[0]
    assert cfg.param_dtype == "bf16"
    with pytest.raises(SystemExit):
        parse_args(["--param-dtype", "fp16"])
    bf16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    assert mixed_precision(TrainConfig(), torch.device("cuda", 1)) == bf16
    assert mixed_precision(TrainConfig(), torch.device("cpu")) == {}
    assert mixed_precision(TrainConfig(param_dtype="fp32"), torch.device("cuda")) == {}
    for zero in (3, 2):
        for name in OPTIMIZERS:
            for dtype, want in ((None, torch.float32), ("bf16", torch.bfloat16)):
                opt = OPTIMIZERS[name](GPT(TINY.model_config()), replace(TINY, zero=zero, param_dtype=dtype))
                assert {u.full.data.dtype for u in opt.units} == {want}, (zero, name, dtype)
                assert {u.shard.dtype for u in opt.units} == {torch.float32}, (zero, name, dtype)
    summary = train(replace(TINY, steps=30, lr=1e-2, out=str(tmp_path), progress=False, param_dtype="bf16"))
    _check_outputs(tmp_path, ["adamw"], 30, 1)
    assert summary["param_dtype"] == "bf16"
    loss = summary["runs"]["adamw"]["loss"]
    assert sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 - 1.0
    assert summary["runs"]["adamw"]["val_loss"] < loss[0] - 1.0
    assert train(replace(TINY, steps=1, out=str(tmp_path / "fp32"), progress=False))["param_dtype"] == "fp32"


@pytest.mark.timeout(120)
def test_all_optimizers_start_from_the_same_weights_and_zero_modes_agree(tmp_path, one_thread):
    runs = {}
    for zero in (3, 2):
        out = tmp_path / str(zero)
        cfg = replace(TINY, optimizer="all", zero=zero, steps=3, out=str(out), progress=False)
        runs[zero] = train(cfg)["runs"]
        _check_outputs(out, list(OPTIMIZERS), 3, 1)
    first = {(zero, name): run["loss"][0] for zero in runs for name, run in runs[zero].items()}
    assert len(set(first.values())) == 1, first
    # One process: the same math whether the parameters are sharded or not. The clipping norm sums
    # per-unit parts, so its last bits depend on the units; Muon's bf16 Newton-Schulz turns that into
    # flipped roundings (loss 5e-6 apart after 3 steps), the others stay within 1e-6.
    for name in OPTIMIZERS:
        rel = 1e-4 if name == "muon" else 1e-6
        assert runs[3][name]["loss"] == pytest.approx(runs[2][name]["loss"], rel=rel), name


@pytest.mark.timeout(180)
@pytest.mark.parametrize("zero", [3, 2])
def test_cli_two_ranks(tmp_path, zero):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "vescale_optim.demo", "--world-size", "2", "--steps", "5"]
    names = ["adamw", "muon"] if zero == 3 else ["adamw"]  # ZeRO-3: the default run, both optimizers
    cmd += [] if zero == 3 else ["--optimizer", "adamw"]
    proc = subprocess.run(
        [*cmd, "--zero", str(zero), *TINY_FLAGS, "--val-tokens", "512", "--out", str(out), "--no-progress"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = _check_outputs(out, names, 5, 2)
    assert summary["config"]["zero"] == zero
    assert "averaged over the last 5 steps" in proc.stdout and "over 512 held-out tokens" in proc.stdout
    assert "params MiB" in proc.stdout and "peak RSS" in proc.stdout
    model = GPT(replace(TINY, seq_len=32, d_model=32, n_layers=1, n_heads=2).model_config())
    whole = sum(p.numel() * 4 for p in model.parameters())
    params = [b["parameters"] for b in summary["runs"]["adamw"]["held_bytes"]]
    if zero == 3:  # each rank holds its shard: half of every unit, plus alignment
        assert sum(params) >= whole and all(p < 0.55 * whole for p in params), (params, whole)
    else:  # each rank holds every parameter
        assert params == [whole, whole]


@pytest.mark.timeout(120)
def test_resume_continues_bit_for_bit_in_process(tmp_path, one_thread):
    """Checkpoints every 3 steps; a run resumed from step 3 ends with the weights and losses
    of the uninterrupted one, and reads the same batches after the checkpoint."""
    ckpt = tmp_path / "ckpt"
    cfg = replace(TINY, steps=6, lr=1e-2, progress=False, checkpoint_dir=str(ckpt), checkpoint_every=3)
    whole = train(replace(cfg, out=str(tmp_path / "whole")))["runs"]["adamw"]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-3", "step-6"]
    assert (whole["final_step"], whole["resumed_from_step"]) == (6, 0)

    with pytest.raises(ValueError, match="already holds checkpoints .* pass --resume"):
        train(replace(cfg, out=str(tmp_path / "refused")))
    shutil.rmtree(ckpt / "step-6")
    resumed = train(replace(cfg, out=str(tmp_path / "resumed"), resume=True))["runs"]["adamw"]
    assert (resumed["final_step"], resumed["resumed_from_step"]) == (6, 3)
    assert resumed["params_sha256"] == whole["params_sha256"]
    assert resumed["loss"] == whole["loss"]
    assert resumed["time_s"][:3] == whole["time_s"][:3]  # the checkpoint's; then the resumed run's own
    _check_outputs(tmp_path / "resumed", ["adamw"], 6, 1)


def test_checkpoint_flags_are_checked():
    assert parse_args(["--resume", "--checkpoint-dir", "d"])[0].resume
    for bad in (
        ["--resume"],
        ["--checkpoint-dir", "d", "--optimizer", "all"],
        ["--checkpoint-every", "0"],
        ["--timeout", "0"],
    ):
        with pytest.raises(SystemExit):
            parse_args(bad)


@pytest.mark.timeout(120)
def test_muon_variants_train_from_the_same_weights(tmp_path, one_thread):
    """--muon-variant: Muon, Polar Express and NorMuon each train from the seeded weights."""
    runs = {}
    for variant in ("muon", "polar", "normuon"):
        flags = [
            "--optimizer",
            "muon",
            "--muon-variant",
            variant,
            "--steps",
            "8",
            "--warmup",
            "2",
            "--val-tokens",
            "512",
            "--no-progress",
            "--out",
            str(tmp_path / variant),
        ]
        cfg, _ = parse_args([*TINY_FLAGS, *flags])
        assert cfg.muon_variant == variant
        runs[variant] = train(cfg)["runs"]["muon"]
    assert len({run["init_params_sha256"] for run in runs.values()}) == 1
    assert len({run["params_sha256"] for run in runs.values()}) == 3
    for run in runs.values():
        assert run["loss"][-1] < run["loss"][0]
    with pytest.raises(SystemExit):
        parse_args(["--muon-variant", "adam"])
