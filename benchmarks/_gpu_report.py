"""What the prepared GPU checks write and print (`benchmarks/_gpu_stages.py` runs the stages):
each stage as it ends, `report.md`, and for `benchmarks/gpu_check.py` the two files that come
back, `summary.md` (under 8 KB) and `gpu_check.tar.gz`."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
SUMMARY_BYTES = 8000


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict | list):
        text = json.dumps(value, default=str)
        return text if len(text) <= 160 else text[:157] + "..."
    return str(value)


def check_line(c: dict) -> str:
    tag = {PASSED: "ok  ", FAILED: "FAIL", SKIPPED: "skip"}[c["status"]]
    text = f"{tag} {c['name']}"
    if c["measured"] is not None:
        text += f": {_fmt(c['measured'])}"
        if c["bound"] is not None:
            text += f" (bound {_fmt(c['bound'])})"
    if c["detail"]:
        text += f" - {c['detail']}"
    return text


def print_stage(entry: dict) -> None:
    print(f"   {entry['status']} in {entry['seconds']} s", flush=True)
    for c in entry["checks"]:
        print("   " + check_line(c).replace("\n", "\n     "), flush=True)
    if entry.get("error"):
        print("   | " + "\n   | ".join(entry["error"].strip().splitlines()[-8:]), flush=True)


def markdown(report: dict) -> str:
    md = [
        f"# {report['title']} ({report['mode']})",
        "",
        f"{report['host']['hostname']}, {report['host']['platform']}, Python {report['host']['python']}; "
        f"{report['seconds']} s of a {report['budget_s']:.0f} s budget; "
        f"{'no stage failed' if report['passed'] else 'FAILED'}",
        "",
    ]
    md += [f"- {n}" for n in report["notes"]]
    md += ["", "| stage | status | seconds | limit s | kernels compiled | reason |"]
    md += ["|---|---|---:|---:|---:|---|"]
    for r in report["stages"]:
        reason = (r["reason"] or "").replace("|", "\\|").replace("\n", " ")
        compiled = r.get("compiled_kernels", "")
        cells = [r["stage"], r["status"], r["seconds"], r["limit_s"], compiled, reason[:300]]
        md.append("| " + " | ".join(map(str, cells)) + " |")
    for r in report["stages"]:
        md += ["", f"## {r['stage']}: {r['status']}", ""]
        md += [f"- {check_line(c)}" for c in r["checks"]]
        if r["measurements"]:
            md += ["", "```json", json.dumps(r["measurements"], indent=1, default=str)[:6000], "```"]
        if r.get("error"):
            md += ["", "```", r["error"].strip()[-3000:], "```"]
        md.append(f"\nlog: `{r['log']}`")
    return "\n".join(md) + "\n"


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
            if c["status"] == FAILED:
                said = f"{c['measured']} (bound {c['bound']}) {c['detail'] or ''}"
                lines.append(f"- FAIL {r['stage']}.{c['name']}: {said}"[:400])
        if r.get("error"):
            lines.append(f"- ERROR {r['stage']}: {r['error'].strip().splitlines()[-1][:300]}")
    skipped = [s["check"] for s in report.get("skipped_checks", [])]
    if skipped:
        lines.append(f"- skipped: {', '.join(skipped)}"[:1200])
    lines += ["", "## measured", ""]
    for r in report["stages"]:
        for c in r["checks"]:
            if c["status"] == PASSED and c["measured"] is not None:
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
