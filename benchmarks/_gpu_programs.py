"""The stages of `benchmarks/gpu_check.py` that look around the library or run other programs:
`env` (versions, the device, the library imported from this tree), `tests` (pytest of the tests
that touch the device), `steps` and `kernels` (`benchmarks/kernels.py`). Each fills a `Result`
(see `_gpu_stages`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from benchmarks._gpu_common import KERNEL_TESTS, NEEDS_CUDA, _torch, nccl_version
from benchmarks._gpu_stages import ROOT, Result

# the CUDA path of the meta-device TP materialisation (units/shard_init.py, units/cuda_draw.py)
# beside the kernels: shard-sized chunked fills bitwise the whole draw, one chunk of scratch, the
# self-check refuting a wrong geometry, a parameter over 2^31 bytes drawn in torch's pieces
SHARD_INIT_CUDA = [
    f"tests/units/test_shard_init.py::test_on_cuda_{name}"
    for name in (
        "a_shard_drawn_chunk_by_chunk_is_bitwise_its_box",
        "no_scratch_is_larger_than_one_chunk",
        "a_geometry_its_self_check_refutes_is_drawn_whole_with_a_warning",
        "a_parameter_over_2_gib_is_drawn_in_the_pieces_torch_launches",
    )
]
TESTS = [*KERNEL_TESTS, "tests/shard/test_local_copies.py", *SHARD_INIT_CUDA]
# the --cpu rehearsal runs the stage on one file: `make test` runs the kernel tests themselves
CPU_TESTS = ["tests/shard/test_local_copies.py"]


def stage_env(r: Result, *, out: Path, mode: str) -> None:
    torch = _torch()
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError as e:
        info["triton"] = None
        info["triton_error"] = str(e)
    import vescale_optim

    info["vescale_optim"] = vescale_optim.__version__
    info["vescale_optim_path"] = str(Path(vescale_optim.__file__).resolve().parent)
    here = Path(vescale_optim.__file__).resolve().is_relative_to(ROOT)
    r.check("vescale_optim from this tree", here, measured=info["vescale_optim_path"], bound=str(ROOT))
    triton_error = None if info["triton"] else info.get("triton_error")
    r.check("triton importable", info["triton"] is not None, measured=info["triton"], detail=triton_error)
    if mode == "gpu":
        ok = torch.cuda.is_available()
        r.check("cuda", ok, measured=torch.cuda.device_count() if ok else 0, detail="CUDA devices visible")
        if ok:
            props = torch.cuda.get_device_properties(0)
            info.update(
                device=props.name,
                capability=f"sm_{props.major}{props.minor}",
                memory_gib=round(props.total_memory / 2**30, 1),
                sms=props.multi_processor_count,
                devices=torch.cuda.device_count(),
            )
            info["nccl"] = nccl_version()
            r.check("nccl", info["nccl"] is not None, measured=info["nccl"])
    else:
        r.skip("cuda", f"{NEEDS_CUDA}: --cpu rehearses on this machine's CPU")
        r.skip("nccl", f"{NEEDS_CUDA}: --cpu uses gloo")
    smi = shutil.which("nvidia-smi")
    if smi:
        query = "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit"
        proc = subprocess.run([smi, query, "--format=csv"], capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = proc.stdout.strip() or proc.stderr.strip()
    for key, value in info.items():
        print(f"{key}: {value}")
    r.measure(**info)


def pytest_workers(mode: str) -> list[str]:
    """`-n 8` on the GPU machine (pytest-xdist is there), `-n 2` on CPU; none without xdist."""
    import importlib.util

    if importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", "8" if mode == "gpu" else "2"]


def stage_tests(r: Result, *, out: Path, mode: str) -> None:
    """The tests that touch the device (`TESTS`), compiled on the GPU, with pytest-xdist; each
    result is appended to `tests.jsonl` as it finishes (`benchmarks/_pytest_live.py`), and
    pytest is stopped before the stage's own limit, so a timeout keeps the counts."""
    live = out / "tests.jsonl"
    live.unlink(missing_ok=True)
    limit = float(os.environ.get("GPU_CHECK_STAGE_LIMIT_S", "600"))
    env = dict(os.environ, TRITON_INTERPRET="1" if mode == "cpu" else "0", HYPOTHESIS_PROFILE="ci")
    env["GPU_CHECK_TESTS_LOG"] = str(live)
    workers = pytest_workers(mode)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "benchmarks._pytest_live"]
    cmd += [*workers, *(TESTS if mode == "gpu" else CPU_TESTS)]
    print("$ TRITON_INTERPRET=" + env["TRITON_INTERPRET"], " ".join(cmd), flush=True)
    detached = dict(stdout=sys.stdout, stderr=subprocess.STDOUT, start_new_session=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, **detached)
    timed_out = False
    try:
        rc = proc.wait(timeout=max(limit - 12, 5))
    except subprocess.TimeoutExpired:
        timed_out, rc = True, None
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    results = [json.loads(line) for line in live.read_text().splitlines()] if live.exists() else []
    counts = {k: sum(x["outcome"] == k for x in results) for k in ("passed", "failed", "skipped")}
    failed = [x["nodeid"] for x in results if x["outcome"] == "failed"]
    r.measure(**counts, failed_tests=failed[:50], exit_code=rc, timed_out=timed_out, compiled=mode == "gpu")
    r.measure(workers=workers[1] if workers else 1)
    r.check(
        "tests",
        rc == 0 and counts["passed"] > 0 and not timed_out,
        measured=f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped",
        detail=("failed: " + ", ".join(failed[:10]) + ("; " if timed_out else "") if failed else "")
        + (f"stopped after {limit - 12:.0f} s (the counts are those finished)" if timed_out else "")
        + ("" if failed or timed_out else "compiled on the GPU" if mode == "gpu" else "Triton interpreter")
        + ("" if workers else " (serial: no pytest-xdist)"),
    )


def kernels_cmd(mode: str, section: str, out: Path | None = None) -> list[str]:
    """`benchmarks/kernels.py --quick` of one section, its JSON to `out/kernels_SECTION.json`
    (without `out`: as --dry-run prints it, relative paths, OUT)."""
    script, path = ROOT / "benchmarks" / "kernels.py", (out or Path("OUT")) / f"kernels_{section}.json"
    flags = ["--no-compile"] if mode == "cpu" else []
    script = str(script if out else script.relative_to(ROOT))
    return [script, "--quick", "--sections", section, *flags, "--out", str(path)]


def _kernels_bench(r: Result, out: Path, mode: str, section: str) -> dict | None:
    path = out / f"kernels_{section}.json"
    path.unlink(missing_ok=True)
    cmd = [sys.executable, *kernels_cmd(mode, section, out)]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, stdout=sys.stdout, stderr=subprocess.STDOUT)
    result = json.loads(path.read_text()) if path.exists() else None
    r.check(
        f"benchmarks/kernels.py --sections {section}",
        proc.returncode == 0 and result is not None,
        measured=f"exit {proc.returncode}",
        detail=None if mode == "gpu" else "torch rows only on CPU (no Triton rows, no torch.compile)",
    )
    return result


def stage_kernels(r: Result, *, out: Path, mode: str) -> None:
    result = _kernels_bench(r, out, mode, "kernels")
    if result:
        r.measure(device=result["device"], rows=result["rows"])
        if mode == "cpu":
            r.skip("triton rows", f"{NEEDS_CUDA}: the interpreter is not a benchmark")


def stage_steps(r: Result, *, out: Path, mode: str) -> None:
    result = _kernels_bench(r, out, mode, "steps")
    if result:
        r.measure(device=result["device"], steps=result["steps"])
