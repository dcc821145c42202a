"""The stage runner behind the prepared GPU checks (`benchmarks/gpu_check.py` on one GPU,
`benchmarks/_gpu_multi.py` on eight): every stage runs in a process of its own, in its own
session, under its own time limit, so a stage that hangs (a collective) or kills its process
(an illegal memory access) is reported and the next one still runs.

A stage is a function that fills a `Result`: named checks, each `passed`, `failed` or
`skipped` with its reason, its measurement and the bound it was held to, plus free-form
measurements. A stage's status follows from its checks: `failed` if one failed (or the
stage raised, crashed or ran out of time), `skipped` if every check was skipped, else
`passed`. The runner prints each stage as it ends and writes `report.json` and
`report.md` (each stage's log beside them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._gpu_report import FAILED, PASSED, SKIPPED, markdown, print_stage

ROOT = Path(__file__).resolve().parent.parent


def jsonable(value: Any) -> Any:
    """`value` with tensors, dtypes, devices, paths and non-finite floats made JSON-safe."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if hasattr(value, "item") and getattr(value, "numel", lambda: 2)() == 1:
        return jsonable(value.item())
    return str(value)


class Result:
    """What one stage found: checks (`check`, `skip`), measurements (`measure`)."""

    def __init__(self, stage: str):
        self.stage = stage
        self.checks: list[dict] = []
        self.measurements: dict[str, Any] = {}
        self.error: str | None = None

    def check(
        self, name: str, ok: bool, *, measured: Any = None, bound: Any = None, detail: str | None = None
    ) -> bool:
        """Record check `name`: passed iff `ok`; `measured` against `bound`, `detail` in words."""
        self._add(name, PASSED if ok else FAILED, jsonable(measured), jsonable(bound), detail)
        return bool(ok)

    def _add(self, name: str, status: str, measured: Any, bound: Any, detail: str | None) -> None:
        self.checks.append(dict(name=name, status=status, measured=measured, bound=bound, detail=detail))

    def fail(self, name: str, detail: str, measured: Any = None) -> None:
        self.check(name, False, detail=detail, measured=measured)

    def skip(self, name: str, reason: str) -> None:
        """Record check `name` as skipped, with the reason (e.g. it needs CUDA)."""
        self._add(name, SKIPPED, None, None, reason)

    def measure(self, **values: Any) -> None:
        self.measurements.update(jsonable(values))

    @property
    def status(self) -> str:
        statuses = {c["status"] for c in self.checks}
        if self.error or FAILED in statuses:
            return FAILED
        if not statuses or statuses == {SKIPPED}:
            return SKIPPED if statuses else FAILED
        return PASSED

    def reason(self) -> str | None:
        if not self.checks and not self.error:
            return "the stage recorded no checks"
        if self.error:
            return self.error.strip().splitlines()[-1]
        failed = [c for c in self.checks if c["status"] == FAILED]
        if failed:
            return "; ".join(f"{c['name']}: {c['detail'] or 'outside its bound'}" for c in failed)[:2000]
        if self.status == SKIPPED:
            return "; ".join(f"{c['name']}: {c['detail']}" for c in self.checks)[:2000] or "no checks ran"
        return None

    def to_dict(self) -> dict:
        found = dict(checks=self.checks, measurements=self.measurements, error=self.error)
        return dict(stage=self.stage, status=self.status, reason=self.reason(), **found)


@dataclass
class Stage:
    """One stage: `limit` seconds per mode (`gpu`, `cpu`), what it checks, and whether its
    process runs with the library's `VESCALE_OPTIM_FORCE_COLLECTIVES=1` switch."""

    name: str
    fn: Callable[..., None]
    limits: dict[str, int]
    what: str
    env: dict[str, str] = field(default_factory=dict)
    plan: Callable[[str], list[str]] | None = None  # what it runs, by mode, for --dry-run
    warm: bool = False  # launches Triton kernels: waits for the set-up's `Warmup` first (if any)
    refused: str | None = None  # why this machine cannot run it (too few GPUs): skipped, not run


class Warmup:
    """A set-up command run in the background beside the first stages, under its own limit: Triton's
    kernel cache filled (`python -m vescale_optim.kernels.aot --warm`) while the library's own checks
    run, so that the stages marked `warm` (many processes launching the same kernels: the tests
    under pytest -n 8) load compiled kernels instead of compiling them each. `wait` is called before
    such a stage; its result is reported as the run's first entry, `warm`."""

    def __init__(self, cmd: Sequence[str], *, limit: float, log: Path, env: dict[str, str]):
        self.cmd, self.limit, self.log = list(cmd), limit, log
        self.start = time.monotonic()
        self.entry: dict | None = None
        log.write_text("$ " + " ".join(self.cmd) + "\n")
        with open(log, "ab") as out:
            detached = dict(stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
            self.proc = subprocess.Popen(self.cmd, **detached)

    def wait(self, left: float) -> dict:
        """Wait for it (at most its limit, and `left` seconds of the run); its report entry."""
        if self.entry is not None:
            return self.entry
        waited = time.monotonic()
        timeout = max(0.0, min(self.limit - (waited - self.start), left))
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        _end_session(self.proc)
        result = Result("warm")
        said = _tail(self.log, 1)
        ended = f"exit {rc}" if rc is not None else "out of time"
        result.check("finished", rc == 0, measured=ended, bound=f"{self.limit:.0f} s", detail=said)
        now = time.monotonic()
        took = {"seconds": round(now - self.start, 1), "waited_s": round(now - waited, 1)}
        self.entry = result.to_dict() | took | {"limit_s": self.limit, "log": self.log.name}
        done = f"done after {took['seconds']} s (the run waited {took['waited_s']} s)"
        print(f"== warm-up {done}: {said}", flush=True)
        return self.entry


def _cache_entries() -> int | None:
    """How many kernels Triton's cache (`TRITON_CACHE_DIR`, when set) holds: a stage that adds
    some compiled them itself."""
    where = os.environ.get("TRITON_CACHE_DIR")
    return len(os.listdir(where)) if where and os.path.isdir(where) else None


def child_env(mode: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a stage's process: the repository importable without installing
    it, the Triton interpreter on CPU only, hypothesis's `ci` profile, unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["TRITON_INTERPRET"] = "1" if mode == "cpu" else "0"
    env.setdefault("HYPOTHESIS_PROFILE", "ci")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run_process(
    cmd: Sequence[str], *, limit: float, log: Path, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> tuple[int | None, float]:
    """Run `cmd` in a session of its own with stdout and stderr into `log`; past `limit`
    seconds the whole session gets SIGTERM, then SIGKILL. Returns (exit code or None when
    it ran out of time, seconds)."""
    start = time.monotonic()
    with open(log, "ab") as out:
        how = dict(stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        proc = subprocess.Popen(list(cmd), **how)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            rc = None
        _end_session(proc)
    return rc, time.monotonic() - start


def _end_session(proc: subprocess.Popen) -> None:
    """Stop whatever is left of the session `proc` leads (its own children included)."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
        time.sleep(0.2)  # the leader is gone; give its children the same moment before SIGKILL
    if proc.poll() is None:
        proc.wait()


def _tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def host_info() -> dict:
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
    }


def run_stage_here(stages: Sequence[Stage], name: str, out: Path, **kw: Any) -> int:
    """In a stage's own process: run stage `name`, write `out/<name>.json`; 0 unless it raised."""
    stage = next(s for s in stages if s.name == name)
    for key, value in stage.env.items():
        os.environ[key] = value
    result = Result(name)
    rc = 0
    try:
        stage.fn(result, out=out, **kw)
    except BaseException as e:  # noqa: BLE001 (a stage's failure is its result)
        result.error = "".join(traceback.format_exception(e))
        print(result.error, file=sys.stderr, flush=True)
        rc = 1
    (out / f"{name}.json").write_text(json.dumps(result.to_dict(), indent=1, default=str) + "\n")
    return rc


def dry_run(
    stages: Sequence[Stage],
    mode: str,
    out: Path,
    command: Callable[[Stage], list[str]],
    budget: float,
    setup: float = 0,
) -> None:
    """Print each stage: its limit, what it checks, its process's command line and what it
    runs; then the total of the limits (plus `setup`, the runner's own seconds) and the budget."""
    total = setup
    for s in stages:
        limit = s.limits[mode]
        total += limit
        env = " ".join(f"{k}={v}" for k, v in s.env.items())
        print(f"[{s.name}] (limit {limit} s) {s.what}")
        print(f"    $ {env + ' ' if env else ''}{' '.join(command(s))} > {out / (s.name + '.log')}")
        for line in s.plan(mode) if s.plan else []:
            print(f"      runs: {line}")
    with_setup = f" with {setup:.0f} s of set-up" if setup else ""
    print(
        f"[report] {out / 'report.md'} {out / 'report.json'} (stage limits add up to {total:.0f} s"
        f"{with_setup}; the run stops at {budget:.0f} s)"
    )


def run_all(
    stages: Sequence[Stage],
    *,
    mode: str,
    out: Path,
    title: str,
    budget: float,
    command: Callable[[Stage], list[str]],
    notes: Sequence[str] = (),
    setup: float = 0,
    warmup: Warmup | None = None,
) -> int:
    """Run every stage in its own process (`command(stage)`), print each as it ends, write the
    report. Every stage gets its own limit, cut to what is left of `budget` seconds less
    `setup` (kept for the caller's own work); a stage with under 5 s left is skipped. A stage
    marked `warm` first waits for `warmup` (started by the caller; reported first). Once no
    warm-up runs beside it, each entry counts the kernels its stage added to Triton's cache
    (`compiled_kernels`: what it compiled cold).
    Returns 0 when no stage failed."""
    out.mkdir(parents=True, exist_ok=True)
    start = warmup.start if warmup is not None else time.monotonic()
    results = []
    print(f"{title} ({mode}): {len(stages)} stages, budget {budget:.0f} s; logs and report in {out}")
    for i, s in enumerate(stages, 1):
        left = budget - setup - (time.monotonic() - start)
        if s.warm and warmup is not None and warmup.entry is None:
            print_stage(warmup.wait(left))
            left = budget - setup - (time.monotonic() - start)
        limit = min(s.limits[mode], left)
        log = out / f"{s.name}.log"
        log.write_text("")
        (out / f"{s.name}.json").unlink(missing_ok=True)
        print(f"== [{i:2d}/{len(stages)}] {s.name} (limit {limit:.0f} s): {s.what}", flush=True)
        if s.refused:
            entry = _skipped(s.name, s.refused)
        elif left < 5:
            why = f"the run's budget of {budget:.0f} s was spent before this stage"
            entry = _skipped(s.name, why, budget_spent=True)
        else:
            env = child_env(mode, {**s.env, "GPU_CHECK_STAGE_LIMIT_S": f"{limit:.0f}"})
            # (while the warm-up still fills the cache, what a stage added is not its own)
            cached = _cache_entries() if warmup is None or warmup.entry is not None else None
            rc, seconds = run_process(command(s), limit=limit, log=log, env=env)
            entry = _collect(s, out, rc, seconds, limit, log, cut=limit < s.limits[mode])
            if cached is not None:
                entry["compiled_kernels"] = (_cache_entries() or 0) - cached
        entry["log"] = log.name
        results.append(entry)
        print_stage(entry)
    if warmup is not None:
        results.insert(0, warmup.wait(budget - (time.monotonic() - start)))
    total = time.monotonic() - start
    passed = all(r["status"] != FAILED and not r.get("budget_spent") for r in results)
    skipped = [(r["stage"], c) for r in results for c in r["checks"] if c["status"] == SKIPPED]
    report = dict(title=title, mode=mode, host=host_info(), seconds=round(total, 1), budget_s=budget)
    report.update(passed=passed, notes=list(notes), stages=results)
    report["skipped_checks"] = [{"check": f"{st}.{c['name']}", "reason": c["detail"]} for st, c in skipped]
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "report.md").write_text(markdown(report))
    counts = {st: sum(r["status"] == st for r in results) for st in (PASSED, FAILED, SKIPPED)}
    said = f"{counts[PASSED]} passed, {counts[FAILED]} failed, {counts[SKIPPED]} skipped in {total:.0f} s"
    print(f"{said}; report: {out / 'report.md'} and {out / 'report.json'}", flush=True)
    return 0 if report["passed"] else 1


def _skipped(name: str, why: str, **more) -> dict:
    """The report entry of a stage that did not run, and why."""
    entry = Result(name)
    entry.skip("stage", why)
    return entry.to_dict() | {"seconds": 0.0, "limit_s": 0, **more}


def _collect(s: Stage, out: Path, rc: int | None, seconds: float, limit: float, log: Path, cut: bool) -> dict:
    path = out / f"{s.name}.json"
    entry = None
    if path.exists():
        try:
            entry = json.loads(path.read_text())
        except json.JSONDecodeError:
            entry = None
    if entry is None or rc is None:
        result = Result(s.name)
        why = f"ran out of its {limit:.0f} s" if rc is None else f"its process exited with {rc} and no result"
        if rc is None and cut:
            why += " (its limit was cut to what was left of the run's budget)"
        result.error = f"{why}; the log ends:\n{_tail(log)}\n{s.name}: {why}"
        if entry is not None:  # it wrote a result, then hung (e.g. in teardown): keep what it found
            result.checks, result.measurements = entry["checks"], entry["measurements"]
        entry = result.to_dict()
    entry["seconds"], entry["limit_s"] = round(seconds, 1), round(limit)
    return entry


def parser(doc: str, stages: Sequence[Stage], out: Path, *, cpu: str, dry_run: str, budget: str, **flags):
    """A driver's command line: OUT (default `out`), --cpu, --dry-run, --stages, `flags` (each a
    flag and its help), --budget, and the internal --stage and --mode (one stage in this process)."""
    raw = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog=doc, formatter_class=raw)
    ap.add_argument("out", nargs="?", type=Path, default=out, help=f"default {out}")
    ap.add_argument("--cpu", action="store_true", help=cpu)
    ap.add_argument("--dry-run", action="store_true", help=dry_run)
    ap.add_argument("--stages", nargs="+", choices=[s.name for s in stages], help="run these only")
    for name, text in flags.items():
        ap.add_argument(f"--{name}", action="store_true", help=text)
    ap.add_argument("--budget", type=float, help=budget)
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=["gpu", "cpu"], help=argparse.SUPPRESS)
    return ap


def stage_command(script: Path, mode: str, out: Path) -> Callable[[Stage], list[str]]:
    """The command line of a stage's own process: `script --stage NAME --mode MODE OUT`."""
    return lambda s: [sys.executable, str(script), "--stage", s.name, "--mode", mode, str(out)]
