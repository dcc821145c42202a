"""The multi-GPU validation (8 GPUs of one machine, under torchrun); `benchmarks/gpu_multi.sh` is
its wrapper. Each stage runs in its own process under its own time limit (`STAGES` says what each
checks: the README's torchrun script, a resume chain 8 -> 4 -> 2 ranks, HSDP 2x4 against 1x8, a
rank killed in backward, TP training resumed exactly, fsdp.py and hsdp.py under torchrun against
FSDP2), reported in `benchmarks/results/gpu_multi/report.json` and `report.md`.

    bash benchmarks/gpu_multi.sh [OUT]            # 8 GPUs
    bash benchmarks/gpu_multi.sh --cpu [OUT]      # rehearsal: gloo CPU ranks under torchrun, 2 ranks
    bash benchmarks/gpu_multi.sh --dry-run [OUT]  # print the stages

A stage that starts more ranks than GPUs are visible is skipped by name ("needs 8 GPUs, 1
visible"); when no stage fits, the script refuses to start (exit status 2, saying why) rather than
crash every rank past the visible GPUs. With `--cpu` the rank counts are `RANKS["cpu"]`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._gpu_common import nccl_version  # noqa: E402
from benchmarks._gpu_stages import (  # noqa: E402
    ROOT,
    Result,
    Stage,
    dry_run,
    parser,
    run_all,
    run_process,
    run_stage_here,
    stage_command,
)

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_multi"
WORKER = ROOT / "benchmarks" / "_gpu_worker.py"
EXAMPLE = ROOT / "examples" / "train_torchrun.py"
TP_EXAMPLE = ROOT / "examples" / "train_tp.py"
RANKS = {  # by mode: the README script's rank counts, the resume chain, the HSDP mesh, the kill world,
    # the benchmarks' world
    "gpu": dict(readme=[2, 8], resume=[8, 4, 2], hsdp=(8, 4), kill=8, tp=8, bench=8),
    "cpu": dict(readme=[1, 2], resume=[2, 1, 2], hsdp=(2, 1), kill=2, tp=2, bench=2),
}
# the most ranks each stage starts at once: on a GPU, one GPU each (NCCL puts no two ranks on one)
NEEDS = dict(env=lambda r: 0, readme=lambda r: max(r["readme"]), resume=lambda r: max(r["resume"]))
NEEDS.update(hsdp=lambda r: r["hsdp"][0], kill=lambda r: r["kill"], tp=lambda r: r["tp"])
NEEDS["fsdp_bench"] = lambda r: r["bench"]
KILL_TIMEOUT = 20  # seconds: the library's bound on a wait in the kill stage (the group's is 30 s more)
SMALL = ["--dim", "64", "--layers", "4", "--batch-size", "8", "--seq-len", "32", "--log-every", "10"]
COLLECTIVE = re.compile(
    r"(all-gather|reduce-scatter|all-reduce|broadcast|all-to-all)[^|]* did not complete|"
    r"OpType=[A-Z_]+|Watchdog caught collective operation timeout"
)


def torchrun(n: int, *args: str) -> list[str]:
    """torchrun on this machine with `n` ranks (options of torchrun may lead `args`)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), *args]


def _run(cmd: list[str], cwd: Path, log_name: str, out: Path, limit: float) -> tuple[int | None, str, float]:
    """Run `cmd` (a torchrun) into `out/log_name` for at most `limit` seconds (3x on CPU, where a
    limit only guards against a hang on a loaded machine)."""
    if "--mode" in sys.argv and sys.argv[sys.argv.index("--mode") + 1] == "cpu":
        limit *= 3
    log = out / log_name
    log.write_text("$ " + " ".join(cmd) + "\n")
    print("$", " ".join(cmd), flush=True)
    rc, seconds = run_process(cmd, limit=limit, log=log, cwd=cwd)
    text = log.read_text(errors="replace")
    print(text[-3000:], flush=True)
    return rc, text, seconds


def stage_env(r: Result, *, out: Path, mode: str) -> None:
    import torch
    import torch.distributed as dist

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": n}
    if mode == "gpu":
        r.check("8 GPUs", n >= 8, measured=n, bound=">= 8")
        info["nccl"] = nccl_version()
        r.check("nccl", info["nccl"] is not None, measured=info["nccl"])
        if n:
            info["device"] = torch.cuda.get_device_name(0)
    else:
        r.skip("8 GPUs", "needs CUDA: --cpu rehearses with gloo CPU ranks")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--help"], capture_output=True, timeout=60
    )
    r.check("torchrun", proc.returncode == 0, measured=f"exit {proc.returncode}")
    r.check("gloo", dist.is_gloo_available(), measured=dist.is_gloo_available())
    r.measure(**info)


def readme_script() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    found = [b for b in blocks if "init_process_group" in b and "shard_modules" in b and "dcp.save" in b]
    if len(found) != 1:
        raise AssertionError(f"the README should show one complete torchrun script, found {len(found)}")
    return found[0]


def stage_readme(r: Result, *, out: Path, mode: str) -> None:
    script = out / "readme_train.py"
    script.write_text(readme_script())
    for n in RANKS[mode]["readme"]:
        with tempfile.TemporaryDirectory(prefix="gpu_multi_readme_") as tmp:
            rc, text, seconds = _run(torchrun(n, str(script)), Path(tmp), f"readme_{n}.log", out, 100)
        m = re.search(r"rank 0's last loss ([\d.naif]+)", text)
        loss = float(m[1]) if m else None
        ok = rc == 0 and loss is not None and math.isfinite(loss)
        said = f"exit {rc}, {seconds:.0f} s; rank 0's last loss" + (
            "" if ok else f"; log {out}/readme_{n}.log"
        )
        r.check(f"ranks_{n}", ok, measured=loss, detail=said)


def _losses(text: str) -> dict[int, float]:
    """The losses a training example logged ("step N: loss X"), by step."""
    return {int(s): float(x) for s, x in re.findall(r"step (\d+): loss ([\d.naif]+)", text)}


def resume_cmd(mode: str, i: int, ckpt: Path | str) -> list[str]:
    """The i-th run of the resume chain: train to step 20 * (i + 1), resuming from `ckpt`."""
    n, stop = RANKS[mode]["resume"][i], 20 * (i + 1)
    args = [str(EXAMPLE), *SMALL, "--steps", str(stop), "--save-every", "10", "--checkpoint-dir", str(ckpt)]
    return torchrun(n, *args, "--timeout", "60")


def stage_resume(r: Result, *, out: Path, mode: str) -> None:
    chain = RANKS[mode]["resume"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_multi_resume_") as tmp:
        ckpt = Path(tmp) / "ckpt"
        for i, n in enumerate(chain):
            stop = 20 * (i + 1)
            log = f"resume_{i}_{n}ranks.log"
            rc, text, seconds = _run(resume_cmd(mode, i, ckpt), Path(tmp), log, out, 100)
            want = "from scratch" if i == 0 else f"resumed from {ckpt / f'step-{20 * i}'}"
            losses = _losses(text)
            done = f"done at step {stop}" in text
            ok = rc == 0 and want in text and done and losses and all(map(math.isfinite, losses.values()))
            rows.append(dict(ranks=n, steps=stop, exit=rc, seconds=round(seconds, 1), losses=losses))
            said = f"{want!r} {'found' if want in text else 'MISSING'}; exit {rc}; loss at step {stop}"
            r.check(f"{i}.{n}_ranks_to_step_{stop}", bool(ok), measured=losses.get(stop), detail=said)
            if rc != 0:
                break
    r.measure(chain=rows)


def hsdp_cmd(mode: str) -> list[str]:
    world, shards = RANKS[mode]["hsdp"]
    return torchrun(world, str(WORKER), "hsdp", "--shards", str(shards))


def stage_hsdp(r: Result, *, out: Path, mode: str) -> None:
    rc, text, seconds = _run(hsdp_cmd(mode), ROOT, "hsdp_run.log", out, 140)
    m = re.search(r"GPU_MULTI_HSDP (\{.*\})", text)
    if rc != 0 or not m:
        r.fail("run", f"exit {rc} after {seconds:.0f} s, no result line; see {out / 'hsdp_run.log'}")
        return
    res = json.loads(m[1])
    r.measure(**res)
    a, b = res["meshes"]
    # fp32, 3 steps: the mean gradient is summed in another order (reduce-scatter over 4, then
    # all-reduce over 2, vs one reduce-scatter over 8), an ulp or two; see gpu_check's zero3 bounds
    adamw, muon, bound = res["adamw32"]["max_abs_diff"], res["muon"]["max_abs_diff"], res["muon_bound"]
    what = f"max |param({a}) - param({b})| on any rank"
    r.check("adamw", adamw <= 1e-5, measured=adamw, bound=1e-5, detail=what)
    what = f"{a} vs {b}: steps x max adjusted lr x 4 bf16 ulps"
    r.check("muon", muon <= bound, measured=muon, bound=bound, detail=what)
    once, want = "Newton-Schulz runs over all ranks in the last step (each matrix once)", res["muon.matrices"]
    for name in (a, b):
        got = res.get(f"muon.{name}.ns_matrices")
        r.check(f"muon.{name}.once", got == want, measured=got, bound=want, detail=once)


def kill_cmd(mode: str, logs: Path | str, victim: int) -> list[str]:
    """torchrun's agent looks at its workers only every 90 s here (it would otherwise stop the
    survivors as soon as the victim died): they must notice on their own, within the timeout
    (gloo notices at once: 15 s on CPU)."""
    monitor = "90" if mode == "gpu" else "15"
    worker = [str(WORKER), "kill", "--log-dir", str(logs), "--victim", str(victim)]
    worker += ["--timeout", str(KILL_TIMEOUT)]
    return torchrun(RANKS[mode]["kill"], "--monitor-interval", monitor, *worker)


def stage_kill(r: Result, *, out: Path, mode: str) -> None:
    world = RANKS[mode]["kill"]
    victim = 1
    logs = out / "kill_ranks"
    logs.mkdir(exist_ok=True)
    for f in logs.glob("rank*.log"):
        f.unlink()
    cmd = kill_cmd(mode, logs, victim)
    rc, text, seconds = _run(cmd, ROOT, "kill_run.log", out, 140)
    lines = {}
    for rank in range(world):
        path = logs / f"rank{rank}.log"
        lines[rank] = path.read_text().splitlines() if path.exists() else []
    kill_t = next((float(ln.split()[1]) for ln in lines[victim] if ln.startswith("KILL")), None)
    said = f"rank {victim}'s log: {lines[victim][-2:]}"
    r.check("victim killed in backward", kill_t is not None, measured=victim, detail=said)
    if kill_t is None:
        return
    bound = KILL_TIMEOUT + 30
    rows = []
    for rank in range(world):
        if rank == victim:
            continue
        err = next((ln for ln in lines[rank] if ln.startswith("ERROR")), None)
        after = float(err.split()[1]) - kill_t if err else None
        named = bool(err and COLLECTIVE.search(err))
        last = lines[rank][-1:] if lines[rank] else None
        rows.append(dict(rank=rank, seconds_after_kill=after, message=err[:400] if err else None, last=last))
        said = (err or f"no ERROR line; last: {lines[rank][-1:] or 'nothing'}")[:400]
        ok, took = err is not None and after <= bound and named, None if after is None else round(after, 2)
        r.check(f"rank_{rank}", ok, measured=took, bound=f"<= {bound} s, naming the collective", detail=said)
    r.measure(
        world=world, victim=victim, torchrun_exit=rc, torchrun_seconds=round(seconds, 1), survivors=rows
    )


def tp_cmd(mode: str, optimizer: str, ckpt: Path | str) -> list[str]:
    """examples/train_tp.py with tp 2 on the stage's ranks (dp4 x tp2 on 8 GPUs) to step 20."""
    args = [str(TP_EXAMPLE), "--tp", "2", "--optimizer", optimizer, "--steps", "20", "--save-every", "10"]
    args += ["--log-every", "10", "--checkpoint-dir", str(ckpt), "--timeout", "60"]
    return torchrun(RANKS[mode]["tp"], *args)


def stage_tp(r: Result, *, out: Path, mode: str) -> None:
    for optimizer in ("adamw", "muon"):
        with tempfile.TemporaryDirectory(prefix="gpu_multi_tp_") as tmp:
            ckpt = Path(tmp) / "ckpt"
            runs = []
            for i in range(2):  # from scratch, then resumed from step 10 after step-20 is removed
                if i:
                    shutil.rmtree(ckpt / "step-20", ignore_errors=True)
                log = f"tp_{optimizer}_{'resumed' if i else 'first'}.log"
                rc, text, seconds = _run(tp_cmd(mode, optimizer, ckpt), Path(tmp), log, out, 120)
                losses = _losses(text)
                printed = re.findall(r"weights fingerprint (\S+);", text)
                want = f"resumed from {ckpt / 'step-10'}" if i else "from scratch"
                ok = rc == 0 and want in text and 20 in losses and math.isfinite(losses[20]) and printed
                fingerprint = printed[0] if printed else None
                runs.append(dict(exit=rc, seconds=round(seconds, 1), losses=losses, fingerprint=fingerprint))
                found = "found" if want in text else "MISSING"
                said = f"exit {rc}, {seconds:.0f} s; {want!r} {found}; loss at step 20; log {out / log}"
                r.check(
                    f"{optimizer}.{'resumed' if i else 'first'}",
                    bool(ok),
                    measured=losses.get(20),
                    detail=said,
                )
                if not ok:
                    break
            r.measure(**{optimizer: runs})
            if len(runs) == 2 and runs[1]["exit"] == 0:
                a, b = runs[0], runs[1]
                if mode == "cpu":  # gloo on CPU: bit for bit
                    same = a["fingerprint"] == b["fingerprint"]
                    bound = "the same weights fingerprint"
                else:  # CUDA kernels need not be bitwise reproducible
                    same = abs(a["losses"][20] - b["losses"][20]) <= 1e-3 * abs(a["losses"][20])
                    bound = "last loss within 1e-3 relative"
                pair = f"{a['fingerprint']} vs {b['fingerprint']}"
                what = "the resumed run against the one that did not stop"
                r.check(f"{optimizer}.exact_resume", same, measured=pair, bound=bound, detail=what)


# the benchmarks' configurations the stage runs (hsdp.py names them at 4 ranks: 2x2 is 2 x W/2) and
# each run's limit on GPUs (3x on CPU, see _run)
BENCH = {
    "fsdp": (["ours Z3 AdamW", "FSDP2 AdamW", "ours Z3 Muon", "FSDP2 Muon"], 120),
    "hsdp": (["ours 2x2 AdamW", "FSDP2 2x2 AdamW", "ours 2x2 Muon", "FSDP2 2x2 Muon"], 80),
}
RATIOS = ["train x", "step x", "peak live x", "train ms", "peak live MB"]  # those a row has


def bench_cmd(mode: str, script: str, results: Path | str) -> list[str]:
    """`benchmarks/<script>.py --torchrun` on the stage's ranks: `--quick` sizes on CPU; on GPUs
    the benchmark's own models, 1 warm-up and 4 measured steps. Its JSON goes to `results`."""
    size = ["--quick"] if mode == "cpu" else ["--steps", "4", "--warmup", "1"]
    args = ["--torchrun", *size, "--configs", *BENCH[script][0], "--results", str(results)]
    return torchrun(RANKS[mode]["bench"], str(ROOT / "benchmarks" / f"{script}.py"), *args)


def stage_fsdp_bench(r: Result, *, out: Path, mode: str) -> None:
    results = out / "fsdp_bench"
    results.mkdir(exist_ok=True)
    for script, (_, limit) in BENCH.items():
        path = results / f"{script}_torchrun{'_quick' if mode == 'cpu' else ''}.json"
        path.unlink(missing_ok=True)
        log = f"{script}_bench.log"
        rc, _, seconds = _run(bench_cmd(mode, script, results), ROOT, log, out, limit)
        if rc != 0 or not path.exists():
            r.fail(f"{script}.py", f"exit {rc} after {seconds:.0f} s, no {path.name}; see {out / log}")
            continue
        res = json.loads(path.read_text())
        ours = {}
        for row in res["rows"]:
            if row["config"].startswith("ours"):
                name = " ".join(filter(None, [row.get("model"), row["config"]]))
                ours[name] = {k: row[k] for k in RATIOS if k in row}
        run = dict(world=res["world"], backend=res.get("backend"), device=res.get("device"))
        r.measure(**{script: dict(run, seconds=round(seconds, 1), ours_vs_fsdp2=ours)})
        need = ["train x", "step x"] + (["peak live x"] if script == "fsdp" else [])
        measured = all(math.isfinite(v.get(k, math.nan)) for v in ours.values() for k in need)
        ratios = lambda v, need=need: ", ".join(f"{k} {v[k]:.3g}" for k in need if k in v)  # noqa: E731
        said_ratios = "; ".join(f"{name}: {ratios(v)}" for name, v in ours.items())
        check = "OK" if res["loss_check_ok"] else "MISMATCH"
        said = f"seconds; {res['world']} ranks on {res.get('backend')}; loss check {check}; ours vs FSDP2: "
        said += said_ratios or "no ratios"
        r.check(
            f"{script}.py",
            bool(res["loss_check_ok"] and ours and measured),
            measured=round(seconds, 1),
            detail=said,
        )


STAGES = [
    Stage("env", stage_env, {"gpu": 30, "cpu": 150}, "GPUs, NCCL, torchrun"),
    Stage("readme", stage_readme, {"gpu": 120, "cpu": 420}, "the README's torchrun script at 2 and 8 ranks"),
    Stage("resume", stage_resume, {"gpu": 150, "cpu": 510}, "examples/train_torchrun.py resumed 8 -> 4 -> 2"),
    Stage("hsdp", stage_hsdp, {"gpu": 90, "cpu": 330}, "HSDP 2x4 equals 1x8 (vo.AdamW, vo.Muon)"),
    Stage("kill", stage_kill, {"gpu": 150, "cpu": 510}, "kill -9 of a rank in backward: the others name it"),
    Stage("tp", stage_tp, {"gpu": 150, "cpu": 600}, "examples/train_tp.py, dp4 x tp2, resumed exactly"),
    Stage("fsdp_bench", stage_fsdp_bench, {"gpu": 210, "cpu": 450}, "fsdp.py, hsdp.py --torchrun vs FSDP2"),
]
_sh = " ".join
PLANS = {  # what each stage runs, by mode (for --dry-run)
    "env": lambda m: ["torch.cuda.device_count(), torch.cuda.nccl.version(), torchrun --help"],
    "readme": lambda m: [_sh(torchrun(n, "OUT/readme_train.py")) for n in RANKS[m]["readme"]],
    "resume": lambda m: [_sh(resume_cmd(m, i, "CKPT")) for i in range(len(RANKS[m]["resume"]))],
    "hsdp": lambda m: [_sh(hsdp_cmd(m))],
    "kill": lambda m: [_sh(kill_cmd(m, "OUT/kill_ranks", 1))],
    "tp": lambda m: [_sh(tp_cmd(m, o, "CKPT")) for o in ("adamw", "muon")],
    "fsdp_bench": lambda m: [shlex.join(bench_cmd(m, s, "OUT/fsdp_bench")) for s in BENCH],
}
for _s in STAGES:
    _s.plan = PLANS[_s.name]


def visible_gpus() -> int:
    """How many GPUs this launch sees (CUDA_VISIBLE_DEVICES and the launcher's binding honoured),
    asked in a process of its own so that this one makes no CUDA context."""
    ask = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    proc = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True)
    return int(proc.stdout.strip() or 0) if proc.returncode == 0 else 0


def fitting(stages: list[Stage], gpus: int) -> tuple[list[Stage], str | None]:
    """`stages` with those needing more GPUs than `gpus` refused by name (skipped, with the count),
    or, when no stage that starts ranks fits, the words of a refusal to run at all (a rank past the
    visible GPUs would die on an invalid device ordinal)."""
    out, fits = [], []
    for s in stages:
        need = NEEDS[s.name](RANKS["gpu"])
        if need > gpus:
            s = dataclasses.replace(s, refused=f"needs {need} GPUs, {gpus} visible")
        elif need:
            fits.append(s.name)
        out.append(s)
    if any(NEEDS[s.name](RANKS["gpu"]) for s in stages) and not fits:
        counts = {s.name: NEEDS[s.name](RANKS["gpu"]) for s in stages}
        needs = ", ".join(f"{name} {n}" for name, n in counts.items() if n)
        return out, (
            f"gpu_multi needs a GPU per rank ({needs}), and {gpus} GPU(s) are visible: run "
            "benchmarks/gpu_check.sh on one GPU, or --cpu to rehearse with gloo CPU ranks"
        )
    return out, None


def main(argv: list[str] | None = None) -> int:
    budget = "seconds for the whole run (default 770; 1800 with --cpu)"
    cpu, dry = "rehearse with gloo CPU ranks (2 at most)", "print the stages, run nothing"
    ap = parser(__doc__, STAGES, DEFAULT_OUT, cpu=cpu, dry_run=dry, budget=budget)
    args = ap.parse_args(argv)
    mode = args.mode or ("cpu" if args.cpu else "gpu")
    args.budget = args.budget or (770 if mode == "gpu" else 1800)
    out = args.out.resolve()
    if args.stage:
        return run_stage_here(STAGES, args.stage, out, mode=mode)
    stages = [s for s in STAGES if not args.stages or s.name in args.stages]
    command = stage_command(Path(__file__).resolve(), mode, out)
    if args.dry_run:
        dry_run(stages, mode, out, command, args.budget)
        return 0
    notes = [f"python {sys.executable}", f"rank counts: {RANKS[mode]}"]
    if mode == "gpu":
        stages, refusal = fitting(stages, visible_gpus())
        if refusal:
            print(refusal, file=sys.stderr)
            return 2
    title = "Multi-GPU check"
    return run_all(stages, mode=mode, out=out, title=title, budget=args.budget, command=command, notes=notes)


if __name__ == "__main__":
    sys.exit(main())
