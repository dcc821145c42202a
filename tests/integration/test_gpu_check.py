"""The prepared GPU checks, exercised as far as a CPU allows.

`benchmarks/gpu_check.sh --cpu` rehearses every stage of the one-GPU validation (world-1 gloo
groups with the collectives forced, the Triton interpreter, tiny sizes; ~45 s on 2 idle
cores): the report lists every stage with a status, nothing that can run on CPU is skipped or
failed, and exactly the CUDA-only checks are skipped, by name, with the reason. The stage
runner kills a stage that outlives its limit and goes on; the overlap analysis reads a CUDA
trace (synthetic here); the dry runs of both scripts name every stage; the one-GPU script
refuses to run without a GPU; the multi-GPU script's HSDP and kill stages run on 2 gloo ranks.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import _gpu_stages as stages  # noqa: E402
from benchmarks import gpu_check  # noqa: E402

pytestmark = pytest.mark.slow  # make test-fast leaves it out

SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
MULTI = ROOT / "benchmarks" / "gpu_multi.sh"
STAGES = [
    "env",
    "single_gpu",
    "zero3",
    "delay",
    "syncs",
    "overlap_selftest",
    "overlap",
    "meta",
    "memory",
    "checkpoint",
    "nan",
    "batch_invariance",
    "large_shapes",
    "tests",
    "steps",
]
OPTIONAL = ["kernels"]  # with --kernels (or --stages kernels), last
# the checks that need CUDA: skipped on CPU, each with its reason
CUDA_ONLY = {
    "env.cuda",
    "env.nccl",
    "kernels.triton rows",
    "overlap.kernels",
    "overlap.injection",
    "single_gpu.sleep",
    "delay.sleep",
    "memory.between_steps",
    "memory.peak_low",
    "memory.peak_high",
    "large_shapes.quantize.2^31",
    *(f"syncs.{kind}.{phase}" for kind in ("adamw32", "muon") for phase in ("backward", "step")),
    "syncs.shampoo.backward",
    "syncs.shampoo.step_refresh",
    "syncs.shampoo.step_plain",
}


def _bash(script: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(script), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_scripts_parse():
    for script in (SCRIPT, MULTI):
        subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)


@pytest.mark.parametrize("mode", ["gpu", "cpu"])
def test_dry_run_names_every_stage(tmp_path, mode):
    cpu = ["--cpu"] if mode == "cpu" else []
    proc = _bash(SCRIPT, "--dry-run", *cpu, str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    heads = [line.split()[0] for line in proc.stdout.splitlines() if line.startswith("[")]
    warm = ["[warm]"] if mode == "gpu" else []  # Triton's cache, filled in the background
    assert heads == warm + [f"[{s}]" for s in STAGES] + ["[report]"]
    text = proc.stdout
    interpret = "TRITON_INTERPRET=0" if mode == "gpu" else "TRITON_INTERPRET=1"
    assert (
        f"{interpret} HYPOTHESIS_PROFILE=ci python -m pytest" in text
        and ("tests/kernels/test_kernels_quant.py" in text) == (mode == "gpu")  # on CPU `make test` runs them
        and "tests/shard/test_local_copies.py" in text
        and "-p benchmarks._pytest_live" in text
    )
    assert ("-n 8 -p benchmarks._pytest_live" in text) == (mode == "gpu")
    assert "VESCALE_OPTIM_FORCE_COLLECTIVES=1" in text
    limits = [
        int(line.split("(limit ")[1].split()[0])
        for line in text.splitlines()
        if line.startswith("[") and "(limit " in line
    ]
    assert len(limits) == len(STAGES) and all(lim > 0 for lim in limits)
    total = int(text.split("stage limits add up to ")[1].split()[0])
    assert total == sum(limits) + gpu_check.SETUP_S
    if mode == "gpu":  # the slot: 7 minutes at most, the set-up included
        assert total <= gpu_check.BUDGET_S["gpu"] <= 420
    kernels = _bash(SCRIPT, "--dry-run", "--kernels", *cpu, str(tmp_path / "out")).stdout
    heads = [line.split()[0] for line in kernels.splitlines() if line.startswith("[")]
    assert heads == warm + [f"[{s}]" for s in STAGES + OPTIONAL] + ["[report]"]
    assert "--no-compile" in kernels if mode == "cpu" else "--no-compile" not in kernels
    assert not (tmp_path / "out").exists()


def test_the_budget_holds_whatever_the_stages(tmp_path):
    """A budget spent before a stage skips it, even when the stages were named."""
    out = tmp_path / "out"
    proc = _bash(SCRIPT, "--cpu", str(out), "--stages", "overlap_selftest", "--budget", "12", timeout=120)
    report = json.loads((out / "report.json").read_text())
    stage = report["stages"][0]
    assert stage["stage"] == "overlap_selftest" and stage.get("budget_spent"), stage
    assert proc.returncode == 1 and report["budget_s"] == 12
    assert (out / "summary.md").exists() and (out / "gpu_check.tar.gz").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_refuses_to_run_without_a_gpu(tmp_path):
    proc = _bash(SCRIPT, str(tmp_path / "out"))
    assert proc.returncode == 2 and "--cpu" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(900)
def test_cpu_rehearsal_runs_every_stage(tmp_path):
    out = tmp_path / "gpu_check"
    proc = _bash(SCRIPT, "--cpu", "--kernels", str(out), timeout=880)
    report = json.loads((out / "report.json").read_text())
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    by_stage = {r["stage"]: r for r in report["stages"]}
    assert list(by_stage) == STAGES + OPTIONAL and report["mode"] == "cpu" and report["passed"]
    # the two files that come back: the summary (printed too) and everything else packed
    summary = (out / "summary.md").read_text()
    assert len(summary.encode()) < 8000 and summary.startswith("# GPU check (cpu): PASSED")
    assert all(f"| {name} | " in summary for name in STAGES) and summary.strip() in proc.stdout
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        packed = set(tar.getnames())
    assert {"gpu_check/report.json", "gpu_check/report.md", "gpu_check/overlap_trace.json"} <= packed
    assert all(f"gpu_check/{name}.log" in packed for name in STAGES)
    assert by_stage["overlap_selftest"]["status"] == "passed"
    assert by_stage["single_gpu"]["status"] == by_stage["delay"]["status"] == "passed"
    assert by_stage["tests"]["measurements"]["passed"] > 0 and (out / "tests.jsonl").exists()
    for name, r in by_stage.items():
        assert r["status"] in ("passed", "failed", "skipped") and r["seconds"] >= 0, r
        assert "== [" in proc.stdout and f"] {name} (limit" in proc.stdout  # printed as it ran
    skipped = {s["check"]: s["reason"] for s in report["skipped_checks"]}
    assert set(skipped) == CUDA_ONLY, set(skipped) ^ CUDA_ONLY
    assert all(reason.startswith("needs CUDA") for reason in skipped.values()), skipped
    for r in report["stages"]:  # everything else ran and passed
        for c in r["checks"]:
            assert c["status"] == ("skipped" if f"{r['stage']}.{c['name']}" in CUDA_ONLY else "passed"), (
                r,
                c,
            )
    assert {n for n, r in by_stage.items() if r["status"] != "passed"} == set()
    # the syncs stage: CUDA's count skipped, the host reads within the same bounds checked
    reads = {c["name"]: c for c in by_stage["syncs"]["checks"] if c["name"].endswith(".host_reads")}
    assert {f"syncs.{name[: -len('.host_reads')]}" for name in reads} == {
        c for c in CUDA_ONLY if c.startswith("syncs.")
    }
    assert all(c["status"] == "passed" and c["measured"] == c["bound"] for c in reads.values()), reads

    zero3 = by_stage["zero3"]["measurements"]["rows"]
    assert {(r["optimizer"], r["sharding"]) for r in zero3} == {
        (k, s) for k in ("adamw32", "adamw8", "muon", "shampoo") for s in ("zero3", "zero2")
    }
    assert all(r["collectives"] > 0 for r in zero3)  # the force switch made a world of one talk
    overlap = by_stage["overlap"]["measurements"]
    assert (out / overlap["trace"]).exists() and len(overlap["blocks"]) == 3
    assert {r["block"] for r in overlap["blocks"]} == {"blocks.1", "blocks.2", "blocks.3"}
    assert by_stage["meta"]["measurements"]["buffers"] == ["rotary.inv_freq"]
    staging = by_stage["checkpoint"]["measurements"]
    assert staging["sync"]["save_s"] > 0 and staging["async"]["staging"] is not None

    kernels = json.loads((out / "kernels_kernels.json").read_text())
    assert {(r["kernel"], r["backend"]) for r in kernels["rows"]} == {
        (k, "torch")
        for k in ("newton_schulz", "newton_schulz polar_express", "quantize", "dequantize", "adamw8bit")
    }
    assert all(r["ms"] > 0 and r["% of peak"] is None for r in kernels["rows"])
    host = kernels["env"]["host"]
    assert host["cpu"] and host["native_bf16"] and host["threads_per_rank"][0] >= 1
    steps = {r["optimizer"]: r for r in json.loads((out / "kernels_steps.json").read_text())["steps"]}
    assert set(steps) == {
        "torch.optim.AdamW",
        "vo.AdamW",
        "vo.AdamW 8-bit",
        "vo.Shampoo",
        "torch.optim.Muon",
        "vo.Muon",
    }
    assert steps["vo.AdamW"]["max |diff|"] < 1e-6 and steps["vo.Muon"]["max |diff|"] < 1e-6
    logs = (out / "kernels.log").read_text() + (out / "steps.log").read_text()
    assert "| kernel" in logs and "| optimizer" in logs and "host: " in logs
    md = (out / "report.md").read_text()
    assert all(f"## {name}: " in md for name in STAGES + OPTIONAL)


def test_a_stage_that_hangs_or_crashes_is_failed_and_the_next_runs(tmp_path, capsys):
    def fake(name, code, limit=30):
        return stages.Stage(
            name,
            lambda r, **kw: None,
            {"cpu": limit, "gpu": limit},
            f"fake {name}",
            plan=lambda m, c=code: [c],
        )

    result = {
        "stage": "good",
        "status": "passed",
        "reason": None,
        "measurements": {},
        "error": None,
        "checks": [{"name": "x", "status": "passed", "measured": 1, "bound": 2, "detail": None}],
    }
    codes = {
        "hangs": "import time; time.sleep(60)",
        "crashes": "import os; print('about to die', flush=True); os._exit(3)",
        "good": f"import sys; open(sys.argv[1] + '/good.json', 'w').write({json.dumps(json.dumps(result))})",
    }
    fakes = [
        fake("hangs", codes["hangs"], limit=6),
        fake("crashes", codes["crashes"]),
        fake("good", codes["good"]),
    ]
    rc = stages.run_all(
        fakes,
        mode="cpu",
        out=tmp_path,
        title="t",
        budget=120,
        command=lambda s: [sys.executable, "-c", s.plan("cpu")[0], str(tmp_path)],
    )
    report = json.loads((tmp_path / "report.json").read_text())
    got = {r["stage"]: r for r in report["stages"]}
    assert rc == 1 and not report["passed"]
    assert got["hangs"]["status"] == "failed" and "ran out of its 6 s" in got["hangs"]["reason"]
    assert got["hangs"]["seconds"] < 20
    assert got["crashes"]["status"] == "failed" and "exited with 3" in got["crashes"]["reason"]
    assert "about to die" in got["crashes"]["error"]
    assert got["good"]["status"] == "passed"
    printed = capsys.readouterr().out
    assert printed.index("hangs") < printed.index("crashes") < printed.index("good")


def test_a_warm_up_runs_beside_the_first_stages_and_the_warm_ones_wait_for_it(tmp_path, monkeypatch):
    """gpu_check's set-up fills Triton's cache in the background (`Warmup`): a stage not marked
    `warm` runs meanwhile, one marked `warm` starts only once it is done, the warm-up is reported
    first, and a stage's `compiled_kernels` counts the cache entries it added itself."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    fill = f"import time, os; time.sleep(3); [os.mkdir(os.path.join({str(cache)!r}, w)) for w in 'abc']"
    warmup = stages.Warmup(
        [sys.executable, "-c", fill], limit=30, log=tmp_path / "warm.log", env=stages.child_env("cpu")
    )
    seen = tmp_path / "seen"
    codes = {  # each writes what it saw of the cache; the warm one compiles 2 kernels of its own
        "early": f"import os; open({f'{seen}.early'!r}, 'w').write(str(len(os.listdir({str(cache)!r}))))",
        "late": f"import os; open({str(seen) + '.late'!r}, 'w').write(str(len(os.listdir({str(cache)!r}))));"
        f"[os.mkdir(os.path.join({str(cache)!r}, f'k{{i}}')) for i in range(2)]",
    }
    fakes = [
        stages.Stage(
            n, lambda r, **kw: None, {"cpu": 30, "gpu": 30}, n, plan=lambda m, c=c: [c], warm=n == "late"
        )
        for n, c in codes.items()
    ]
    stages.run_all(
        fakes,
        mode="cpu",
        out=tmp_path,
        title="t",
        budget=120,
        warmup=warmup,
        command=lambda s: [sys.executable, "-c", s.plan("cpu")[0]],
    )
    report = json.loads((tmp_path / "report.json").read_text())
    assert [r["stage"] for r in report["stages"]] == ["warm", "early", "late"]
    assert report["stages"][0]["status"] == "passed" and report["stages"][0]["seconds"] >= 3
    assert (tmp_path / "seen.early").read_text() == "0" and (tmp_path / "seen.late").read_text() == "3"
    late = report["stages"][2]
    assert late["compiled_kernels"] == 2 and "compiled_kernels" not in report["stages"][1]
    assert "| warm |" in (tmp_path / "report.md").read_text()


def test_a_sync_of_eigh_is_told_apart_by_its_location():
    """The syncs stage counts torch.linalg.eigh's own error check apart: the warning CUDA gives
    names torch's C++ location first and the Python caller's last (as seen on the first H200
    slot, where the first parenthesis was taken for the location and 8 eigh syncs were counted)."""
    from benchmarks import _gpu_library as lib
    from vescale_optim.optim import _shampoo_math

    path = _shampoo_math.__file__
    lines = Path(path).read_text().splitlines()
    eigh = next(i for i, line in enumerate(lines, 1) if "torch.linalg.eigh(" in line)
    torch_own = "(Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:162.)"
    assert lib._is_eigh(f"called a synchronizing CUDA operation {torch_own} ({path}:{eigh})")
    assert not lib._is_eigh(f"called a synchronizing CUDA operation {torch_own} ({path}:{eigh - 1})")


def _x(name, ts, dur, cat, tid=1, **args):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": tid, "args": args}


def _cuda_trace(gather_lead: float, copies: bool = False) -> list[dict]:
    """A backward over blocks.2 -> blocks.1 -> blocks.0 (autograd thread 2), each block's
    compute kernels launched inside its pre/post_backward window; during each block's
    backward the gather of the block before it is issued (a NCCL AllGather kernel, or at
    world size 1 a device-to-device copy), starting `gather_lead` us before the block's last
    compute kernel."""
    ev = [_x("gpu_check::backward", 0, 1000, "user_annotation")]
    corr = iter(range(1, 1000))
    for k, t0 in ((2, 100), (1, 400), (0, 700)):
        ev.append(_x(f"vescale::pre_backward[blocks.{k}]", t0, 5, "user_annotation", tid=2))
        last = None
        for j in range(3):  # three compute kernels, launched in the window, run later on the GPU
            c = next(corr)
            ev.append(_x("cudaLaunchKernel", t0 + 10 + 10 * j, 2, "cuda_runtime", tid=2, correlation=c))
            last = t0 + 50 + 60 * j
            ev.append(_x(f"sm90_gemm_{k}_{j}", last, 50, "kernel", correlation=c, stream=7))
        ev.append(_x(f"vescale::post_backward[blocks.{k}]", t0 + 200, 5, "user_annotation", tid=2))
        if k > 0:  # the prefetch of the block before, issued from its unshard range
            c = next(corr)
            ev.append(_x(f"vescale::unshard[blocks.{k - 1}]", t0 + 20, 5, "user_annotation", tid=2))
            ev.append(
                _x(
                    "cudaMemcpyAsync" if copies else "cudaLaunchKernelExC",
                    t0 + 21,
                    1,
                    "cuda_runtime",
                    tid=2,
                    correlation=c,
                )
            )
            name = "Memcpy DtoD (Device -> Device)" if copies else "ncclDevKernel_AllGather_RING_LL(...)"
            ev.append(
                _x(
                    name,
                    last - gather_lead,
                    20,
                    "gpu_memcpy" if copies else "kernel",
                    correlation=c,
                    stream=21,
                )
            )
    return ev


@pytest.mark.parametrize("copies", [False, True])
def test_overlap_analysis_of_a_cuda_trace(copies):
    blocks = ["blocks.0", "blocks.1", "blocks.2"]
    good = gpu_check.analyse_overlap(_cuda_trace(30.0, copies), blocks, cuda=True)
    assert good["method"].startswith("one-rank copies" if copies else "all-gather kernels")
    assert [(r["block"], r["gather_of"], r["ok"], r["lead_us"]) for r in good["blocks"]] == [
        ("blocks.1", "blocks.0", True, 30.0),
        ("blocks.2", "blocks.1", True, 30.0),
    ]
    assert good["blocks"][0]["gather_stream"] == 21 and good["blocks"][0]["compute_stream"] == 7
    late = gpu_check.analyse_overlap(_cuda_trace(-10.0, copies), blocks, cuda=True)
    assert [r["ok"] for r in late["blocks"]] == [False, False]


def test_multi_dry_run_names_every_stage(tmp_path):
    for args in ([], ["--cpu"]):
        proc = _bash(MULTI, "--dry-run", *args, str(tmp_path / "out"))
        assert proc.returncode == 0, proc.stderr
        heads = [line.split()[0] for line in proc.stdout.splitlines() if line.startswith("[")]
        stages = ["env", "readme", "resume", "hsdp", "kill", "tp", "fsdp_bench", "report"]
        assert heads == [f"[{s}]" for s in stages]
        runs = [line for line in proc.stdout.splitlines() if "runs: " in line]
        n = "8" if not args else "2"
        assert any(f"--nproc-per-node {n} " in line and "_gpu_worker.py kill" in line for line in runs)
        assert any("train_torchrun.py" in line and "--checkpoint-dir" in line for line in runs)
        for script in ("fsdp.py", "hsdp.py"):
            assert any(f"--nproc-per-node {n} " in line and f"{script} --torchrun" in line for line in runs)
    assert not (tmp_path / "out").exists()


def test_multi_refuses_by_name_with_too_few_gpus(tmp_path):
    """On fewer GPUs than a stage starts ranks, the stage is refused by name; with none that fits
    (one GPU, or none here) the script does not start a rank at all."""
    from benchmarks import _gpu_multi as multi

    stages, refusal = multi.fitting(multi.STAGES, 1)
    assert "needs a GPU per rank" in refusal and "1 GPU(s) are visible" in refusal
    assert "gpu_check.sh" in refusal
    assert {s.name: s.refused for s in stages}["tp"] == "needs 8 GPUs, 1 visible"
    stages, refusal = multi.fitting(multi.STAGES, 8)
    assert refusal is None and not any(s.refused for s in stages)
    proc = _bash(MULTI, str(tmp_path / "out"))  # this machine: no GPU
    assert proc.returncode == 2 and "0 GPU(s) are visible" in proc.stderr, proc.stdout + proc.stderr
    assert not (tmp_path / "out" / "report.json").exists()


@pytest.mark.timeout(600)
def test_multi_cpu_rehearsal_of_hsdp_and_kill(tmp_path):
    out = tmp_path / "gpu_multi"
    proc = _bash(MULTI, "--cpu", str(out), "--stages", "hsdp", "kill", "fsdp_bench", timeout=500)
    report = json.loads((out / "report.json").read_text())
    got = {r["stage"]: r for r in report["stages"]}
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert got["hsdp"]["status"] == "passed" and got["kill"]["status"] == "passed", proc.stdout[-4000:]
    bench = got["fsdp_bench"]
    assert bench["status"] == "passed", bench
    assert [c["name"] for c in bench["checks"]] == ["fsdp.py", "hsdp.py"]
    fsdp, hsdp = bench["measurements"]["fsdp"], bench["measurements"]["hsdp"]
    assert fsdp["world"] == hsdp["world"] == 2 and fsdp["backend"] == "gloo"
    assert set(fsdp["ours_vs_fsdp2"]) == {"wide ours Z3 AdamW", "wide ours Z3 Muon"}
    assert set(hsdp["ours_vs_fsdp2"]) == {"ours 2x1 AdamW", "ours 2x1 Muon"}
    for row in [*fsdp["ours_vs_fsdp2"].values(), *hsdp["ours_vs_fsdp2"].values()]:
        assert row["train x"] > 0 and row["step x"] > 0
    assert all(row["peak live x"] > 0 for row in fsdp["ours_vs_fsdp2"].values())
    survivors = got["kill"]["measurements"]["survivors"]
    assert len(survivors) == 1 and "did not complete" in survivors[0]["message"]
