"""The one-shot validation a lent GPU runs first (one H100/H200, 7 minutes at most).

Every stage runs in a process of its own under its own time limit (a failed or hung stage
does not stop the next), is printed as it ends, and is reported as `passed`, `failed` or
`skipped` (with the reason), with its checks, their measurements and bounds. The limits and
the set-up add up to at most 420 s (`BUDGET_S`); each stage's limit is also cut to what is
left of `--budget`, whatever `--stages` says. `gpu_check.sh OUT` ends with two files to bring
back: `OUT/summary.md` (under 8 KB, also printed) and `OUT/gpu_check.tar.gz` (report.json,
report.md, every stage's log and JSON, the traces). In the order they run (`STAGES`: the
library's own checks first, ordered by the evidence they give; the tests, then the kernel
throughput, `kernels` only with `--kernels`):

  env              GPU, driver, torch, CUDA, NCCL, Triton; the library imported from this tree
  single_gpu       ZeRO-3 AdamW (32-bit, 8-bit reduction) and Muon with no process group vs
                   torch.optim, plainly and with ~2 ms of torch.cuda._sleep on the side streams
                   before every stand-in of a collective (CPU: under delayed())
  zero3            ZeRO-3 and ZeRO-2 on a world-1 group with VESCALE_OPTIM_FORCE_COLLECTIVES=1:
                   vo.AdamW (32/8-bit), vo.Muon, vo.Shampoo vs torch.optim / the plain Shampoo
  delay            every collective after ~2 ms of _sleep on its stream: ZeRO-3 bit-identical
  syncs            set_sync_debug_mode("warn") around backward and step() (ZeRO-3 AdamW, Muon,
                   Shampoo, skip_nonfinite): at most 1 host sync per backward (the no_sync()
                   agreement), 1 per step() (Shampoo's refresh: 2 besides eigh's own); on CPU
                   the same bounds on the reads of tensor values (shard.host_reads)
  overlap_selftest the overlap analyser on synthetic traces (pure: the same on CPU)
  overlap          a profiled ZeRO-3 step of 4 blocks: per unit, the share of its compute-stream
                   backward kernels after AG(k-1) starts; a _sleep of half a unit's backward on
                   the gather stream must not grow the backward by units x sleep
  meta             a model built on the meta device (a buffer-only rotary embedding included)
                   equals the model built normally; nothing left on meta
  memory           max_memory_allocated() of a ZeRO-3 step vs memory_stats() and the parameters
  checkpoint       CheckpointManager sync and async round trips continue exactly; staging time
  nan              NaN/Inf through quantize, dequantize and the 8-bit update: Triton vs torch
  batch_invariance Shampoo's tile math and newton_schulz alone vs in a batch of 8
  large_shapes     newton_schulz of 8192x28672 and 32x2880x5760 (Muon's and Polar Express's
                   coefficients), quantize of > 2^31 elements
  tests            pytest -n 8 of the kernel and stand-in tests, compiled; results as they finish
  steps            benchmarks/kernels.py --quick --sections steps (world-1 steps vs torch.optim)
  kernels          (--kernels) benchmarks/kernels.py --quick --sections kernels (torch.compile)

    bash benchmarks/gpu_check.sh OUT                    # the run; OUT/summary.md, OUT/gpu_check.tar.gz
    python benchmarks/gpu_check.py --cpu [OUT]          # rehearse every stage on CPU (gloo, interpreter)
    python benchmarks/gpu_check.py --dry-run [OUT]      # print the stages, their limits and the total
    python benchmarks/gpu_check.py --stages zero3 nan   # some stages only (still within --budget)

Set-up starts a warm-up beside the first stages (`start_warmup`): Triton's cache
(`OUT/triton_cache`, or TRITON_CACHE_DIR) is filled with every kernel the dispatcher can launch,
compiled once on the host's cores; the stages that launch many kernels in fresh processes (nan,
batch_invariance, large_shapes, tests under pytest -n 8, steps, kernels) wait for it, and each
stage's `compiled_kernels` (report and summary) counts what it still compiled cold. The limits are
the seconds each stage took on the first H200 slot, with a margin (`WARM_S`'s comment).

With `--cpu` every stage runs at small sizes (world-1 gloo groups, the Triton interpreter);
checks that need CUDA are `skipped`, by name, with the reason, after running as much of their
stage as a CPU allows. The exit status is 0 when no stage failed, 2 without a CUDA device.
Only torch >= 2.9 APIs are used (the machine has torch 2.11, Triton 3.6, pytest-xdist).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._gpu_common import FORCE, KERNEL_TESTS, NEEDS_CUDA, SIZES  # noqa: E402
from benchmarks._gpu_library import (  # noqa: E402
    stage_checkpoint,
    stage_delay,
    stage_memory,
    stage_meta,
    stage_single_gpu,
    stage_syncs,
    stage_zero3,
)
from benchmarks._gpu_numerics import stage_batch_invariance, stage_large_shapes, stage_nan  # noqa: E402
from benchmarks._gpu_overlap import analyse_overlap, stage_overlap, stage_overlap_selftest  # noqa: E402
from benchmarks._gpu_stages import (  # noqa: E402
    ROOT,
    Result,
    Stage,
    Warmup,
    child_env,
    dry_run,
    run_all,
    run_stage_here,
)

__all__ = ["STAGES", "analyse_overlap", "main"]

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_check"
SETUP_S = 15  # the script's own start, the CUDA check and the packing of the results
# Triton's cache warmed in the background (`start_warmup`) on half the host's cores, leaving the rest
# to the stages beside it: on the first H200 slot (16 cores, all of them) it took 124 s while the
# library's stages ran; the first stage that waits for it comes ~2.5 minutes in. The limits below
# are the seconds each stage took there (2026-12-04: 236 s in all; tests cut at 63 s with 167 of
# its tests done, 172 kernels compiled cold) with a margin of about half again.
WARM_S = 180
BUDGET_S = {"gpu": 420, "cpu": 900}  # the whole run, set-up included; stage limits are cut to what is left
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
TESTS = [*KERNEL_TESTS, "tests/shard/test_stand_ins.py", *SHARD_INIT_CUDA]
# the --cpu rehearsal runs the stage on one file: `make test` runs the kernel tests themselves
CPU_TESTS = ["tests/shard/test_stand_ins.py"]
SUMMARY_BYTES = 8000


def _torch():
    import torch

    return torch


# --- env, tests, kernels, steps ------------------------------------------------------------------


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
    r.check(
        "vescale_optim from this tree",
        Path(vescale_optim.__file__).resolve().is_relative_to(ROOT),
        measured=info["vescale_optim_path"],
        bound=str(ROOT),
    )
    r.check(
        "triton importable",
        info["triton"] is not None,
        measured=info["triton"],
        detail=None if info["triton"] else info.get("triton_error"),
    )
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
            import torch.distributed as dist

            nccl = dist.is_nccl_available()
            version = torch.cuda.nccl.version() if nccl else None
            info["nccl"] = version if isinstance(version, int | None) else ".".join(map(str, version))
            r.check("nccl", nccl, measured=info["nccl"])
    else:
        r.skip("cuda", f"{NEEDS_CUDA}: --cpu rehearses on this machine's CPU")
        r.skip("nccl", f"{NEEDS_CUDA}: --cpu uses gloo")
    smi = shutil.which("nvidia-smi")
    if smi:
        q = "name,driver_version,memory.total,clocks.max.sm,power.limit"
        proc = subprocess.run(
            [smi, f"--query-gpu={q}", "--format=csv"], capture_output=True, text=True, timeout=20
        )
        info["nvidia_smi"] = proc.stdout.strip() or proc.stderr.strip()
    for key, value in info.items():
        print(f"{key}: {value}")
    r.measure(**info)


def _pytest_workers(mode: str) -> list[str]:
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
    env = dict(os.environ, TRITON_INTERPRET="1" if mode == "cpu" else "0", HYPOTHESIS_PROFILE="ci",
               GPU_CHECK_TESTS_LOG=str(live))  # fmt: skip
    workers = _pytest_workers(mode)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "benchmarks._pytest_live",
           *workers, *(TESTS if mode == "gpu" else CPU_TESTS)]  # fmt: skip
    print("$ TRITON_INTERPRET=" + env["TRITON_INTERPRET"], " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sys.stdout, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
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
    r.measure(**counts, failed_tests=failed[:50], exit_code=rc, timed_out=timed_out, compiled=mode == "gpu",
              workers=workers[1] if workers else 1)  # fmt: skip
    r.check(
        "tests",
        rc == 0 and counts["passed"] > 0 and not timed_out,
        measured=f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped",
        detail=("failed: " + ", ".join(failed[:10]) + ("; " if timed_out else "") if failed else "")
        + (f"stopped after {limit - 12:.0f} s (the counts are those finished)" if timed_out else "")
        + ("" if failed or timed_out else "compiled on the GPU" if mode == "gpu" else "Triton interpreter")
        + ("" if workers else " (serial: no pytest-xdist)"),
    )


def _kernels_bench(r: Result, out: Path, mode: str, section: str) -> dict | None:
    path = out / f"kernels_{section}.json"
    path.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "kernels.py"),
        "--quick",
        "--sections",
        section,
        "--out",
        str(path),
    ] + (["--no-compile"] if mode == "cpu" else [])
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


# --- the stages -----------------------------------------------------------------------------------


def _limits(gpu: int, cpu: int = 180) -> dict[str, int]:
    """Seconds per mode. On CPU a limit only guards against a hang: a rehearsal on a loaded
    machine runs several times slower than on two idle cores."""
    return {"gpu": gpu, "cpu": cpu}


def _group(mode: str) -> str:
    return (
        "a world-1 NCCL group (file store, device_id=cuda:0)" if mode == "gpu" else "a world-1 gloo group"
    ) + (" with VESCALE_OPTIM_FORCE_COLLECTIVES=1")


def _kernels_cmd(mode: str, section: str) -> str:
    flags = " --no-compile" if mode == "cpu" else ""
    out = f"OUT/kernels_{section}.json"
    return f"python benchmarks/kernels.py --quick --sections {section}{flags} --out {out}"


def _plans() -> dict:
    """What each stage runs, by mode (for --dry-run)."""
    z = lambda m: SIZES[m]  # noqa: E731
    slow = lambda m: "~2 ms of torch.cuda._sleep" if m == "gpu" else "delayed() (emulated)"  # noqa: E731
    return {
        "env": lambda m: [
            "torch, CUDA, NCCL, Triton versions; nvidia-smi --query-gpu=name,driver_version,..."
        ],
        "single_gpu": lambda m: [
            f"no process group: Net(dim {z(m)['dim']}) x ZeRO-3 vo.AdamW (32-bit, reduce_bits=8), vo.Muon "
            f"vs torch.optim, plain and with {slow(m)} on the side streams before each stand-in"
        ],
        "zero3": lambda m: [
            f"{_group(m)}: Net(dim {z(m)['dim']}, {z(m)['blocks']} blocks) x vo.AdamW 32/8-bit, vo.Muon, "
            "vo.Shampoo x ZeRO-3, ZeRO-2, 3-4 steps, vs torch.optim.AdamW / torch.optim.Muon / plain Shampoo"
        ],
        "delay": lambda m: [f"{_group(m)}: ZeRO-3 AdamW, Muon with {slow(m)} before every collective"],
        "syncs": lambda m: [
            f"{_group(m)}: warm ZeRO-3 AdamW, Muon and Shampoo steps under set_sync_debug_mode('warn')"
        ],
        "overlap_selftest": lambda m: ["analyse_overlap on synthetic CUDA traces (accept / reject)"],
        "overlap": lambda m: [
            f"{_group(m)}: torch.profiler trace of a ZeRO-3 step, 4 blocks of dim {z(m)['overlap_dim']}, "
            "-> OUT/overlap_trace.json; backward with _sleep on the gather stream"
        ],
        "meta": lambda m: [
            f"{_group(m)}: Net built under torch.device('meta'), shard_modules, device= the group's device"
        ],
        "memory": lambda m: [f"{_group(m)}: a ZeRO-3 AdamW step, 4 blocks of dim {z(m)['mem_dim']}"],
        "checkpoint": lambda m: [
            f"{_group(m)}: CheckpointManager(async_save=False/True), save at 3, resume to 6"
        ],
        "nan": lambda m: [
            f"quantize/dequantize/adamw8bit_update_ of {z(m)['nan_n']:,} elements with NaN/Inf"
        ],
        "batch_invariance": lambda m: [
            f"update_factors_/inverse_roots_/precondition, d in {z(m)['shampoo_dims']}, K=1 vs 8; "
            f"newton_schulz {z(m)['ns_shape']} alone vs 8 (triton, torch; Muon's and Polar Express's "
            "coefficients)"
        ],
        "large_shapes": lambda m: [
            f"newton_schulz {' and '.join('x'.join(map(str, s)) for s in z(m)['big_ns'])} (bf16, Muon's "
            "and Polar Express's coefficients); "
            f"quantize/dequantize of {z(m)['big_quant']:,} elements"
        ],
        "tests": lambda m: [
            f"TRITON_INTERPRET={'1' if m == 'cpu' else '0'} HYPOTHESIS_PROFILE=ci python -m pytest -q "
            f"-n {'8' if m == 'gpu' else '2'} -p benchmarks._pytest_live "
            + " ".join(TESTS if m == "gpu" else CPU_TESTS)
            + " (-> OUT/tests.jsonl as they finish)"
        ],
        "steps": lambda m: [_kernels_cmd(m, "steps")],
        "kernels": lambda m: [_kernels_cmd(m, "kernels")],
    }


# In the order they run, by the evidence they give: the library's own checks first, the tests,
# then the kernels' throughput (`kernels`, mostly torch.compile, only with --kernels).
STAGES = [
    Stage("env", stage_env, _limits(20), "GPU, driver, torch, CUDA, NCCL, Triton; the library from here"),
    Stage("single_gpu", stage_single_gpu, _limits(30), "ZeRO-3 with no process group, stand-ins delayed"),
    Stage("zero3", stage_zero3, _limits(22), "ZeRO-3/ZeRO-2, forced world-1 group, vs torch.optim", FORCE),
    Stage("delay", stage_delay, _limits(20), "every collective delayed: ZeRO-3 bit-identical", FORCE),
    Stage("syncs", stage_syncs, _limits(22), "host syncs in backward (0) and step() (<= 1)", FORCE),
    Stage("overlap_selftest", stage_overlap_selftest, _limits(6, 60), "the overlap analyser on fake traces"),
    Stage("overlap", stage_overlap, _limits(22), "AG(k-1) beside k's backward; slow AG hidden", FORCE),
    Stage("meta", stage_meta, _limits(20), "meta-device init equals one built normally", FORCE),
    Stage("memory", stage_memory, _limits(20), "peak allocated of ZeRO-3 vs memory_stats()", FORCE),
    Stage("checkpoint", stage_checkpoint, _limits(22), "CheckpointManager sync and async resumes", FORCE),
    Stage("nan", stage_nan, _limits(20), "NaN/Inf through the 8-bit kernels: Triton vs torch", warm=True),
    Stage("batch_invariance", stage_batch_invariance, _limits(20), "Shampoo tiles, newton_schulz: 1 vs 8",
          warm=True),
    Stage("large_shapes", stage_large_shapes, _limits(22), "large newton_schulz, > 2^31 quantize", warm=True),
    Stage("tests", stage_tests, _limits(110, 400), "pytest -n 8 of the kernel and stand-in tests, compiled",
          warm=True),
    Stage("steps", stage_steps, _limits(18), "world-1 optimizer steps vs torch.optim (kernels.py)",
          warm=True),
    Stage("kernels", stage_kernels, _limits(130), "Triton vs torch vs torch.compile (kernels.py)", warm=True),
]
OPTIONAL = {"kernels"}  # run only when asked for (--kernels, or named in --stages)
for _s in STAGES:
    _s.plan = _plans()[_s.name]


# --- the two files that come back -----------------------------------------------------------------


def summary(report: dict, limit: int = SUMMARY_BYTES) -> str:
    """`summary.md`: the verdict, one line per stage, every failed check and the key numbers,
    cut to under `limit` bytes (the rest is in the archive)."""
    lines = [
        f"# GPU check ({report['mode']}): {'PASSED' if report['passed'] else 'FAILED'}",
        "",
        f"{report['host']['hostname']}, {report['seconds']} s of {report['budget_s']:.0f} s; "
        + "; ".join(report.get("notes", [])[:1]),
        "",
        "| stage | status | s | compiled | reason |",
        "|---|---|---:|---:|---|",
    ]
    for r in report["stages"]:
        reason = (r["reason"] or "").replace("|", "/").replace("\n", " ")[:140]
        compiled = r.get("compiled_kernels", "")
        lines.append(f"| {r['stage']} | {r['status']} | {r['seconds']} | {compiled} | {reason} |")
    env = next((r for r in report["stages"] if r["stage"] == "env"), None)
    if env:
        m = env["measurements"]
        keys = ("device", "torch", "cuda", "nccl", "triton", "capability", "memory_gib")
        lines += ["", "env: " + ", ".join(f"{k} {m[k]}" for k in keys if k in m)]
    lines += ["", "## checks not passed", ""]
    for r in report["stages"]:
        for c in r["checks"]:
            if c["status"] == "failed":
                where = f"{r['stage']}.{c['name']}"
                text = f"- FAIL {where}: {c['measured']} (bound {c['bound']}) {c['detail'] or ''}"
                lines.append(text[:400])
        if r.get("error"):
            lines.append(f"- ERROR {r['stage']}: {r['error'].strip().splitlines()[-1][:300]}")
    skipped = [s["check"] for s in report.get("skipped_checks", [])]
    if skipped:
        lines.append(f"- skipped: {', '.join(skipped)}"[:1200])
    lines += ["", "## measured", ""]
    for r in report["stages"]:
        for c in r["checks"]:
            if c["status"] == "passed" and c["measured"] is not None:
                bound = f" (bound {str(c['bound'])[:40]})" if c["bound"] is not None else ""
                lines.append(f"- {r['stage']}.{c['name']}: {str(c['measured'])[:80]}{bound}")
    text, tail = "", "\n(cut: the rest is in gpu_check.tar.gz: report.md, report.json)\n"
    for line in lines:
        if len((text + line + "\n").encode()) > limit - len(tail):
            return text + tail
        text += line + "\n"
    return text


def pack(out: Path) -> Path:
    """`gpu_check.tar.gz` of everything under `out` but itself and `summary.md`."""
    archive = out / "gpu_check.tar.gz"
    archive.unlink(missing_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(out.iterdir()):
            if path.name not in (archive.name, "summary.md"):
                tar.add(path, arcname=f"gpu_check/{path.name}")
    return archive


def start_warmup(out: Path, arch: str) -> Warmup:
    """Triton's cache (`OUT/triton_cache`, unless TRITON_CACHE_DIR is set) filled for this GPU in
    the background while the first stages run: every kernel the dispatcher can launch, compiled
    once on the host's cores (`python -m vescale_optim.kernels.aot --warm`), so that the stages
    marked `warm` (8 pytest workers, the numerics stages) load them instead of each compiling."""
    os.environ.setdefault("TRITON_CACHE_DIR", str(out / "triton_cache"))
    out.mkdir(parents=True, exist_ok=True)
    jobs = str(max(1, (os.cpu_count() or 2) // 2))
    cmd = [sys.executable, "-m", "vescale_optim.kernels.aot", "--warm", "--arch", arch, "--jobs", jobs]
    return Warmup(cmd, limit=WARM_S, log=out / "warm.log", env=child_env("gpu"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument("out", nargs="?", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    ap.add_argument(
        "--cpu", action="store_true", help="rehearse every stage on CPU (gloo, Triton interpreter)"
    )
    ap.add_argument("--dry-run", action="store_true", help="print the stages, their limits and the total")
    ap.add_argument("--stages", nargs="+", choices=[s.name for s in STAGES], help="run these only")
    ap.add_argument("--kernels", action="store_true", help="also run the kernels stage (torch.compile), last")
    ap.add_argument("--budget", type=float, help="seconds for the whole run, set-up included "
                    f"(default: {BUDGET_S['gpu']} on GPU, {BUDGET_S['cpu']} --cpu); honoured with --stages")
    ap.add_argument("--stage", help=argparse.SUPPRESS)  # internal: run one stage in this process
    ap.add_argument("--mode", choices=["gpu", "cpu"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    mode = args.mode or ("cpu" if args.cpu else "gpu")
    out = args.out.resolve()
    if args.stage:
        return run_stage_here(STAGES, args.stage, out, mode=mode)
    if args.stages:
        stages = [s for s in STAGES if s.name in args.stages]
    else:
        stages = [s for s in STAGES if s.name not in OPTIONAL or args.kernels]
    budget = args.budget if args.budget is not None else BUDGET_S[mode]
    script = str(Path(__file__).resolve())
    command = lambda s: [sys.executable, script, "--stage", s.name, "--mode", mode, str(out)]  # noqa: E731
    if args.dry_run:
        if mode == "gpu":
            print(f"[warm] (background, limit {WARM_S} s) Triton's cache filled: python -m "
                  "vescale_optim.kernels.aot --warm --arch <this GPU's>; stages marked warm wait for it")
        dry_run(stages, mode, out, command, budget, setup=SETUP_S)
        return 0
    warmup = None
    if mode == "gpu":
        ask = "import torch; print(''.join(map(str, torch.cuda.get_device_capability())))"
        proc = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True)
        if proc.returncode != 0:
            print(
                f"no CUDA device visible to {sys.executable}; use --cpu to rehearse the stages on CPU",
                file=sys.stderr,
            )
            return 2
        warmup = start_warmup(out, proc.stdout.strip())
    notes = [f"python {sys.executable}", f"every stage in its own process; limits cut to the {mode} budget"]
    rc = run_all(stages, mode=mode, out=out, title="GPU check", budget=budget, command=command, notes=notes,
                 setup=SETUP_S, warmup=warmup)  # fmt: skip
    text = summary(json.loads((out / "report.json").read_text()))
    (out / "summary.md").write_text(text)
    archive = pack(out)
    print("\n" + text, flush=True)
    print(f"bring back: {out / 'summary.md'} and {archive}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
