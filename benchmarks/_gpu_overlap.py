"""The overlap stages of `benchmarks/gpu_check.py`.

`analyse_overlap` reads a profiler trace of one ZeRO-3 step: per unit k of the backward (but
the first), the all-gather of unit k-1 (AG(k-1), issued from k's backward) against unit k's
backward compute. On CUDA only kernels on the compute stream count as compute (the stream
most of the backward's non-NCCL kernels run on: a one-rank reduce-scatter, a copy on a side
stream, is not compute), and per unit it reports the share of k's compute time in kernels that
start after AG(k-1) started on the device: the compute the gather can hide behind. A unit
passes when that share is at least `MIN_SHARE`. On CPU the same schedule is seen from the
host: AG(k-1) issued before unit k's last op.

`overlap_selftest` feeds the analyser synthetic CUDA traces: it must accept one where AG(k-1)
runs beside k's compute, and reject one where AG(k-1) starts only after k's backward ended
(with a reduce-scatter kernel on a side stream after it, which must not count as compute).
`overlap` also injects a device sleep of about half a unit's backward on the gather stream
before every backward all-gather: if nothing overlapped, the backward would grow by
(gathers x sleep); an overlapped schedule hides most of it.
"""

from __future__ import annotations

import contextlib
import json
import re
import statistics
from collections import Counter
from pathlib import Path

from benchmarks._gpu_common import NEEDS_CUDA, SIZES, _torch, sleep_cycles
from benchmarks._gpu_stages import Result

_UNIT_RANGE = re.compile(r"vescale::(unshard|pre_backward|post_backward)\[(.+)\]$")
MIN_SHARE = 0.2  # of unit k's backward compute after AG(k-1) starts (the prefetch point is at half)
MAX_GROWTH = 0.5  # of (backward gathers x sleep): an overlapped schedule hides at least half


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


def _stream(e: dict):
    return (e.get("args") or {}).get("stream")


def analyse_overlap(events: list[dict], blocks: list[str], cuda: bool) -> dict:
    """Per block k >= 1 of the backward (see the module's docstring): `share`, the fraction of
    unit k's compute-stream kernel time in kernels starting after AG(k-1) starts, and
    `lead_us`, how long before k's last compute kernel starts AG(k-1) starts; `ok` when the
    share is at least `MIN_SHARE`. On CPU: AG(k-1) issued before unit k's last op."""
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
    by_start = lambda events: sorted(events, key=lambda e: e["ts"])  # noqa: E731
    unshards = by_start(e for (kind, _), es in ranges.items() if kind == "unshard" for e in es)
    unit_of = {id(e): _UNIT_RANGE.match(e["name"])[2] for e in unshards}
    launches: dict = {}
    gathers: list[tuple[str | None, dict, dict | None]] = []  # (unit, the gather event, its unshard range)
    compute_stream = None
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
        kernels, copies = by_start(kernels), by_start(copies)
        ag = [k for k in kernels if re.match(r"nccl(Dev)?Kernel_AllGather", k["name"])]
        method, gathers = _gpu_gathers(ag, copies, unshards, unit_of, launches)
        launched = lambda e: launches.get((e.get("args") or {}).get("correlation"))  # noqa: E731
        streams = [k for k in kernels if not k["name"].startswith("nccl")]
        streams = Counter(_stream(k) for k in streams if (lk := launched(k)) is not None and inside(lk))
        compute_stream = streams.most_common(1)[0][0] if streams else None
        compute = [k for k in kernels if not k["name"].startswith("nccl") and _stream(k) == compute_stream]
    else:
        method = "issue"
        gathers = [(unit_of[id(u)], u, u) for u in unshards]
        compute = by_start(e for e in events if e.get("cat") == "cpu_op" and e["name"].startswith("aten::"))
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
            why = f"{len(mine)} compute events of {unit} in its backward, {len(theirs)} backward gathers"
            row.update(ok=False, why=f"{why} of {before}")
            per_block.append(row)
            continue
        last, gather = max(e["ts"] for e in mine), theirs[0]
        total = sum(e.get("dur", 0) for e in mine)
        after = sum(e.get("dur", 0) for e in mine if e["ts"] >= gather["ts"])
        share = after / total if total > 0 else 0.0
        ok = share >= MIN_SHARE if cuda else gather["ts"] < last
        row.update(
            gather_start_us=gather["ts"], last_compute_start_us=last, lead_us=round(last - gather["ts"], 1)
        )
        row.update(compute_events=len(mine), share=round(share, 3), ok=ok)
        if cuda:
            row.update(gather_stream=_stream(gather), compute_stream=compute_stream)
        per_block.append(row)
    out = {"method": method, "blocks": per_block, "gathers": len(gathers), "unshard_ranges": len(unshards)}
    return {**out, "compute_stream": compute_stream}


# --- synthetic traces -------------------------------------------------------------------------------


def _x(name: str, ts: float, dur: float, cat: str, tid: int = 1, **args) -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": tid, "args": args}


def synthetic_trace(gather_at: float, units: int = 4, copies: bool = False, side_kernel: bool = False):
    """A backward over blocks.{units-1} .. blocks.0 (autograd thread 2): each block's three
    compute kernels (stream 7, 60 us apart, 50 us each) launched in its pre/post_backward
    window; from it the gather of the block before is issued (a NCCL AllGather kernel on
    stream 21, or at world size 1 a device-to-device copy), starting on the device at
    `gather_at` x the block's compute span after its first kernel (1.0: when its last
    kernel has started; 1.5: after its backward ended). `side_kernel`: a non-NCCL kernel on
    stream 22 (a one-rank reduce-scatter's) launched in the window, after the gather."""
    ev = [_x("gpu_check::backward", 0, 400 * units + 100, "user_annotation")]
    corr = iter(range(1, 10_000))
    for i, k in enumerate(range(units - 1, -1, -1)):
        t0 = 100 + 400 * i
        ev.append(_x(f"vescale::pre_backward[blocks.{k}]", t0, 5, "user_annotation", tid=2))
        first = t0 + 50
        for j in range(3):
            c = next(corr)
            ev.append(_x("cudaLaunchKernel", t0 + 10 + 10 * j, 2, "cuda_runtime", tid=2, correlation=c))
            ev.append(_x(f"sm90_gemm_{k}_{j}", first + 60 * j, 50, "kernel", correlation=c, stream=7))
        ev.append(_x(f"vescale::post_backward[blocks.{k}]", t0 + 300, 5, "user_annotation", tid=2))
        if k > 0:
            c = next(corr)
            start = first + gather_at * 120
            ev.append(_x(f"vescale::unshard[blocks.{k - 1}]", t0 + 40, 5, "user_annotation", tid=2))
            launch = "cudaMemcpyAsync" if copies else "cudaLaunchKernelExC"
            ev.append(_x(launch, t0 + 41, 1, "cuda_runtime", tid=2, correlation=c))
            name = "Memcpy DtoD (Device -> Device)" if copies else "ncclDevKernel_AllGather_RING_LL(...)"
            ev.append(_x(name, start, 20, "gpu_memcpy" if copies else "kernel", correlation=c, stream=21))
            if side_kernel:
                c = next(corr)
                ev.append(_x("cudaLaunchKernel", t0 + 45, 1, "cuda_runtime", tid=2, correlation=c))
                ev.append(_x("elementwise_kernel", start + 25, 30, "kernel", correlation=c, stream=22))
    return ev


def stage_overlap_selftest(r: Result, *, out: Path, mode: str) -> None:
    """The analyser on synthetic CUDA traces (pure: the same on CPU and GPU)."""
    blocks = [f"blocks.{k}" for k in range(4)]
    cases = {
        "accepts an overlapping trace": (0.5, False, False, True),
        "accepts an overlapping trace of one-rank copies": (0.5, True, False, True),
        "rejects a gather after the backward of the unit": (1.5, False, True, False),
        "rejects it with one-rank copies": (1.5, True, True, False),
        "rejects a gather at the last kernel": (1.01, False, True, False),
    }
    found = {}
    for name, (at, copies, side, want) in cases.items():
        got = analyse_overlap(synthetic_trace(at, copies=copies, side_kernel=side), blocks, cuda=True)
        oks = [row["ok"] for row in got["blocks"]]
        shares = [row.get("share") for row in got["blocks"]]
        found[name] = {"ok": oks, "shares": shares, "compute_stream": got["compute_stream"]}
        r.check(
            name,
            len(oks) == 3 and all(ok == want for ok in oks) and got["compute_stream"] == 7,
            measured=found[name]["shares"],
            bound=f">= {MIN_SHARE}" if want else f"< {MIN_SHARE}",
            detail=f"per-unit share of compute after AG(k-1); compute stream {got['compute_stream']}",
        )
    r.measure(**found)


# --- the overlap stage ------------------------------------------------------------------------------


def _backward_ms(torch, gm, model, opt, x, y, cycles: int | None, reps: int = 3) -> tuple[float, int]:
    """The median device time of `reps` backwards (CUDA events), with a sleep of
    `cycles` before every all-gather issued in backward (on the gather stream), and
    how many gathers one backward issued."""
    from vescale_optim.shard.handle import before_issue

    times, count = [], [0]

    def sleep(kind: str) -> None:
        if kind == "all-gather":
            count[0] += 1
            torch.cuda._sleep(cycles)

    for _ in range(reps):
        loss = gm.loss_of(model, x, y)
        count[0] = 0
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with before_issue(sleep) if cycles else contextlib.nullcontext():
            loss.backward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        opt.zero_grad()
    return statistics.median(times), count[0]


def stage_overlap(r: Result, *, out: Path, mode: str) -> None:
    torch = _torch()
    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks import _gpu_models as gm

    dev, sz = gm.device_for(mode), SIZES[mode]
    cuda = dev.type == "cuda"
    trace_path = out / "overlap_trace.json"
    injection = {}
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
        if cuda:
            plain, _ = _backward_ms(torch, gm, model, opt, x, y, None)
            unit_ms = plain / len(opt.units)
            sleep_ms = unit_ms / 2
            slept, gathers = _backward_ms(torch, gm, model, opt, x, y, sleep_cycles(sleep_ms))
            growth, serial = slept - plain, gathers * sleep_ms
            injection = dict(backward_ms=plain, unit_backward_ms=unit_ms, sleep_ms=sleep_ms)
            injection["backward_gathers"] = gathers
            injection.update(slept_backward_ms=slept, growth_ms=growth, growth_if_serial_ms=serial)
    events = _trace_events(trace_path)
    result = analyse_overlap(events, blocks, cuda)
    r.measure(trace=trace_path.name, units=list(names.values()), injection=injection, **result)
    print(json.dumps({**result, "injection": injection}, indent=1))
    for row in result["blocks"]:
        if cuda:
            name, measured, bound = f"kernels.{row['block']}", row.get("share"), f">= {MIN_SHARE}"
            what = f"share of {row['block']}'s compute-stream kernel time after AG({row['gather_of']}) starts"
            what += f" (lead {row.get('lead_us')} us)"
        else:
            name, measured, bound = f"issue.{row['block']}", row.get("lead_us"), "> 0 us"
            what = "CPU rehearsal: the gather of unit k-1 is issued before the last op of unit k"
            what += f" (gather of {row['gather_of']})"
        r.check(name, row["ok"], measured=measured, bound=bound, detail=row.get("why") or what)
    if not result["blocks"]:
        r.fail("blocks", f"found no blocks among the units {list(names.values())}")
    if cuda:
        i = injection
        r.check(
            "injection",
            i["backward_gathers"] > 0 and i["growth_ms"] <= MAX_GROWTH * i["growth_if_serial_ms"],
            measured=round(i["growth_ms"], 3),
            bound=f"<= {MAX_GROWTH} x {i['growth_if_serial_ms']:.3f} ms",
            detail=f"backward {i['backward_ms']:.3f} -> {i['slept_backward_ms']:.3f} ms with a "
            f"{i['sleep_ms']:.3f} ms sleep on the gather stream before each of {i['backward_gathers']} "
            "backward all-gathers (no overlap: + gathers x sleep)",
        )
    else:
        r.skip("kernels", f"{NEEDS_CUDA}: NCCL's all-gather kernels and CUDA compute kernels on streams")
        r.skip("injection", f"{NEEDS_CUDA}: torch.cuda._sleep on the gather stream, timed by CUDA events")
