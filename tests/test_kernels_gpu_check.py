"""The prepared GPU check, exercised as far as a CPU allows: the script parses, its dry run
names every stage, it refuses to run without a GPU, and the benchmark it calls runs with its
CPU fallback (torch rows and the optimizer steps; no Triton rows, no torch.compile here)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _bash(*args, **kw):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, **kw)


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


def test_dry_run_names_every_stage(tmp_path):
    proc = _bash("--dry-run", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["[env]", "[tests]", "[kernels]", "[steps]", "[report]"]
    tests, kernels, steps = lines[1], lines[2], lines[3]
    assert "TRITON_INTERPRET=0" in tests and "tests/test_kernels_quant.py" in tests
    assert "--sections kernels" in kernels and "--no-compile" not in kernels
    assert "--sections steps" in steps
    limits = sum(int(line.split("(limit ")[1].split()[0]) for line in lines[:4])
    assert limits < 8 * 60
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_refuses_to_run_without_a_gpu(tmp_path):
    proc = _bash(str(tmp_path / "out"))
    assert proc.returncode == 2 and "--cpu" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(240)
def test_benchmark_runs_on_cpu(tmp_path):
    out = tmp_path / "kernels.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "kernels.py"), "--quick", "--no-compile"]
    cmd += ["--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    kernels = {(r["kernel"], r["backend"]) for r in result["rows"]}
    assert kernels == {(k, "torch") for k in ("newton_schulz", "quantize", "dequantize", "adamw8bit")}
    assert all(r["ms"] > 0 and r["% of peak"] is None for r in result["rows"])
    steps = {r["optimizer"]: r for r in result["steps"]}
    assert set(steps) == {"torch.optim.AdamW", "vo.AdamW", "vo.AdamW 8-bit", "vo.Shampoo",
                          "torch.optim.Muon", "vo.Muon"}
    assert steps["vo.AdamW"]["max |diff|"] < 1e-6 and steps["vo.Muon"]["max |diff|"] < 1e-6
    assert "| kernel" in proc.stdout and "| optimizer" in proc.stdout
    host = result["env"]["host"]
    assert host["cpu"] and host["native_bf16"] and host["threads_per_rank"][0] >= 1
    assert "host: " in proc.stdout
