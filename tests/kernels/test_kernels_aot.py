"""Ahead-of-time build of every Triton kernel for sm_80 (A100) and sm_90 (H100/H200), on CPU.

The build compiles real kernels, so it runs in a subprocess without the interpreter that
conftest selects. One full build serves the module; a second, tiny build proves the check
fails on a configuration whose pipeline stages overflow shared memory.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from vescale_optim.kernels import _ns_triton, _quant_triton, aot
from vescale_optim.kernels.quant import MAX_TRITON_BLOCK

pytestmark = pytest.mark.slow  # make test-fast leaves it out

FIELDS = {"kernel", "role", "arch", "config", "smem_bytes", "regs", "spills", "tensor_cores", "ptx"}
ROLES = {"newton_schulz", "quantize", "dequantize", "adamw8bit", "pack", "unpack", "unpack_sum"}


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**env, "TRITON_CACHE_DIR": str(tmp_path / "triton-cache")}


def _records(out):
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot")
    proc = subprocess.run(
        [sys.executable, "-m", "vescale_optim.kernels.aot", "--out", str(out)],
        # 636 kernels: 3 minutes on an idle 2-core machine, 10 on a busy one (the 232 of the
        # packed wire format compile in under a minute)
        env=_env(out),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    return proc, out


@pytest.mark.timeout(1260)
def test_every_kernel_compiles_for_both_architectures(build):
    proc, out = build
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    records = _records(out)
    assert {r["arch"] for r in records} == {80, 90}
    assert {r["role"] for r in records} == ROLES
    for r in records:
        assert r.keys() >= FIELDS and not r["problems"] and r["error"] is None
        assert r["smem_bytes"] <= aot.SMEM_LIMIT[r["arch"]] and r["spills"] == 0 and 0 < r["regs"] <= 255
        assert (out / r["ptx"]).stat().st_size > 0
        if r["role"] == "newton_schulz":
            rows = r["config"]["BLOCK_M" if r["kernel"] == "poly" else "BLOCK"]
            assert r["mma"] == ("wgmma" if r["arch"] == 90 and rows >= 64 else "mma"), r
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "sm_" in line]
    assert len(table) == len(records)


DTYPE_ARG = {"quantize": 0, "dequantize": 2, "adamw8bit": 1, "pack": 0, "unpack": 1}
"""The input (output) whose dtype a user chooses; ``unpack_sum`` is fp32 only."""


def _quant_dtype(record):
    return record["config"]["signature"].split(", ")[DTYPE_ARG[record["role"]]].split(":")[0].lstrip("*")


def _compiled(records, role, arch, config, dtype=None):
    return any(
        r["role"] == role
        and r["arch"] == arch
        and all(r["config"].get(k) == v for k, v in config)
        and (dtype is None or _quant_dtype(r) == dtype)
        for r in records
    )


def test_every_configuration_the_launchers_choose_is_compiled(build):
    """Swept over every power of two, the choice functions yield no configuration the build missed."""
    records = _records(build[1])
    sides = [2**k for k in range(4, 14)]  # sides are padded to multiples of 16
    syrk = {tuple(_ns_triton.syrk_config(p, k).items()) for p in sides for k in sides if p <= k}
    poly = {tuple(_ns_triton.poly_config(p, q).items()) for p in sides for q in sides if p <= q}
    blocks = [2**k for k in range(MAX_TRITON_BLOCK.bit_length())]
    quant = {tuple(_quant_triton.block_config(b).items()) for b in blocks}
    assert len(quant) == len(blocks) == 14
    for arch in (80, 90):
        for config in syrk | poly:
            assert _compiled(records, "newton_schulz", arch, config), (arch, config)
        for config in quant:
            for role in DTYPE_ARG:
                for dtype in ("fp32", "bf16"):
                    assert _compiled(records, role, arch, config, dtype), (role, arch, config, dtype)
            assert _compiled(records, "unpack_sum", arch, config), (arch, config)


def test_packed_kernels_are_compiled_for_several_rows(build):
    """The packed sweep reaches each tile choice with several rows (the row of a program is
    a division there; the row sum loops), and one row with a partial last block."""
    records = _records(build[1])
    for role in ("pack", "unpack", "unpack_sum"):
        inputs = {i for r in records if r["role"] == role for i in r["inputs"]}
        for block in (2**k for k in range(MAX_TRITON_BLOCK.bit_length())):
            assert f"fp32 n={64 * block} rows={aot.PACK_ROWS} block_size={block}" in inputs, (role, block)
        rows = aot.PACK_ROWS if role == "unpack_sum" else 1
        assert f"fp32 n={64 * 65 - 1} rows={rows} block_size=65" in inputs, role


def test_newton_schulz_inputs_of_the_issue_are_covered(build):
    inputs = {i for r in _records(build[1]) if r["role"] == "newton_schulz" for i in r["inputs"]}
    for w in (128, 1024, 4096):
        assert f"bf16 ({w}, {w})" in inputs and f"bf16 ({aot.NS_BATCH}, {w}, {w})" in inputs


FLOAT_MAX_MIN_DROPPING_NAN = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:max|min)(?:\.ftz)?\.f(?:16|32|64)\b", re.M)
"""``max.f32`` / ``min.f32`` (no ``.NaN``): they return the other operand of a NaN."""
NAN_TEST = re.compile(r"^\s*(?:@!?%p\d+\s+)?setp\.(?:nan|num)\.f32\b", re.M)
INT_MAX = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:redux\.sync\.)?max\.[su]32\b", re.M)


def test_quantizing_kernels_keep_nan_compiled(build):
    """In the PTX of every quantize, pack and 8-bit update kernel: no float max or min that drops
    NaN (the absmax is an integer max, ``max.s32``/``max.u32`` or a warp's
    ``redux.sync.max.s32``, the clamp NaN-propagating),
    and the explicit NaN test that gives a NaN code 0 survived the optimizer (``setp.num``
    or ``setp.nan``). The interpreter cannot show this: it computes with numpy."""
    proc, out = build
    records = [r for r in _records(out) if r["role"] in ("quantize", "adamw8bit", "pack") and not r["error"]]
    assert {r["arch"] for r in records} == {80, 90}
    for r in records:
        ptx = (out / r["ptx"]).read_text()
        dropping = FLOAT_MAX_MIN_DROPPING_NAN.findall(ptx)
        assert not dropping, (r["kernel"], r["arch"], r["config"], dropping[:3])
        assert NAN_TEST.search(ptx), (r["kernel"], r["arch"], r["config"])
        if r["config"]["BLOCK"] > 1:  # a one-element row needs no max at all
            assert INT_MAX.search(ptx), (r["kernel"], r["arch"], r["config"])


def test_inputs_past_two_to_the_31_elements_are_compiled(build):
    """Flat shards and stacks past 2**31 elements pass int64 sizes and strides: those
    specializations are built and checked too."""
    records = _records(build[1])
    inputs = {i for r in records for i in r["inputs"]}
    for block_size, n in aot.QUANT_LARGE:
        for dtype in ("fp32", "bf16"):
            assert f"{dtype} n={n} block_size={block_size}" in inputs
        assert f"fp32 n={n} rows={aot.PACK_ROWS} block_size={block_size}" in inputs  # the row sum
    for shape in aot.NS_LARGE:
        assert f"bf16 {shape}" in inputs
    wide = [r for r in records if "i64" in r["config"]["signature"]]
    assert {r["role"] for r in wide} == ROLES and not any(r["problems"] for r in wide)


OVERSIZED = textwrap.dedent(
    """
    import dataclasses, sys
    import torch
    from vescale_optim.kernels import _ns_triton, aot

    x = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")
    _, plan = _ns_triton.newton_schulz_launches(x, 1, (3.4445, -4.775, 2.0315), 1e-7)
    poly = plan[2]
    big = dataclasses.replace(poly, meta={**poly.meta, "num_stages": 8})
    sys.exit(aot.main(["--out", sys.argv[1]], [aot.Case("newton_schulz", "8 stages", big)]))
    """
)


@pytest.mark.timeout(300)
def test_check_fails_when_stages_overflow_shared_memory(tmp_path):
    """8 stages of 128x64 and 64x128 bf16 tiles need 224-256 KiB; the blocks may have 163/227."""
    proc = subprocess.run(
        [sys.executable, "-c", OVERSIZED, str(tmp_path)],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    records = _records(tmp_path)
    assert {r["arch"] for r in records} == {80, 90}
    for r in records:
        assert r["config"]["num_stages"] == 8 and r["smem_bytes"] > aot.SMEM_LIMIT[r["arch"]]
        assert any("shared memory" in p for p in r["problems"]), r


WARM = textwrap.dedent(
    """
    import os, sys
    import torch
    from vescale_optim.kernels import _ns_triton, aot

    x = torch.empty(512, 512, dtype=torch.bfloat16, device="meta")
    _, plan = _ns_triton.newton_schulz_launches(x, 1, (3.4445, -4.775, 2.0315), 1e-7)
    case_list = [aot.Case("newton_schulz", "512", ln) for ln in plan if isinstance(ln, aot.Launch)]
    counts = []
    for _ in range(2):
        assert aot.warm([90], case_list, jobs=1) == []
        counts.append(len(os.listdir(os.environ["TRITON_CACHE_DIR"])))
    print(len(case_list), *counts)
    """
)


@pytest.mark.timeout(300)
def test_warming_fills_tritons_cache_once(tmp_path):
    """`aot --warm` (gpu_check's set-up) compiles through Triton's cache: the kernels land in
    TRITON_CACHE_DIR, and warming again finds them there (the same keys a launch looks up)."""
    proc = subprocess.run(
        [sys.executable, "-c", WARM], env=_env(tmp_path), capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    launches, first, second = map(int, proc.stdout.split()[-3:])
    assert launches >= 2 and first >= 2 and second == first


PTXAS_LOG = """\
ptxas info    : Compiling entry function '_poly_kernel' for 'sm_90a'
ptxas info    : Function properties for _poly_kernel
    16 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 400 bytes cmem[0]
"""


def test_ptxas_report_is_parsed():
    assert aot.ptxas_usage(PTXAS_LOG) == (168, 20)
    with pytest.raises(ValueError, match="register"):
        aot.ptxas_usage("ptxas fatal   : Unresolved extern function")


def _record(**kw):
    base = dict(
        kernel="poly",
        role="newton_schulz",
        arch=90,
        config={},
        smem_bytes=1024,
        regs=64,
        spills=0,
        tensor_cores=True,
        mma="wgmma",
        ptx="x.ptx",
        inputs=[],
        error=None,
    )
    return {**base, **kw}


@pytest.mark.parametrize(
    "change, problem",
    [
        (dict(smem_bytes=232449), "shared memory"),
        (dict(arch=80, smem_bytes=166913), "shared memory"),
        (dict(spills=4), "spills"),
        (dict(tensor_cores=False, mma=None), "tensor cores"),
        (dict(error="PTXASError: boom"), "does not compile"),
    ],
)
def test_check_names_each_problem(change, problem):
    assert aot.check(_record()) == []
    assert aot.check(_record(arch=90, smem_bytes=232448)) == []
    assert aot.check(_record(role="adamw8bit", tensor_cores=False, mma=None)) == []
    (found,) = aot.check(_record(**change))
    assert problem in found


def test_tensor_core_instructions_are_recognised():
    assert aot.tensor_core_ops("\twgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {...}") == "wgmma"
    assert aot.tensor_core_ops("\t@%p3 mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {...}") == "mma"
    assert aot.tensor_core_ops("\tfma.rn.f32 %f1, %f2, %f3, %f4;") is None


@pytest.mark.skipif(not aot.INTERPRET, reason="TRITON_INTERPRET=0 was set")
def test_build_refuses_the_interpreter(tmp_path):
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        aot.build(tmp_path)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        aot.warm([90])
