"""The one-shot validation a lent GPU runs first (one H100/H200, under 10 minutes).

Every stage runs in a process of its own under its own time limit (a failed or hung stage
does not stop the next), is printed as it ends, and is reported in
`benchmarks/results/gpu_check/report.json` and `report.md` as `passed`, `failed` or
`skipped` (with the reason), with its checks, their measurements and bounds. In the order
they run (`STAGES`: the library's checks first, the throughput benchmark last):

  env              GPU, driver, torch, CUDA, NCCL, Triton; the library imported from this tree
  tests            the kernel tests compiled (TRITON_INTERPRET=0 pytest tests/test_kernels_ns.py
                   tests/test_kernels_quant.py tests/test_kernels_qcomm.py tests/test_kernels_no_triton.py)
  zero3            ZeRO-3 and ZeRO-2 on a world-1 group with VESCALE_OPTIM_FORCE_COLLECTIVES=1:
                   vo.AdamW (32/8-bit), vo.Muon, vo.Shampoo vs torch.optim / the plain Shampoo
  syncs            torch.cuda.set_sync_debug_mode("warn") around backward and step() (ZeRO-3
                   AdamW, Muon): 0 host syncs in backward, at most 1 in step()
  overlap          a profiler trace of a ZeRO-3 step of 4 blocks: the all-gather of unit k-1
                   starts before the last backward compute kernel of unit k
  memory           max_memory_allocated() of a ZeRO-3 step vs memory_stats() and the parameters
  meta             a model built on the meta device (a buffer-only rotary embedding included)
                   equals the model built normally; nothing left on meta
  checkpoint       CheckpointManager sync and async round trips continue exactly; staging time
  batch_invariance Shampoo's tile math and newton_schulz alone vs in a batch of 8
  nan              NaN/Inf through quantize, dequantize and the 8-bit update: Triton vs torch
  large_shapes     newton_schulz of 8192x28672 and 32x2880x5760, quantize of > 2^31 elements
  steps            benchmarks/kernels.py --quick --sections steps (world-1 steps vs torch.optim)
  kernels          benchmarks/kernels.py --quick --sections kernels (Triton vs torch vs compile)

    python benchmarks/gpu_check.py [OUT]              # or: bash benchmarks/gpu_check.sh [OUT]
    python benchmarks/gpu_check.py --cpu [OUT]        # rehearse every stage on CPU (gloo, interpreter)
    python benchmarks/gpu_check.py --dry-run [OUT]    # print the stages and their limits
    python benchmarks/gpu_check.py --stages zero3 nan # some stages only

With `--cpu` every stage that can run on CPU runs at small sizes (world-1 gloo groups, the
Triton interpreter); checks that need CUDA are `skipped`, by name, with the reason, after
running as much of their stage as a CPU allows. The exit status is 0 when no stage failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._gpu_stages import ROOT, Result, Stage, dry_run, run_all, run_stage_here  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_check"
BUDGET_S = {"gpu": 570, "cpu": 840}  # the whole run; each stage's limit is cut to what is left
KERNEL_TESTS = [
    "tests/test_kernels_ns.py", "tests/test_kernels_quant.py", "tests/test_kernels_qcomm.py",
    "tests/test_kernels_no_triton.py",
]
FORCE = {"VESCALE_OPTIM_FORCE_COLLECTIVES": "1"}
NEEDS_CUDA = "needs CUDA"
EPS32 = 2.0**-24  # fp32 unit roundoff
BF16_ULP = 2.0**-8  # one bf16 ulp, relative (8 bits of significand)

# Sizes by mode: the GPU's, and tiny ones for the CPU rehearsal (the Triton interpreter is slow).
SIZES = {
    "gpu": dict(
        dim=64,
        blocks=3,
        batch=(8, 32),
        overlap_dim=1024,
        overlap_batch=(8, 256),
        mem_dim=1024,
        mem_batch=(8, 256),
        shampoo_dims=(32, 128),
        ns_shape=(1024, 4096),
        nan_n=(1 << 20) + 123,
        big_ns=[(8192, 28672), (32, 2880, 5760)],
        big_quant=(1 << 31) + (1 << 20),
    ),
    "cpu": dict(
        dim=32,
        blocks=2,
        batch=(4, 16),
        overlap_dim=32,
        overlap_batch=(4, 16),
        mem_dim=32,
        mem_batch=(4, 16),
        shampoo_dims=(16, 32),
        ns_shape=(16, 48),
        nan_n=2048 + 37,
        big_ns=[(32, 112), (4, 24, 48)],
        big_quant=(1 << 16) + 256,
    ),
}


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


def stage_tests(r: Result, *, out: Path, mode: str) -> None:
    import xml.etree.ElementTree as ET

    junit = out / "tests.xml"
    env = dict(os.environ, TRITON_INTERPRET="1" if mode == "cpu" else "0", HYPOTHESIS_PROFILE="ci")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        *KERNEL_TESTS,
    ]
    print("$ TRITON_INTERPRET=" + env["TRITON_INTERPRET"], " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=sys.stdout, stderr=subprocess.STDOUT)
    counts = dict(tests=0, failures=0, errors=0, skipped=0)
    failed = []
    if junit.exists():
        root = ET.parse(junit).getroot()
        for suite in root.iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
        for case in root.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('classname')}::{case.get('name')}")
    r.measure(**counts, failed=failed[:50], exit_code=proc.returncode, compiled=mode == "gpu")
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    r.check(
        "kernel tests",
        proc.returncode == 0 and counts["tests"] > 0,
        measured=f"{passed} passed, "
        f"{counts['failures'] + counts['errors']} failed, {counts['skipped']} skipped",
        detail=("failed: " + ", ".join(failed[:10]))
        if failed
        else ("compiled on the GPU" if mode == "gpu" else "in the Triton interpreter"),
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


# --- zero3 ----------------------------------------------------------------------------------------


def stage_zero3(r: Result, *, out: Path, mode: str) -> None:
    """ZeRO-3 and ZeRO-2 on a world-1 group with the collectives forced, against torch.optim.

    Bounds (fp32 parameters, 3 steps; 4 for Shampoo, whose roots start at step 2):
    - AdamW 32-bit, Shampoo (fp64 roots): 1e-5. The gathered parameters are views of a flat
      buffer and the gradients are averaged by a collective, so cuBLAS and the reduction may
      round a gradient an ulp or two differently (relative 1e-7..1e-6); Adam's update
      lr * m/(sqrt(v)+eps) moves by about that relative amount of lr per step.
    - AdamW 8-bit vs fp32 torch.optim.AdamW: 2 * steps * lr. 8-bit moments are a different
      algorithm; each of the two moves an element by at most about lr per step (|m/sqrt(v)|
      <= 1 at the first step, about 1 after), so this bounds a broken update, not rounding.
      8-bit state does not depend on the layout, so ZeRO-3 8-bit is also held to ZeRO-2
      8-bit at 1e-5.
    - Muon: steps * max adjusted lr * 2^-6. torch.optim.Muon runs Newton-Schulz in bf16 with
      torch, ours with the Triton kernel on CUDA: outputs (|entries| < 1) may differ by a few
      bf16 ulps (4 ulps = 2^-6), each moving a parameter by that times the adjusted lr.
    """
    torch = _torch()
    from benchmarks import _gpu_models as gm
    from vescale_optim.shard.handle import traced

    dev, sz = gm.device_for(mode), SIZES[mode]
    steps = {k: 4 if k == "shampoo" else 3 for k in gm.KINDS}
    lr_adj = None
    with gm.world_of_one(dev):
        base = gm.build(sz["dim"], sz["blocks"], dev)
        lr_adj = gm.muon_max_adjusted_lr(base)
        tol = {
            "adamw32": 1e-5,
            "shampoo": 1e-5,
            "adamw8": 2 * steps["adamw8"] * gm.ADAMW["lr"],
            "muon": steps["muon"] * lr_adj * 2.0**-6,
        }
        finals, rows = {}, []
        for kind in gm.KINDS:
            ref = gm.fresh_copy(base)
            gm.train(ref, gm.make_reference(kind, ref), range(steps[kind]), sz["batch"], dev)
            want = gm.full_state(ref)
            for sharding in ("zero3", "zero2"):
                model = gm.fresh_copy(base)
                opt = gm.make_ours(kind, model, sharding)
                start = time.perf_counter()
                with traced() as trace:
                    gm.train(model, [opt], range(steps[kind]), sz["batch"], dev)
                gm.synchronize(dev)
                seconds = time.perf_counter() - start
                got = gm.full_state(model)
                finals[kind, sharding] = got
                diff, where = gm.max_diff(got, want)
                rows.append(
                    dict(
                        optimizer=kind,
                        sharding=sharding,
                        max_abs_diff=diff,
                        where=where,
                        collectives=len(trace),
                        units=len(opt.units),
                        seconds=round(seconds, 3),
                    )
                )
                vs = "torch.optim.AdamW (fp32)" if kind == "adamw8" else "the reference"
                r.check(
                    f"{kind}.{sharding}",
                    diff <= tol[kind],
                    measured=diff,
                    bound=tol[kind],
                    detail=f"max |param - {vs}| after {steps[kind]} steps (at {where}); "
                    f"{len(trace)} collectives issued",
                )
                if not trace:
                    r.fail(
                        f"{kind}.{sharding}.forced",
                        "no collective was issued: the force switch "
                        "VESCALE_OPTIM_FORCE_COLLECTIVES=1 did not take effect",
                    )
        diff, where = gm.max_diff(finals["adamw8", "zero3"], finals["adamw8", "zero2"])
        r.check(
            "adamw8.zero3_vs_zero2",
            diff <= 1e-5,
            measured=diff,
            bound=1e-5,
            detail=f"8-bit state does not depend on the layout (at {where})",
        )
    r.measure(
        rows=rows,
        tolerances=tol,
        muon_max_adjusted_lr=lr_adj,
        device=str(dev),
        backend="nccl" if dev.type == "cuda" else "gloo",
    )
    print(json.dumps(rows, indent=1))
    del torch


# --- syncs ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _sync_warnings(cuda: bool):
    """Warnings raised inside (all recorded), with CUDA's sync debug mode at "warn" on CUDA."""
    torch = _torch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")


def _sync_texts(caught) -> tuple[list[str], list[str]]:
    """(the sync warnings, the other warnings) as 'message (file:line)' strings."""
    syncs, other = [], []
    for w in caught:
        text = f"{str(w.message).strip().splitlines()[0][:200]} ({w.filename}:{w.lineno})"
        (syncs if "synchroniz" in str(w.message) else other).append(text)
    return syncs, other


def stage_syncs(r: Result, *, out: Path, mode: str) -> None:
    """Host synchronisations in a warm ZeRO-3 step (the second; the first builds state):
    goal 0 in backward, at most 1 in step() (counted, with the warnings' texts)."""
    from benchmarks import _gpu_models as gm

    dev, sz = gm.device_for(mode), SIZES[mode]
    cuda = dev.type == "cuda"
    found = {}
    with gm.world_of_one(dev):
        for kind in ("adamw32", "muon"):
            model = gm.build(sz["dim"], sz["blocks"], dev)
            opt = gm.make_ours(kind, model, "zero3")
            gm.train(model, [opt], range(1), sz["batch"], dev)  # first step: state, orders, NCCL set-up
            x, y = gm.batch(1, sz["batch"], dev)
            with _sync_warnings(cuda) as fwd:
                loss = gm.loss_of(model, x, y)
            with _sync_warnings(cuda) as bwd:
                loss.backward()
            with _sync_warnings(cuda) as step:
                opt.step()
            opt.zero_grad()
            gm.synchronize(dev)
            for phase, caught, goal in (("forward", fwd, None), ("backward", bwd, 0), ("step", step, 1)):
                syncs, other = _sync_texts(caught)
                found[f"{kind}.{phase}"] = {"syncs": len(syncs), "texts": syncs, "other_warnings": other}
                if goal is None:
                    continue
                name = f"{kind}.{phase}"
                if cuda:
                    r.check(
                        name,
                        len(syncs) <= goal,
                        measured=len(syncs),
                        bound=goal,
                        detail="; ".join(syncs) or "no synchronizing CUDA call",
                    )
                else:
                    r.skip(
                        name,
                        f"{NEEDS_CUDA}: torch.cuda.set_sync_debug_mode (the step ran on gloo "
                        f"with the warnings recorded: {len(other)} other warnings)",
                    )
    r.measure(**found)
    print(json.dumps(found, indent=1))


# --- overlap --------------------------------------------------------------------------------------

_UNIT_RANGE = re.compile(r"vescale::(unshard|pre_backward|post_backward)\[(.+)\]$")


def _trace_events(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    return [e for e in data.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]


def _gpu_gathers(ag, copies, unshards, unit_of, launches) -> tuple[str, list]:
    """The device events of the all-gathers as (unit, event, its `vescale::unshard` range).

    NCCL's AllGather kernels, mapped to units by the order of the unshard ranges when there are
    as many (one gather stream runs them in issue order), else by the range around each
    kernel's launch. A group of one rank launches no AllGather kernel: NCCL copies the send
    buffer into the receive buffer (`cudaMemcpyAsync`, a device-to-device copy), or does
    nothing when they are the same memory; then those copies, by the range around their launch
    (or by order)."""

    def around(e):
        launch = launches.get((e.get("args") or {}).get("correlation"))
        hits = [u for u in unshards if launch and u["ts"] <= launch["ts"] <= u["ts"] + u["dur"]]
        return hits[-1] if hits else None

    if ag and len(ag) == len(unshards):
        return "all-gather kernels, by order", [(unit_of[id(u)], g, u) for u, g in zip(unshards, ag)]
    if ag:
        return "all-gather kernels, by launch", [
            (unit_of[id(rng)] if rng else None, g, rng) for g in ag for rng in [around(g)]
        ]
    mine = [(unit_of[id(rng)], c, rng) for c in copies for rng in [around(c)] if rng is not None]
    if mine:
        return "one-rank copies, by launch", mine
    if copies and len(copies) == len(unshards):
        return "one-rank copies, by order", [(unit_of[id(u)], c, u) for u, c in zip(unshards, copies)]
    return f"none found ({len(ag)} all-gather kernels, {len(copies)} device copies)", []


def analyse_overlap(events: list[dict], blocks: list[str], cuda: bool) -> dict:
    """Per block k >= 1 of the backward: when the all-gather of block k-1 starts against the
    last backward compute of block k (the kernels launched between its `vescale::pre_backward`
    and `vescale::post_backward` ranges, on that thread). On CUDA both are device events
    (`_gpu_gathers`); on CPU the gather's issue (its `vescale::unshard` range) and the last
    CPU op: the same schedule, seen from the host."""
    ranges = {}
    for e in events:
        m = _UNIT_RANGE.match(e["name"])
        if m and e.get("cat") in ("user_annotation", "cpu_op", None):
            ranges.setdefault((m[1], m[2]), []).append(e)
    bwd = [e for e in events if e["name"] == "gpu_check::backward" and e.get("cat") != "gpu_user_annotation"]
    if not bwd:
        raise AssertionError("the trace has no gpu_check::backward range")
    b0, b1 = bwd[0]["ts"], bwd[0]["ts"] + bwd[0]["dur"]
    inside = lambda e: b0 <= e["ts"] <= b1  # noqa: E731
    unshards = sorted(
        (e for (kind, _), es in ranges.items() if kind == "unshard" for e in es), key=lambda e: e["ts"]
    )
    unit_of = {id(e): _UNIT_RANGE.match(e["name"])[2] for e in unshards}
    launches: dict = {}
    gathers: list[tuple[str | None, dict, dict | None]] = []  # (unit, the gather event, its unshard range)
    if cuda:
        kernels, copies = [], []
        for e in events:
            corr = (e.get("args") or {}).get("correlation")
            if corr is None:
                continue
            if e.get("cat") in ("cuda_runtime", "cuda_driver"):
                launches[corr] = e
            elif e.get("cat") == "kernel":
                kernels.append(e)
            elif e.get("cat") == "gpu_memcpy" and "DtoD" in e["name"]:
                copies.append(e)
        kernels.sort(key=lambda e: e["ts"])
        copies.sort(key=lambda e: e["ts"])
        ag = [k for k in kernels if re.match(r"nccl(Dev)?Kernel_AllGather", k["name"])]
        method, gathers = _gpu_gathers(ag, copies, unshards, unit_of, launches)
        compute = [k for k in kernels if not k["name"].startswith("nccl")]
    else:
        method = "issue"
        gathers = [(unit_of[id(u)], u, u) for u in unshards]
        compute = sorted(
            (e for e in events if e.get("cat") == "cpu_op" and e["name"].startswith("aten::")),
            key=lambda e: e["ts"],
        )
    per_block = []
    for k in range(1, len(blocks)):
        unit, before = blocks[k], blocks[k - 1]
        pre = [e for e in ranges.get(("pre_backward", unit), []) if inside(e)]
        post = [e for e in ranges.get(("post_backward", unit), []) if inside(e)]
        row = {"block": unit, "gather_of": before}
        if not pre or not post:
            row.update(ok=False, why=f"no vescale::pre_backward/post_backward range of {unit} in backward")
            per_block.append(row)
            continue
        w0, w1, tid = pre[0]["ts"], post[-1]["ts"] + post[-1]["dur"], pre[0].get("tid")

        def launched_in_window(e, w0=w0, w1=w1, tid=tid):
            launch = launches.get((e.get("args") or {}).get("correlation")) if cuda else e
            return launch is not None and w0 <= launch["ts"] <= w1 and launch.get("tid") == tid

        mine = [e for e in compute if launched_in_window(e)]
        # the gather of the unit before issued in backward (the forward's gathered it too)
        theirs = [g for u, g, rng in gathers if u == before and rng is not None and inside(rng)]
        if not mine or not theirs:
            row.update(
                ok=False,
                why=f"{len(mine)} compute events of {unit} in its backward, "
                f"{len(theirs)} backward gathers of {before}",
            )
            per_block.append(row)
            continue
        last, gather = max(e["ts"] for e in mine), theirs[0]
        row.update(
            gather_start_us=gather["ts"],
            last_compute_start_us=last,
            lead_us=round(last - gather["ts"], 1),
            compute_events=len(mine),
            ok=gather["ts"] < last,
        )
        if cuda:
            row.update(
                gather_stream=(gather.get("args") or {}).get("stream"),
                compute_stream=(mine[-1].get("args") or {}).get("stream"),
            )
        per_block.append(row)
    return {"method": method, "blocks": per_block, "gathers": len(gathers), "unshard_ranges": len(unshards)}


def stage_overlap(r: Result, *, out: Path, mode: str) -> None:
    torch = _torch()
    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks import _gpu_models as gm

    dev, sz = gm.device_for(mode), SIZES[mode]
    cuda = dev.type == "cuda"
    trace_path = out / "overlap_trace.json"
    with gm.world_of_one(dev):
        model = gm.build(sz["overlap_dim"], 4, dev, rotary=False)
        opt = gm.make_ours("adamw32", model, "zero3")
        gm.train(model, [opt], range(2), sz["overlap_batch"], dev)  # orders recorded, state built
        x, y = gm.batch(2, sz["overlap_batch"], dev)
        gm.synchronize(dev)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            with record_function("gpu_check::forward"):
                loss = gm.loss_of(model, x, y)
            with record_function("gpu_check::backward"):
                loss.backward()
            with record_function("gpu_check::step"):
                opt.step()
            opt.zero_grad()
            gm.synchronize(dev)
        prof.export_chrome_trace(str(trace_path))
        names = {id(u): u.name for u in opt.units}
        blocks = [
            names[id(u)]
            for b in model.blocks
            for u in opt.units
            if {id(p) for p in b.parameters()} <= {id(p) for p in u.params}
        ]
    events = _trace_events(trace_path)
    result = analyse_overlap(events, blocks, cuda)
    r.measure(trace=trace_path.name, units=list(names.values()), **result)
    print(json.dumps(result, indent=1))
    what = (
        "the all-gather kernel of unit k-1 starts before the last backward compute kernel of unit k"
        if cuda
        else "CPU rehearsal: the gather of unit k-1 is issued before the last op of unit k"
    )
    for row in result["blocks"]:
        name = f"{'kernels' if cuda else 'issue'}.{row['block']}"
        r.check(
            name,
            row["ok"],
            measured=row.get("lead_us"),
            bound="> 0 us",
            detail=row.get("why") or f"{what} (gather of {row['gather_of']})",
        )
    if not result["blocks"]:
        r.fail("blocks", f"found no blocks among the units {list(names.values())}")
    if not cuda:
        r.skip("kernels", f"{NEEDS_CUDA}: NCCL's all-gather kernels and CUDA compute kernels on streams")
    del torch


# --- memory ---------------------------------------------------------------------------------------


def stage_memory(r: Result, *, out: Path, mode: str) -> None:
    """Peak allocated bytes of a warm ZeRO-3 AdamW step against the prediction.

    World 1: the shards are whole. Between steps a rank holds what `memory_stats()` says
    (parameters, gradients, state; `unsharded` 0). During the step: plus the activations and
    the gradients a plain torch model would hold (measured: `plain`, the same forward and
    backward without the library), plus the library's transient buffers: at most three
    unit-sized buffers in backward (README: the computing unit's parameters and gradient
    buffer, and the one being reduced or the next unit's parameters) and the outermost unit's
    parameters and gradient buffer. Bounds: peak >= persistent + the largest unit (a gather
    must allocate it); peak <= persistent + plain + 3 x largest block + 2 x outermost + 128 MiB
    (cuBLAS workspaces, the reduction's staging, allocator rounding).
    """
    torch = _torch()
    from benchmarks import _gpu_models as gm

    dev, sz = gm.device_for(mode), SIZES[mode]
    cuda = dev.type == "cuda"
    mib = 2**20
    SLACK = 128 * mib  # noqa: N806 (cuBLAS and cuBLASLt workspaces, NCCL staging, allocator rounding)
    with gm.world_of_one(dev):
        plain = gm.build(sz["mem_dim"], 4, dev, rotary=False)
        x, y = gm.batch(0, sz["mem_batch"], dev)
        n_params = sum(p.numel() for p in plain.parameters())
        plain_transient = None
        if cuda:
            gm.synchronize(dev)
            before = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            gm.loss_of(plain, x, y).backward()
            gm.synchronize(dev)
            plain_transient = torch.cuda.max_memory_allocated(dev) - before
        plain.zero_grad(set_to_none=True)  # the copy must not carry gradients into the optimizer
        model = gm.fresh_copy(plain)
        del plain
        opt = gm.make_ours("adamw32", model, "zero3")
        unit_bytes = {u.name: sum(p.numel() * p.element_size() for p in u.params) for u in opt.units}
        outer_name = next(u.name for u in opt.units if any(p is model.embed.weight for p in u.params))
        block_names = set(unit_bytes) - {outer_name}
        largest_block = max(unit_bytes[n] for n in block_names)
        outermost = unit_bytes[outer_name]
        gm.train(model, [opt], range(1), sz["mem_batch"], dev)
        between = opt.memory_stats()
        persistent = between["parameters"] + between["gradients"] + between["state"] + between["unsharded"]
        measured = {}
        if cuda:
            gm.synchronize(dev)
            measured["allocated_between_steps"] = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        loss = gm.loss_of(model, x, y)
        loss.backward()
        after_backward = opt.memory_stats()
        opt.step()
        opt.zero_grad()
        if cuda:
            gm.synchronize(dev)
            measured["peak"] = torch.cuda.max_memory_allocated(dev)
    r.measure(
        parameters=n_params,
        parameter_bytes=4 * n_params,
        unit_bytes=unit_bytes,
        memory_stats_between_steps=between,
        memory_stats_after_backward=after_backward,
        predicted_persistent=persistent,
        plain_transient=plain_transient,
        **measured,
    )
    r.check(
        "memory_stats.state",
        between["state"] >= 8 * n_params,
        measured=between["state"],
        bound=f">= {8 * n_params} (AdamW: two fp32 moments)",
    )
    if not cuda:
        for name in ("between_steps", "peak_low", "peak_high"):
            r.skip(
                name,
                f"{NEEDS_CUDA}: torch.cuda.memory_allocated / max_memory_allocated (the step ran "
                f"on CPU; predicted persistent {persistent / mib:.2f} MiB)",
            )
        return
    alloc = measured["allocated_between_steps"]
    data = x.numel() * x.element_size() * 2
    r.check(
        "between_steps",
        persistent <= alloc <= persistent + data + SLACK,
        measured=f"{alloc / mib:.1f} MiB allocated",
        bound=f"[{persistent / mib:.1f}, "
        f"{(persistent + data + SLACK) / mib:.1f}] MiB (memory_stats() .. + batch + 128 MiB)",
    )
    low = alloc + max(unit_bytes.values())
    high = alloc + plain_transient + 3 * largest_block + 2 * outermost + SLACK
    peak = measured["peak"]
    r.check("peak_low", peak >= low, measured=f"{peak / mib:.1f} MiB", bound=f">= {low / mib:.1f} MiB")
    r.check(
        "peak_high",
        peak <= high,
        measured=f"{peak / mib:.1f} MiB",
        bound=f"<= {high / mib:.1f} MiB",
        detail=f"peak / parameter bytes = {peak / (4 * n_params):.2f}",
    )


# --- meta -----------------------------------------------------------------------------------------


def stage_meta(r: Result, *, out: Path, mode: str) -> None:
    """A Net (with the buffer-only Rotary) built on the meta device and materialised by the
    optimizer (`shard_modules`, `device=`) equals the Net built normally on the device under
    the same seed: every parameter and buffer, and the first loss."""
    torch = _torch()
    from benchmarks import _gpu_models as gm

    dev, sz = gm.device_for(mode), SIZES[mode]
    torch.manual_seed(0)
    with torch.device(dev):
        want = gm.Net(sz["dim"], sz["blocks"])  # as built, no perturbation: what the meta path can know
    want_buffers = {k: v.detach().cpu().clone() for k, v in want.named_buffers()}
    want_state = gm.full_state(want)
    x, y = gm.batch(0, sz["batch"], dev)
    want_loss = gm.loss_of(want, x, y).item()
    with gm.world_of_one(dev):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = gm.Net(sz["dim"], sz["blocks"])
        opt = gm.make_ours("adamw32", model, "zero3", device=dev)
        left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        r.check("nothing on meta", not left, measured=len(left), bound=0, detail=", ".join(left[:8]) or None)
        where = sorted(
            {
                f"{n}: {t.device}"
                for n, t in [*model.named_parameters(), *model.named_buffers()]
                if t.device != dev
            }
        )
        r.check(
            "on the device",
            not where,
            measured=len(where),
            bound=0,
            detail=", ".join(where[:8]) or f"every parameter and buffer on {dev}",
        )
        got = gm.full_state(model)
        diff, at = gm.max_diff(got, want_state)
        r.check("parameters equal", diff == 0, measured=diff, bound=0, detail=f"largest at {at}")
        bufs = {k: v.detach().cpu() for k, v in model.named_buffers()}
        bad = [
            k
            for k in want_buffers
            if k not in bufs or not torch.equal(bufs[k].float(), want_buffers[k].float())
        ]
        r.check(
            "buffers equal",
            not bad and bufs.keys() == want_buffers.keys(),
            measured=len(bad),
            bound=0,
            detail=", ".join(bad) or f"{', '.join(want_buffers)} equal",
        )
        loss = gm.loss_of(model, x, y).item()
        r.check("first loss equal", loss == want_loss, measured=loss, bound=want_loss)
        gm.train(model, [opt], range(1), sz["batch"], dev)
    r.measure(buffers=list(want_buffers), units=[u.name for u in opt.units], device=str(dev))


# --- checkpoint -----------------------------------------------------------------------------------


def stage_checkpoint(r: Result, *, out: Path, mode: str) -> None:
    """CheckpointManager round trips (sync, async) of a ZeRO-3 AdamW run with dropout and a
    schedule: save at step 3, run on to 6; a fresh run loads step 3 and must reach step 6
    with the same losses and weights, bit for bit (same world size: random states restored)."""
    torch = _torch()
    import vescale_optim as vo
    from benchmarks import _gpu_models as gm

    dev, sz = gm.device_for(mode), SIZES[mode]
    timeout = timedelta(seconds=gm.TIMEOUT_S)

    def run():
        model = gm.build(sz["dim"], sz["blocks"], dev, dropout=0.1)
        opt = gm.make_ours("adamw32", model, "zero3")
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
        return model, opt, sched

    def steps(model, opt, sched, span):
        losses = []
        for t in span:
            loss = gm.loss_of(model, *gm.batch(t, sz["batch"], dev))
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            losses.append(loss.detach().float().cpu().item())
        return losses

    timings = {}
    with gm.world_of_one(dev), tempfile.TemporaryDirectory(prefix="gpu_check_ckpt_") as tmp:
        for style in ("sync", "async"):
            folder = Path(tmp) / style
            model, opt, sched = run()
            manager = vo.CheckpointManager(
                folder, model, opt, sched, async_save=style == "async", timeout=timeout
            )
            steps(model, opt, sched, range(3))
            gm.synchronize(dev)
            t0 = time.perf_counter()
            manager.save(3)
            save_s = time.perf_counter() - t0
            staging = getattr(manager, "last_staging", None)
            want = steps(model, opt, sched, range(3, 6))
            t0 = time.perf_counter()
            manager.wait()
            wait_s = time.perf_counter() - t0
            manager.close()
            want_state = gm.full_state(model)
            model, opt, sched = run()
            resumed = vo.CheckpointManager(folder, model, opt, sched, timeout=timeout)
            t0 = time.perf_counter()
            loaded = resumed.load()
            load_s = time.perf_counter() - t0
            r.check(
                f"{style}.loaded",
                loaded is not None and loaded.step == 3,
                measured=None if loaded is None else loaded.step,
                bound=3,
            )
            got = steps(model, opt, sched, range(3, 6))
            resumed.close()
            diff, where = gm.max_diff(gm.full_state(model), want_state)
            r.check(
                f"{style}.losses", got == want, measured=got, bound=want, detail="steps 4-6 after loading"
            )
            r.check(f"{style}.weights", diff == 0, measured=diff, bound=0, detail=f"largest at {where}")
            timings[style] = {
                "save_s": save_s,
                "wait_s": wait_s,
                "load_s": load_s,
                "staging": _staging(staging),
            }
            print(style, json.dumps(timings[style], default=str))
    r.measure(**timings, device=str(dev))
    r.check(
        "staging time reported",
        all(t["staging"] is not None for t in timings.values()),
        measured={k: (t["staging"] or {}).get("seconds") for k, t in timings.items()},
        detail="CheckpointManager.last_staging after each save",
    )


def _staging(stats) -> dict | None:
    if stats is None:
        return None
    import dataclasses

    return dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(vars(stats))


# --- batch invariance -----------------------------------------------------------------------------


def _rel(a, b) -> float:
    """||a - b||_F / ||b||_F, in float64 (float32 for tensors of over 2^24 elements)."""
    dtype = _torch().float64 if a.numel() <= 1 << 24 else _torch().float32
    a, b = a.to(dtype), b.to(dtype)
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _bf16_ulps(a, b) -> float:
    """The largest elementwise |a - b| in bf16 ulps of b (ulp of |b| clamped at 2^-126)."""
    torch = _torch()
    e = b.float()
    ulp = torch.exp2(torch.floor(torch.log2(e.abs().clamp(min=2.0**-126))) - 7)
    return float(((a.float() - e).abs() / ulp).max())


def stage_batch_invariance(r: Result, *, out: Path, mode: str) -> None:
    """Tile 0 computed alone (K=1) and in a stack of 8 (K=8).

    Shampoo (fp32): factors after 4 `update_factors_` steps, `inverse_roots_`, `precondition`.
    Bounds, relative Frobenius: factors d*eps (a length-d fp32 dot product's error bound);
    roots (1/2) d eps kappa per factor (eigh's backward error ~ d eps, amplified by the
    inverse fourth root's relative condition kappa/4, for either of the two computations;
    kappa = the factor's lambda_max/lambda_min, measured in fp64); the direction: both roots'
    bounds + 2 d eps (two products). On CUDA cuSOLVER may take a batched Jacobi solver for
    small stacks and a per-matrix one alone: the bound allows it; bitwise equality is reported.
    newton_schulz (bf16): 1 bf16 ulp per element, the kernel tests' bar between two different
    implementations (tests/test_kernels_ns.py), which one implementation at two batch sizes
    must meet.
    """
    torch = _torch()
    # Shampoo's tile math has no public entry point (vo.Shampoo runs it inside step()): this stage
    # validates the internal kernels themselves, the one private import of the benchmarks.
    from benchmarks import _gpu_models as gm
    from vescale_optim.kernels import newton_schulz
    from vescale_optim.optim._shampoo_math import inverse_roots_, precondition, update_factors_

    dev, sz = gm.device_for(mode), SIZES[mode]
    rows = []
    beta2, epsilon, k = 0.999, 1e-12, 8
    for d in sz["shampoo_dims"]:
        g = torch.Generator(device="cpu").manual_seed(d)
        grads = torch.randn(4, k, d, d, generator=g).to(dev)
        mhat, graft = torch.randn(2, k, d, d, generator=g).to(dev).unbind(0)
        res = {}
        for kk in (1, k):
            left = torch.zeros(kk, d, d, device=dev)
            right = torch.zeros_like(left)
            for t in range(4):
                update_factors_(left, right, grads[t, :kk], beta2)
            lroot, rroot = torch.zeros_like(left), torch.zeros_like(left)
            kept = inverse_roots_(lroot, left, step=4, beta2=beta2, epsilon=epsilon, dtype=torch.float32)
            kept += inverse_roots_(rroot, right, step=4, beta2=beta2, epsilon=epsilon, dtype=torch.float32)
            direction = precondition(lroot, mhat[:kk], rroot, graft[:kk])
            res[kk] = dict(
                L=left[0], R=right[0], L_root=lroot[0], R_root=rroot[0], direction=direction[0], kept=kept
            )
        kappa = {}
        for f in ("L", "R"):
            lam = torch.linalg.eigvalsh(res[k][f].double())
            kappa[f] = float(lam.max() / lam.min().clamp_min(1e-300))
        bound = {
            "L": d * EPS32,
            "R": d * EPS32,
            "L_root": 0.5 * d * EPS32 * kappa["L"],
            "R_root": 0.5 * d * EPS32 * kappa["R"],
        }
        bound["direction"] = bound["L_root"] + bound["R_root"] + 2 * d * EPS32
        for name in ("L", "R", "L_root", "R_root", "direction"):
            a, b = res[1][name], res[k][name]
            rel, bitwise = _rel(a, b), bool(torch.equal(a, b))
            rows.append(
                dict(
                    op=f"shampoo.{name}",
                    d=d,
                    rel_diff=rel,
                    max_abs_diff=float((a - b).abs().max()),
                    bitwise=bitwise,
                    bound=bound[name],
                )
            )
            r.check(
                f"shampoo.d{d}.{name}",
                rel <= bound[name],
                measured=rel,
                bound=bound[name],
                detail=f"bitwise {'equal' if bitwise else 'different'}"
                + (f"; kappa {kappa[name[0]]:.3g}" if "root" in name else ""),
            )
        r.check(
            f"shampoo.d{d}.no kept roots",
            res[1]["kept"] == 0 and res[k]["kept"] == 0,
            measured=[res[1]["kept"], res[k]["kept"]],
            bound=0,
        )
    m, n = sz["ns_shape"]
    x = torch.randn(k, m, n, generator=torch.Generator().manual_seed(5)).to(dev)
    for backend in ("triton", "torch"):
        alone = newton_schulz(x[:1], backend=backend)[0]
        batched = newton_schulz(x, backend=backend)[0]
        ulps, bitwise = _bf16_ulps(alone, batched), bool(torch.equal(alone, batched))
        rows.append(
            dict(
                op=f"newton_schulz.{backend}",
                shape=f"{m}x{n}",
                max_ulps=ulps,
                max_abs_diff=float((alone.float() - batched.float()).abs().max()),
                bitwise=bitwise,
            )
        )
        r.check(
            f"newton_schulz.{backend}",
            ulps <= 1,
            measured=ulps,
            bound=1,
            detail=f"bf16 ulps, {m}x{n} alone vs in {k}; bitwise {'equal' if bitwise else 'different'}"
            + ("" if dev.type == "cuda" or backend == "torch" else " (Triton interpreter)"),
        )
    r.measure(rows=rows, device=str(dev))
    print(json.dumps(rows, indent=1))


# --- nan ------------------------------------------------------------------------------------------


def _same(a, b) -> tuple[bool, int]:
    """(equal, with NaN where NaN; how many elements differ)."""
    torch = _torch()
    if a.shape != b.shape:
        return False, -1
    if a.is_floating_point():
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        differ = (nan_a != nan_b) | (~nan_a & ~nan_b & (a != b))
    else:
        differ = a != b
    count = int(differ.sum())
    return count == 0, count


def _close(a, b, rtol: float, atol: float) -> dict:
    """Non-finite positions (NaN, +Inf, -Inf) must match exactly; finite values within tolerance."""
    torch = _torch()
    nonfinite = {
        name: int((f(a) != f(b)).sum())
        for name, f in (("nan", torch.isnan), ("posinf", torch.isposinf), ("neginf", torch.isneginf))
    }
    both = torch.isfinite(a) & torch.isfinite(b)
    diff = (a[both].double() - b[both].double()).abs()
    outside = int((diff > atol + rtol * b[both].double().abs()).sum())
    return dict(
        nonfinite_positions_differ=nonfinite,
        outside_tolerance=outside,
        max_abs_diff=float(diff.max()) if diff.numel() else 0.0,
    )


def stage_nan(r: Result, *, out: Path, mode: str) -> None:
    """NaN, +Inf and -Inf, alone in a block and together with finite values, through
    quantize_blockwise, dequantize_blockwise and adamw8bit_update_ (in the gradient and in the
    parameter), Triton against the torch reference. Bounds, those of tests/test_kernels_quant.py
    for the two backends: quantize and dequantize equal element for element (NaN = NaN); the
    8-bit update: the same non-finite positions, finite parameters within rtol 1e-6 + atol 1e-7,
    scales within rtol 1e-5, codes at most 1 apart in under 1% of the elements, and equal codes
    wherever the gradient was not finite."""
    torch = _torch()
    from benchmarks import _gpu_models as gm
    from vescale_optim.kernels import adamw8bit_update_, dequantize_blockwise, quantize_blockwise

    dev, n, bs = gm.device_for(mode), SIZES[mode]["nan_n"], 256
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, generator=g)
    poison = {5: math.nan, 300: math.inf, 301: -math.inf, 700: math.nan, 701: math.inf, n - 1: math.nan}
    for i, v in poison.items():
        x[i] = v
    x[3 * bs : 4 * bs] = math.nan  # a block of NaN only
    x[4 * bs : 5 * bs] = math.inf  # a block of +Inf only
    x = x.to(dev)
    bad = ~torch.isfinite(x)
    found = {}
    out_q = {b: quantize_blockwise(x, bs, backend=b) for b in ("triton", "torch")}
    for i, name in enumerate(("codes", "scales")):
        ok, count = _same(out_q["triton"][i], out_q["torch"][i])
        found[f"quantize.{name}"] = count
        r.check(f"quantize.{name}", ok, measured=count, bound=0, detail="elements that differ (NaN = NaN)")
    q, s = out_q["torch"]
    deq = {b: dequantize_blockwise(q, s, bs, backend=b) for b in ("triton", "torch")}
    ok, count = _same(deq["triton"], deq["torch"])
    found["dequantize"] = count
    r.check("dequantize", ok, measured=count, bound=0, detail=f"{int(torch.isnan(deq['torch']).sum())} NaN")
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=3, block_size=bs)
    p0 = torch.randn(n, generator=g)
    p0[9], p0[2 * bs + 1] = math.nan, math.inf
    p0 = p0.to(dev)
    clean = torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
    qm, sm = quantize_blockwise(0.1 * clean, bs)
    qv, sv = quantize_blockwise(0.1 * clean.abs(), bs)
    states = {}
    for b in ("triton", "torch"):
        state = [p0.clone(), x, qm.clone(), sm.clone(), qv.clone(), sv.clone()]
        adamw8bit_update_(*state, backend=b, **hyper)
        states[b] = state
    (p_t, _, qm_t, sm_t, qv_t, sv_t), (p_r, _, qm_r, sm_r, qv_r, sv_r) = states["triton"], states["torch"]
    for name, a, b, rtol, atol in (
        ("param", p_t, p_r, 1e-6, 1e-7),
        ("exp_avg.scales", sm_t, sm_r, 1e-5, 0.0),
        ("exp_avg_sq.scales", sv_t, sv_r, 1e-5, 0.0),
    ):
        c = _close(a, b, rtol, atol)
        found[f"adamw8bit.{name}"] = c
        r.check(
            f"adamw8bit.{name}",
            not any(c["nonfinite_positions_differ"].values()) and not c["outside_tolerance"],
            measured=c,
            bound=f"same non-finite positions; rtol {rtol:g}, atol {atol:g}",
        )
    for name, a, b in (("exp_avg.codes", qm_t, qm_r), ("exp_avg_sq.codes", qv_t, qv_r)):
        apart = (a.int() - b.int()).abs()
        c = dict(
            max_apart=int(apart.max()),
            fraction_apart=float((apart > 0).float().mean()),
            apart_where_grad_not_finite=int((apart[bad] > 0).sum()),
        )
        found[f"adamw8bit.{name}"] = c
        r.check(
            f"adamw8bit.{name}",
            c["max_apart"] <= 1 and c["fraction_apart"] < 0.01 and c["apart_where_grad_not_finite"] == 0,
            measured=c,
            bound="<= 1 apart in < 1%, equal where the gradient is not finite",
        )
    nan_param = int(torch.isnan(p_r).sum())
    r.measure(
        n=n,
        block_size=bs,
        poisoned=int(bad.sum()),
        found=found,
        nan_in_updated_param=nan_param,
        triton="compiled" if dev.type == "cuda" else "interpreter",
    )


# --- large shapes ---------------------------------------------------------------------------------


def stage_large_shapes(r: Result, *, out: Path, mode: str) -> None:
    """Newton-Schulz of a Llama-70B-sized MLP matrix (8192 x 28672) and a GPT-OSS-like expert
    stack (32 x 2880 x 5760) in bf16, and quantize / dequantize of more than 2^31 elements
    (int32 indexing would overflow), Triton against the torch reference.

    Newton-Schulz bound: relative Frobenius difference <= 2^-5. Each of the 5 iterations
    rounds A, B and X to bf16 (relative 2^-8 per ulp); two implementations whose fp32
    accumulations differ in order may round any element one ulp apart, which over 15 roundings
    adds up to about sqrt(15) * 2^-8 = 0.015 in quadrature; the bound leaves 2x. Both outputs
    must be finite and orthogonalised (mean squared singular value ||X||_F^2 / min(m, n) in
    [0.5, 1.5]; Muon's coefficients put singular values in about [0.7, 1.2]).
    Quantization: codes, scales and dequantized values equal (the two compute the same
    function: `tests/test_kernels_quant.py`).
    """
    torch = _torch()
    from benchmarks import _gpu_models as gm
    from vescale_optim.kernels import dequantize_blockwise, newton_schulz, quantize_blockwise

    dev, sz = gm.device_for(mode), SIZES[mode]
    cuda = dev.type == "cuda"
    rows = []
    for shape in sz["big_ns"]:
        label = "x".join(map(str, shape))
        x = torch.randn(
            shape, device=dev, dtype=torch.bfloat16, generator=torch.Generator(dev).manual_seed(3)
        )
        outs, seconds = {}, {}
        for backend in ("triton", "torch"):
            for call in ("first", "second"):  # the first compiles the Triton kernels for this shape
                outs.pop(backend, None)
                gm.synchronize(dev)
                t0 = time.perf_counter()
                outs[backend] = newton_schulz(x, backend=backend)
                gm.synchronize(dev)
                seconds[f"{backend} {call}"] = round(time.perf_counter() - t0, 4)
        rel = _rel(outs["triton"], outs["torch"])
        msv = {b: float(o.float().square().sum()) / (o.numel() // max(shape[-2:])) for b, o in outs.items()}
        finite = all(bool(torch.isfinite(o).all()) for o in outs.values())
        rows.append(
            dict(
                op="newton_schulz",
                shape=label,
                rel_diff=rel,
                mean_sq_singular=msv,
                finite=finite,
                seconds=seconds,
            )
        )
        r.check(
            f"newton_schulz.{label}",
            finite and rel <= 2.0**-5,
            measured=rel,
            bound=2.0**-5,
            detail=f"relative Frobenius, Triton vs torch; Triton {seconds['triton second']:.3f} s, torch "
            f"{seconds['torch second']:.3f} s (warm)" + ("" if cuda else " (interpreter; CPU sizes)"),
        )
        r.check(
            f"newton_schulz.{label}.orthogonalised",
            all(0.5 <= v <= 1.5 for v in msv.values()),
            measured=msv,
            bound=[0.5, 1.5],
            detail="||X||_F^2 / min(m, n) per backend",
        )
        del x, outs
        if cuda:
            torch.cuda.empty_cache()
    n = sz["big_quant"]
    need = 14 * n  # bytes at the peak: codes n, dequantized 4n + 4n, the reference's 4n, comparisons
    free = torch.cuda.mem_get_info(dev)[0] if cuda else None
    if cuda and free < need * 1.15:
        r.skip("quantize.2^31", f"needs about {need / 2**30:.0f} GiB free, {free / 2**30:.0f} GiB are")
    else:
        rows.append(_big_quantize(r, n, dev, quantize_blockwise, dequantize_blockwise, cuda))
    if not cuda:
        r.skip(
            "quantize.2^31",
            f"{NEEDS_CUDA}: {(1 << 31) + (1 << 20):,} elements ({14 * ((1 << 31) + (1 << 20)) / 2**30:.0f} "
            f"GiB of device memory); rehearsed at {n:,} elements in the interpreter",
        )
    r.measure(rows=rows, device=str(dev))
    print(json.dumps(rows, indent=1, default=str))


def _big_quantize(r: Result, n: int, dev, quantize_blockwise, dequantize_blockwise, cuda: bool) -> dict:
    torch = _torch()
    bs = 256
    label = "2^31" if n > 2**31 else str(n)
    x = torch.randn(n, device=dev, generator=torch.Generator(dev).manual_seed(4))
    x[-1], x[n // 2] = 1e30, -1e-30  # something in the last block, beyond 2^31 on CUDA
    t0 = time.perf_counter()
    q_t, s_t = quantize_blockwise(x, bs, backend="triton")
    _sync(dev)
    t_triton = time.perf_counter() - t0
    q_r, s_r = quantize_blockwise(x, bs, backend="torch")
    del x
    tail = n - (1 << 31) if n > (1 << 31) else n // 4
    codes_ok, codes_diff = _same(q_t, q_r)
    tail_ok, tail_diff = _same(q_t[-tail:], q_r[-tail:])
    scales_ok, scales_diff = _same(s_t, s_r)
    del q_r, s_r
    if cuda:
        torch.cuda.empty_cache()
    d_t = dequantize_blockwise(q_t, s_t, bs, backend="triton")
    d_r = dequantize_blockwise(q_t, s_t, bs, backend="torch")
    deq_ok, deq_diff = _same(d_t, d_r)
    del d_t, d_r, q_t, s_t
    if cuda:
        torch.cuda.empty_cache()
    r.check(
        f"quantize.{label}.codes",
        codes_ok,
        measured=codes_diff,
        bound=0,
        detail=f"{n:,} elements; {tail_diff} differ in the last {tail:,}; Triton {t_triton:.3f} s",
    )
    r.check(
        f"quantize.{label}.tail",
        tail_ok,
        measured=tail_diff,
        bound=0,
        detail=f"codes of the last {tail:,} elements" + (" (beyond 2^31)" if n > 2**31 else ""),
    )
    r.check(f"quantize.{label}.scales", scales_ok, measured=scales_diff, bound=0)
    r.check(f"dequantize.{label}", deq_ok, measured=deq_diff, bound=0)
    return dict(
        op="quantize",
        n=n,
        codes_differ=codes_diff,
        scales_differ=scales_diff,
        dequant_differ=deq_diff,
        triton_quantize_s=t_triton,
    )


def _sync(dev) -> None:
    from benchmarks import _gpu_models as gm

    gm.synchronize(dev)


# --- the stages -----------------------------------------------------------------------------------


def _limits(gpu: int, cpu: int = 180) -> dict[str, int]:
    """Seconds per mode. On CPU a limit only guards against a hang: a rehearsal on a loaded
    machine runs several times slower than its ~45 s on two idle cores."""
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
    return {
        "env": lambda m: [
            "torch, CUDA, NCCL, Triton versions; nvidia-smi --query-gpu=name,driver_version,..."
        ],
        "tests": lambda m: [
            f"TRITON_INTERPRET={'1' if m == 'cpu' else '0'} HYPOTHESIS_PROFILE=ci python -m pytest -q "
            + " ".join(KERNEL_TESTS)
        ],
        "zero3": lambda m: [
            f"{_group(m)}: Net(dim {z(m)['dim']}, {z(m)['blocks']} blocks) x vo.AdamW 32/8-bit, vo.Muon, "
            "vo.Shampoo x ZeRO-3, ZeRO-2, 3-4 steps, vs torch.optim.AdamW / torch.optim.Muon / plain Shampoo"
        ],
        "syncs": lambda m: [
            f"{_group(m)}: a warm ZeRO-3 AdamW and Muon step under set_sync_debug_mode('warn')"
        ],
        "overlap": lambda m: [
            f"{_group(m)}: torch.profiler trace of a ZeRO-3 step, 4 blocks of dim {z(m)['overlap_dim']}, "
            "-> OUT/overlap_trace.json"
        ],
        "memory": lambda m: [f"{_group(m)}: a ZeRO-3 AdamW step, 4 blocks of dim {z(m)['mem_dim']}"],
        "meta": lambda m: [
            f"{_group(m)}: Net built under torch.device('meta'), shard_modules, device= the group's device"
        ],
        "checkpoint": lambda m: [
            f"{_group(m)}: CheckpointManager(async_save=False/True), save at 3, resume to 6"
        ],
        "batch_invariance": lambda m: [
            f"update_factors_/inverse_roots_/precondition, d in {z(m)['shampoo_dims']}, K=1 vs 8; "
            f"newton_schulz {z(m)['ns_shape']} alone vs 8 (triton, torch)"
        ],
        "nan": lambda m: [
            f"quantize/dequantize/adamw8bit_update_ of {z(m)['nan_n']:,} elements with NaN/Inf"
        ],
        "large_shapes": lambda m: [
            f"newton_schulz {' and '.join('x'.join(map(str, s)) for s in z(m)['big_ns'])} (bf16); "
            f"quantize/dequantize of {z(m)['big_quant']:,} elements"
        ],
        "steps": lambda m: [_kernels_cmd(m, "steps")],
        "kernels": lambda m: [_kernels_cmd(m, "kernels")],
    }


# In the order they run: the library's checks first, the throughput benchmark last (it takes the
# budget that is left).
STAGES = [
    Stage(
        "env",
        stage_env,
        _limits(30),
        "GPU, driver, torch, CUDA, NCCL, Triton; the library from this tree",
    ),
    Stage("tests", stage_tests, _limits(120, 300), "the kernel tests compiled on the GPU"),
    Stage("zero3", stage_zero3, _limits(50), "ZeRO-3/ZeRO-2 on a forced world-1 group vs torch.optim", FORCE),
    Stage("syncs", stage_syncs, _limits(25), "host syncs in backward (goal 0) and step() (goal <= 1)", FORCE),
    Stage(
        "overlap",
        stage_overlap,
        _limits(30),
        "all-gather of unit k-1 before unit k's last backward kernel",
        FORCE,
    ),
    Stage(
        "memory",
        stage_memory,
        _limits(25),
        "max_memory_allocated() of a ZeRO-3 step vs memory_stats()",
        FORCE,
    ),
    Stage(
        "meta",
        stage_meta,
        _limits(20),
        "a meta-device model materialised on the device equals the model built normally",
        FORCE,
    ),
    Stage("checkpoint", stage_checkpoint, _limits(35), "CheckpointManager sync and async round trips", FORCE),
    Stage(
        "batch_invariance",
        stage_batch_invariance,
        _limits(20),
        "Shampoo tile math and newton_schulz alone vs batched in 8",
    ),
    Stage(
        "nan",
        stage_nan,
        _limits(20),
        "NaN/Inf through quantize, dequantize, the 8-bit update: Triton vs torch",
    ),
    Stage(
        "large_shapes",
        stage_large_shapes,
        _limits(75),
        "newton_schulz 8192x28672 and 32x2880x5760, quantize of > 2^31 elements",
    ),
    Stage(
        "steps",
        stage_steps,
        _limits(45),
        "world-1 optimizer steps vs torch.optim (benchmarks/kernels.py)",
    ),
    Stage("kernels", stage_kernels, _limits(130), "Triton vs torch vs torch.compile (benchmarks/kernels.py)"),
]
for _s in STAGES:
    _s.plan = _plans()[_s.name]


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
    ap.add_argument("--dry-run", action="store_true", help="print the stages, run nothing")
    ap.add_argument("--stages", nargs="+", choices=[s.name for s in STAGES], help="run these only")
    ap.add_argument("--budget", type=float, help="seconds for the whole run (default: 570 on GPU, 840 --cpu)")
    ap.add_argument("--stage", help=argparse.SUPPRESS)  # internal: run one stage in this process
    ap.add_argument("--mode", choices=["gpu", "cpu"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    mode = args.mode or ("cpu" if args.cpu else "gpu")
    out = args.out.resolve()
    if args.stage:
        return run_stage_here(STAGES, args.stage, out, mode=mode)
    stages = [s for s in STAGES if not args.stages or s.name in args.stages]
    command = lambda s: [
        sys.executable,
        str(Path(__file__).resolve()),
        "--stage",
        s.name,
        "--mode",
        mode,  # noqa: E731
        str(out),
    ]
    if args.dry_run:
        dry_run(stages, mode, out, command, args.budget or BUDGET_S[mode])
        return 0
    if mode == "gpu":
        proc = subprocess.run(
            [sys.executable, "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"],
            capture_output=True,
        )
        if proc.returncode != 0:
            print(
                f"no CUDA device visible to {sys.executable}; use --cpu to rehearse the stages on CPU",
                file=sys.stderr,
            )
            return 2
    notes = [f"python {sys.executable}", f"every stage in its own process; limits cut to the {mode} budget"]
    budget = args.budget or BUDGET_S[mode]
    return run_all(stages, mode=mode, out=out, title="GPU check", budget=budget, command=command, notes=notes)


if __name__ == "__main__":
    sys.exit(main())
