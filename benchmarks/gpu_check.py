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
                   before every local copy that replaces a collective (CPU: under delayed())
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
  tests            pytest -n 8 of the kernel and local-copy tests, compiled; results as they finish
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

import json
import os
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._gpu_async import stage_delay, stage_single_gpu  # noqa: E402
from benchmarks._gpu_common import FORCE, SIZES  # noqa: E402
from benchmarks._gpu_library import stage_checkpoint, stage_memory, stage_meta, stage_syncs, stage_zero3  # noqa: E402
from benchmarks._gpu_numerics import stage_batch_invariance, stage_large_shapes, stage_nan  # noqa: E402
from benchmarks._gpu_overlap import analyse_overlap, stage_overlap, stage_overlap_selftest  # noqa: E402
from benchmarks._gpu_programs import (  # noqa: E402
    CPU_TESTS,
    TESTS,
    kernels_cmd,
    stage_env,
    stage_kernels,
    stage_steps,
    stage_tests,
)
from benchmarks._gpu_report import pack, summary  # noqa: E402
from benchmarks._gpu_stages import (  # noqa: E402
    ROOT,
    Stage,
    Warmup,
    child_env,
    dry_run,
    parser,
    run_all,
    run_stage_here,
    stage_command,
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


# --- the stages -----------------------------------------------------------------------------------


def _limits(gpu: int, cpu: int = 180) -> dict[str, int]:
    """Seconds per mode. On CPU a limit only guards against a hang: a rehearsal on a loaded
    machine runs several times slower than on two idle cores."""
    return {"gpu": gpu, "cpu": cpu}


def _group(mode: str) -> str:
    return (
        "a world-1 NCCL group (file store, device_id=cuda:0)" if mode == "gpu" else "a world-1 gloo group"
    ) + (" with VESCALE_OPTIM_FORCE_COLLECTIVES=1")


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
            f"vs torch.optim, plain and with {slow(m)} on the side streams before each local copy"
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
        "steps": lambda m: ["python " + " ".join(kernels_cmd(m, "steps"))],
        "kernels": lambda m: ["python " + " ".join(kernels_cmd(m, "kernels"))],
    }


# In the order they run, by the evidence they give: the library's own checks first, the tests,
# then the kernels' throughput (`kernels`, mostly torch.compile, only with --kernels).
STAGES = [
    Stage("env", stage_env, _limits(20), "GPU, driver, torch, CUDA, NCCL, Triton; the library from here"),
    Stage("single_gpu", stage_single_gpu, _limits(30), "ZeRO-3 with no process group, local copies delayed"),
    Stage("zero3", stage_zero3, _limits(22), "ZeRO-3/ZeRO-2, forced world-1 group, vs torch.optim", FORCE),
    Stage("delay", stage_delay, _limits(20), "every collective delayed: ZeRO-3 bit-identical", FORCE),
    Stage("syncs", stage_syncs, _limits(22), "host syncs in backward (0) and step() (<= 1)", FORCE),
    Stage("overlap_selftest", stage_overlap_selftest, _limits(6, 60), "the overlap analyser on fake traces"),
    Stage("overlap", stage_overlap, _limits(22), "AG(k-1) beside k's backward; slow AG hidden", FORCE),
    Stage("meta", stage_meta, _limits(20), "meta-device init equals one built normally", FORCE),
    Stage("memory", stage_memory, _limits(20), "peak allocated of ZeRO-3 vs memory_stats()", FORCE),
    Stage("checkpoint", stage_checkpoint, _limits(22), "CheckpointManager sync and async resumes", FORCE),
    Stage("nan", stage_nan, _limits(20), "NaN/Inf through the 8-bit kernels: Triton vs torch", warm=True),
    Stage(
        "batch_invariance",
        stage_batch_invariance,
        _limits(20),
        "Shampoo tiles, newton_schulz: 1 vs 8",
        warm=True,
    ),
    Stage("large_shapes", stage_large_shapes, _limits(22), "large newton_schulz, > 2^31 quantize", warm=True),
    Stage(
        "tests",
        stage_tests,
        _limits(110, 400),
        "pytest -n 8 of the kernel and local-copy tests, compiled",
        warm=True,
    ),
    Stage(
        "steps", stage_steps, _limits(18), "world-1 optimizer steps vs torch.optim (kernels.py)", warm=True
    ),
    Stage("kernels", stage_kernels, _limits(130), "Triton vs torch vs torch.compile (kernels.py)", warm=True),
]
OPTIONAL = {"kernels"}  # run only when asked for (--kernels, or named in --stages)
for _s in STAGES:
    _s.plan = _plans()[_s.name]


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
    helps = dict(
        cpu="rehearse every stage on CPU (gloo, Triton interpreter)", kernels="also run the kernels stage"
    )
    helps["kernels"] += " (torch.compile), last"
    helps["dry_run"] = "print the stages, their limits and the total"
    default = f"(default: {BUDGET_S['gpu']} on GPU, {BUDGET_S['cpu']} --cpu)"
    helps["budget"] = f"seconds for the whole run, set-up included {default}; honoured with --stages"
    ap = parser(__doc__, STAGES, DEFAULT_OUT, **helps)
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
    command = stage_command(Path(__file__).resolve(), mode, out)
    if args.dry_run:
        if mode == "gpu":
            print(
                f"[warm] (background, limit {WARM_S} s) Triton's cache filled: python -m "
                "vescale_optim.kernels.aot --warm --arch <this GPU's>; stages marked warm wait for it"
            )
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
    run = dict(
        mode=mode, out=out, title="GPU check", budget=budget, command=command, notes=notes, setup=SETUP_S
    )
    rc = run_all(stages, **run, warmup=warmup)
    text = summary(json.loads((out / "report.json").read_text()))
    (out / "summary.md").write_text(text)
    archive = pack(out)
    print("\n" + text, flush=True)
    print(f"bring back: {out / 'summary.md'} and {archive}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
