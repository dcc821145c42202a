"""Ahead-of-time build of every Triton kernel for A100 (sm_80) and H100/H200 (sm_90), no GPU needed.

    python -m vescale_optim.kernels.aot --out DIR [--arch 80 90] [--jobs N]
    python -m vescale_optim.kernels.aot --warm --arch 90   # only fill Triton's cache (see `warm`)

The launchers plan each launch before running it (``*_launch`` in ``_ns_triton`` and
``_quant_triton``, the packed wire format's kernels included); ``aot_cases`` runs the same
planning on meta tensors over a sweep of inputs, so every tile size, ``num_warps``,
``num_stages`` and dtype the dispatcher can choose appears, with the argument
specializations (divisibility by 16, unit strides) a real launch would get: here they come
from Triton's own launch binder (an internal API, written against the pinned Triton 3.7).
Each distinct kernel is compiled with ``triton.compile``
for each architecture; its PTX goes to ``DIR``, and its registers and spills come from the
``ptxas -v`` report of the bundled ``ptxas`` that Triton runs to build the cubin.

``DIR/report.json`` holds one record per (kernel, config, arch); the same is printed as a
Markdown table. The exit status is 1 when a kernel fails to compile, asks for more shared
memory than a block may have, spills registers, or (Newton–Schulz, always bf16) does not
use the tensor cores (``mma``/``wgmma`` in its PTX).

Shared memory per block (opt-in maximum; CUDA C++ Programming Guide, "Technical
Specifications per Compute Capability", and ``cudaDevAttrMaxSharedMemoryPerBlockOptin``,
which Triton checks when it loads a kernel): 163 KiB (166912 bytes) on sm_80 (A100),
227 KiB (232448 bytes) on sm_90 (H100, H200).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

try:
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import sm_arch_from_capability
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
except ImportError as e:
    raise ImportError(f"the AOT build needs Triton (pip install vescale_optim[triton]): {e}") from e

from . import _ns_triton, _quant_triton
from ._triton_common import INTERPRET, Launch
from .aot_cases import NS_BATCH, NS_LARGE, PACK_ROWS, QUANT_LARGE, Case, cases

# with the sweep's sizes and `Case` (`aot_cases`): a caller builds its own case list from them
__all__ = [
    "NS_BATCH",
    "NS_LARGE",
    "PACK_ROWS",
    "QUANT_LARGE",
    "SMEM_LIMIT",
    "Case",
    "build",
    "cases",
    "check",
    "main",
    "markdown",
    "ptxas_usage",
    "tensor_core_ops",
]

SMEM_LIMIT = {80: 166912, 90: 232448}
"""Bytes of shared memory one block may use, by compute capability (see the module docstring)."""


@dataclass
class _Job:
    kernel: str
    role: str
    arch: int
    config: dict
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    ptx: str
    inputs: list


def _specialize(launch: Launch, arch: int, binders: dict) -> tuple:
    """Signature, constants, attributes and options of ``launch`` as Triton's launcher would
    derive them for this target (its own binder, so AOT and launch specialize alike)."""
    kernel = launch.kernel
    backend = make_backend(GPUTarget("cuda", arch, 32))
    if (kernel, arch) not in binders:
        binders[kernel, arch] = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binders[kernel, arch](*launch.args, **launch.meta)
    return kernel._pack_args(backend, dict(launch.meta), bound, specialization, options)


def _signature_text(signature: dict, constexprs: dict, attrs: dict, names: Sequence[str]) -> str:
    """The arguments in ``triton.tools.compile`` notation: ``*bf16:16, i32:16, 1, ...``."""
    parts = []
    for i, name in enumerate(names):
        if signature[name] == "constexpr":
            parts.append(str(constexprs[(i,)]))
        else:
            divisible = any(a == ["tt.divisibility", 16] for a in attrs.get((i,), []))
            parts.append(signature[name] + (":16" if divisible else ""))
    return ", ".join(parts)


def _plan(archs: Sequence[int], case_list: Sequence[Case], out: Path) -> list[_Job]:
    """One job per distinct (kernel, specialization, options, arch), with the inputs that reach it."""
    jobs: dict[str, _Job] = {}
    binders: dict = {}
    for arch in archs:
        for case in case_list:
            options, signature, constexprs, attrs = _specialize(case.launch, arch, binders)
            kernel = case.launch.kernel
            names = [p.name for p in kernel.params]
            text = _signature_text(signature, constexprs, attrs, names)
            meta = {k: v for k, v in case.launch.meta.items() if k != "INTERPRETED"}
            name = kernel.__name__.strip("_").removesuffix("_kernel")
            key = hashlib.sha256(f"{name}|{sorted(meta.items())}|{text}".encode()).hexdigest()[:10]
            job_id = f"{name}-sm{arch}-{key}"
            if job_id not in jobs:
                config = {
                    **meta,
                    "num_warps": options.num_warps,
                    "num_stages": options.num_stages,
                    "signature": text,
                }
                jobs[job_id] = _Job(
                    name,
                    case.role,
                    arch,
                    config,
                    signature,
                    constexprs,
                    attrs,
                    options.__dict__,
                    str(out / f"{job_id}.ptx"),
                    [],
                )
            if case.input not in jobs[job_id].inputs:
                jobs[job_id].inputs.append(case.input)
    return list(jobs.values())


def ptxas_usage(log: str) -> tuple[int, int]:
    """(registers per thread, spilled bytes stored + loaded) from ``ptxas -v`` output."""
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or spills is None:
        raise ValueError(f"no register or spill line in ptxas output:\n{log}")
    return int(regs.group(1)), int(spills.group(1)) + int(spills.group(2))


_MMA = re.compile(r"^\s*(?:@!?%p\d+\s+)?(wgmma\.mma_async|mma\.sync)\b", re.MULTILINE)


def tensor_core_ops(ptx: str) -> str | None:
    """``"wgmma"`` or ``"mma"`` when the PTX issues tensor-core instructions, else None."""
    found = {m.split(".")[0] for m in _MMA.findall(ptx)}
    return "wgmma" if "wgmma" in found else ("mma" if found else None)


def _kernel_fn(name: str):
    module = _ns_triton if name in ("syrk", "poly") else _quant_triton
    return getattr(module, f"_{name}_kernel")


def _compile(job: _Job) -> dict:
    record = dict(
        kernel=job.kernel,
        role=job.role,
        arch=job.arch,
        config=job.config,
        smem_bytes=None,
        regs=None,
        spills=None,
        tensor_cores=None,
        mma=None,
        ptx=Path(job.ptx).name,
        inputs=job.inputs,
        error=None,
    )
    try:
        src = ASTSource(_kernel_fn(job.kernel), job.signature, job.constexprs, job.attrs)
        log = io.StringIO()
        with knobs.compilation.scope(), knobs.nvidia.scope(), contextlib.redirect_stdout(log):
            knobs.compilation.always_compile = True  # so ptxas runs and prints its -v report
            knobs.nvidia.dump_ptxas_log = True
            compiled = triton.compile(src, target=GPUTarget("cuda", job.arch, 32), options=job.options)
        ptx = compiled.asm["ptx"]
        Path(job.ptx).write_text(ptx)
        record["smem_bytes"] = compiled.metadata.shared
        record["mma"] = tensor_core_ops(ptx)
        record["tensor_cores"] = record["mma"] is not None
        record["regs"], record["spills"] = ptxas_usage(log.getvalue() or _ptxas_log(job))
    except Exception as e:  # a kernel that does not build is a finding, not a crash
        record["error"] = f"{type(e).__name__}: {e}".strip().splitlines()[0][:300]
    return record


def _warm_one(job: _Job) -> str | None:
    """Compile ``job`` as a launch would, through Triton's cache; what failed, if it did."""
    try:
        src = ASTSource(_kernel_fn(job.kernel), job.signature, job.constexprs, job.attrs)
        triton.compile(src, target=GPUTarget("cuda", job.arch, 32), options=job.options)
    except Exception as e:
        return f"{job.kernel} {_config_text(job.config)}: {type(e).__name__}: {e}".splitlines()[0][:300]
    return None


def warm(archs: Sequence[int], case_list: Sequence[Case] | None = None, jobs: int | None = None) -> list[str]:
    """Fill Triton's kernel cache (``TRITON_CACHE_DIR``, else Triton's default) with every kernel of
    ``case_list`` for ``archs``, compiled from the same source, signature, attributes, options and
    target a launch derives, so that a later launch finds it there instead of compiling (a GPU's
    first minute: each process of a test run would otherwise compile the same kernels). Nothing is
    written besides the cache. Returns what failed to compile."""
    if INTERPRET:
        raise RuntimeError("warming Triton's cache compiles kernels: run it without TRITON_INTERPRET=1")
    with tempfile.TemporaryDirectory() as tmp:
        todo = _plan(archs, list(cases() if case_list is None else case_list), Path(tmp))
    workers = max(1, min(jobs or os.cpu_count() or 1, len(todo)))
    if workers == 1:
        return [f for f in map(_warm_one, todo) if f]
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        return [f for f in pool.map(_warm_one, todo, chunksize=4) if f]


def _ptxas_log(job: _Job) -> str:
    """``ptxas -v`` on the written PTX with Triton's flags, if Triton did not print its own."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            knobs.nvidia.ptxas.path,
            "-v",
            "--regAllocOptLevel=2",
            f"--gpu-name={sm_arch_from_capability(job.arch)}",
            job.ptx,
            "-o",
            f"{tmp}/k.cubin",
        ]
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stderr


def check(record: dict) -> list[str]:
    """What is wrong with one compiled kernel (empty when nothing)."""
    if record["error"]:
        return [f"does not compile ({record['error']})"]
    problems = []
    limit = SMEM_LIMIT[record["arch"]]
    if record["smem_bytes"] > limit:
        problems.append(f"shared memory {record['smem_bytes']} B > {limit} B")
    if record["spills"]:
        problems.append(f"spills {record['spills']} B")
    if record["role"] == "newton_schulz" and not record["tensor_cores"]:
        problems.append("no tensor cores (mma/wgmma) in a bf16 Newton-Schulz kernel")
    return problems


def build(
    out: Path,
    archs: Sequence[int] = (80, 90),
    case_list: Sequence[Case] | None = None,
    jobs: int | None = None,
) -> list[dict]:
    """Compile every distinct kernel of ``case_list`` (default: ``cases()``) for ``archs`` into
    ``out``; write and return the records, each with its ``problems``."""
    if INTERPRET:
        raise RuntimeError("the AOT build compiles kernels: run it without TRITON_INTERPRET=1")
    unknown = set(archs) - set(SMEM_LIMIT)
    if unknown:
        raise ValueError(f"unsupported architectures {sorted(unknown)}; known: {sorted(SMEM_LIMIT)}")
    out.mkdir(parents=True, exist_ok=True)
    todo = _plan(archs, list(cases() if case_list is None else case_list), out)
    workers = max(1, min(jobs or os.cpu_count() or 1, len(todo)))
    if workers == 1:
        records = [_compile(job) for job in todo]
    else:
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            records = list(pool.map(_compile, todo, chunksize=4))
    for record in records:
        record["problems"] = check(record)
    (out / "report.json").write_text(json.dumps(records, indent=1))
    return records


def _config_text(config: dict) -> str:
    skip = ("signature", "num_warps", "num_stages")
    tiles = " ".join(f"{k}={v}" for k, v in config.items() if k not in skip)
    return f"{tiles} w{config['num_warps']} s{config['num_stages']}"


def markdown(records: Sequence[dict]) -> str:
    """The report as a Markdown table, one row per record."""
    lines = [
        "| kernel | arch | config | example input (of n) | smem B | regs | spills | TC | status |",
        "|---|---|---|---|---:|---:|---:|---|---|",
    ]
    for r in records:
        status = "; ".join(r["problems"]) or "ok"
        tc = "" if r["tensor_cores"] is None else (r["mma"] or "no")
        example = f"{r['inputs'][0]} ({len(r['inputs'])})"
        cells = [
            r["kernel"],
            f"sm_{r['arch']}",
            _config_text(r["config"]),
            example,
            r["smem_bytes"],
            r["regs"],
            r["spills"],
            tc,
            status,
        ]
        lines.append("| " + " | ".join("" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, case_list: Sequence[Case] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vescale_optim.kernels.aot", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, help="directory for report.json and the PTX (not with --warm)")
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: all cores)")
    parser.add_argument(
        "--warm",
        action="store_true",
        help="only fill Triton's cache (TRITON_CACHE_DIR) for --arch: no PTX, no report",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.warm:
        failed = warm(args.arch, case_list, args.jobs)
        print(*failed, sep="\n")
        where = os.environ.get("TRITON_CACHE_DIR") or "Triton's default cache"
        print(
            f"Triton's cache ({where}) warmed for {', '.join(f'sm_{a}' for a in args.arch)} in "
            f"{time.perf_counter() - start:.0f} s; {len(failed)} kernels failed to compile"
        )
        return 1 if failed else 0
    if args.out is None:
        parser.error("--out is required (or --warm)")
    records = build(args.out, args.arch, case_list, args.jobs)
    print(markdown(records))
    bad = [r for r in records if r["problems"]]
    print(
        f"\n{len(records)} kernels compiled for {', '.join(f'sm_{a}' for a in args.arch)} "
        f"in {time.perf_counter() - start:.0f} s; {len(bad)} with problems; "
        f"report: {args.out / 'report.json'}"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
