"""Distributed Muon: `vo.Muon` against DDP, FSDP2 and ZeRO with `torch.optim.Muon`, and the
owner assignment on real model shapes.

Part (a): the optimizer step on a ~22 M-parameter GPT (hidden matrices through Muon, the rest
through AdamW, `muon_groups`), 4 gloo ranks: `vo.Muon` (each matrix orthogonalized once, by an
owner) against the peers of `benchmarks._optim.peer` with `torch.optim.Muon` + AdamW. Each round
every config runs forward and backward (untimed), then `opt.step()` after a barrier (timed), the
configs taking turns; a step lasts as long as its slowest rank. `--profiled` more rounds under the
profiler give a step's breakdown (ours' `record_function` windows, the peers' Muon and AdamW steps)
and each rank's Newton-Schulz FLOPs from its matrix products. Checks: the same parameters as DDP
after the first step (5 % of the update: bf16 rounding), every matrix once in the world, each
rank's measured and reported FLOPs equal to `opt.ns_load`, and part (b)'s construction gives the
units and loads `vo.Muon` built. Part (v): each Muon variant's step in one process.

Part (b): Llama-3-8B/70B, DeepSeek-V3, GPT-OSS-120B at W in {8, 64, 256}, no processes: hidden
matrices one bucket per block or in `vo.Muon`'s default buckets, each laid out as the optimizer lays
out a unit (`plan_layout`, a granule of one row), a matrix's home the rank holding all of it, its
cost its Newton-Schulz FLOPs; then, as `vo.Muon` does, one `assign_owners` over the whole step.

    python benchmarks/muon.py              # all parts (~4 min on 2 CPU cores)
    python benchmarks/muon.py --quick      # tiny model, small part (b)
    python benchmarks/muon.py --part b     # owner assignment only
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import vescale_optim as vo  # noqa: E402
from benchmarks._gpt import gpt_loss, launch, param_count, random_batch, shaped_gpt  # noqa: E402
from benchmarks._main import finish, parse, print_goals  # noqa: E402
from benchmarks._measure import Timer, matmul_flops, median_of_max, window_seconds  # noqa: E402
from benchmarks._muon_plan import (  # noqa: E402
    BUCKET_CAP,
    assign_owners,
    assignment,
    default_buckets,
    imbalance,
    matrix_view,
    model_buckets,
    ns_flops,
)
from benchmarks._optim import MUON, MUON_ADAMW, muon_groups, muon_names, peer  # noqa: E402
from benchmarks._report import FSDP2_ON_CPU, host_line, require_finite, table  # noqa: E402
from benchmarks.model_shapes import MODELS  # noqa: E402

LABEL = {"ours": "ours (vo.Muon)", **{p: f"{p} + torch Muon" for p in ("DDP", "FSDP2", "ZeRO")}}
# bf16 matmuls run at ~3 GFLOP/s per core on CPUs without AVX512-BF16: the small hidden size keeps
# DDP's replicated Newton-Schulz (12 GFLOP per rank and step) within minutes.
FULL = dict(vocab=50304, d_model=192, n_layers=6, n_heads=6, seq_len=128, batch=2, seq=64)
QUICK = dict(vocab=2048, d_model=64, n_layers=2, n_heads=4, seq_len=32, batch=2, seq=32)
PRELOAD = ["benchmarks.muon"]  # besides benchmarks._gpt.PEERS
WINDOWS = {"RS": ["vescale_optim.sync_grads"], "NS": ["vescale_optim.newton_schulz"]}
WINDOWS["moves"] = ["vescale_optim.moves.gather", "vescale_optim.moves.finish"]
WINDOWS["AG"] = ["vescale_optim.gather_params"]


# ====================================================================== part (b)


def part_b(models: list[str], worlds: tuple[int, ...]) -> list[dict]:
    rows = []
    for model, w, bucketing in ((m, w, b) for m in models for w in worlds for b in ("block", "default")):
        buckets = model_buckets(model, bucketing)
        a = assignment(buckets, w)
        costs, homes, n = a["costs"], a["homes"], len(a["costs"])
        row = {"model": model, "W": w, "bucketing": bucketing, "buckets": len(buckets), "matrices": n}
        row.update({"per rank": n / w, "max/mean": imbalance(costs, a["owners"], w)})
        row["LPT max/mean"] = imbalance(costs, assign_owners(costs, w), w)
        row["no gather %"] = 100 * sum(h == o for h, o in zip(homes, a["owners"])) / n
        rows.append({**row, "split %": 100 * homes.count(None) / n, "assign ms": 1e3 * a["seconds"]})
    return rows


def print_b(rows: list[dict]) -> dict:
    print("\n## (b) Owner assignment on real shapes: per-rank Newton-Schulz FLOPs, max/mean\n")
    print(table(rows, floatfmt=".4g"))
    print(f"\n`block`: one bucket per transformer block; `default`: vo.Muon's buckets (cap {BUCKET_CAP:,}")
    print("elements). `max/mean`: the library's one assignment over all buckets, homes from each bucket's")
    print("layout; `LPT`: the same without homes. `no gather %`: owner == home; `split %`: matrices over")
    print("more than one rank (no home). `assign ms`: the assign_owners call.")
    goals = {}
    for bucketing in ("block", "default"):
        due = [r for r in rows if r["bucketing"] == bucketing and r["per rank"] >= 4]
        over = "".join(f"; {r['model']} W={r['W']}: {r['max/mean']:.3f}" for r in due if r["max/mean"] > 1.1)
        where = f"wherever >= 4 matrices per rank, {bucketing} buckets ({len(due)} cases)"
        goals[f"max/mean <= 1.10 {where}{over}"] = not over
    return print_goals("Goals (b):", goals)


# ====================================================================== part (a)


def _named(model) -> dict[str, torch.Tensor]:
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in model.named_parameters()}
    return {n.removeprefix("module."): p.detach().clone() for n, p in full.items()}


def _construction(shape: dict, world: int) -> dict[str, bool]:
    """Part (b)'s construction on this model's hidden matrices against a `vo.Muon` of them alone
    (collective: every rank builds one): the same units, layouts and per-rank load."""
    hidden = muon_groups(shaped_gpt(shape))[0]["params"]
    opt = vo.Muon(hidden, **MUON)
    mine = assignment(default_buckets([tuple(p.shape) for p in hidden]), world)
    units = [[tuple(p.shape) for p in u.params] for u in opt.units]
    layouts = [(u.layout.shard_size, tuple(u.layout.offsets)) for u in opt.units]
    buckets = default_buckets([tuple(p.shape) for p in hidden])
    same = {"units": units == buckets, "layouts": mine["layouts"] == layouts}
    return {**same, "ns_load": mine["load"] == list(opt.ns_load)}


def _setup_ours(config, model, rank, world, shape):
    opt = vo.Muon(muon_groups(model))

    def stats():
        rs = sum((world - 1) * u.layout.shard_size * u.params[0].element_size() for u in opt.units)
        sent = {"RS in bwd (ring, from opt.units' layouts)": rs}
        sent["in opt.step() (step_stats)"] = opt.step_stats["bytes_sent"]
        out = {k: opt.step_stats[k] for k in ("ns_flops", "ns_matrices")}
        out.update(ns_load=list(opt.ns_load), orthogonalized=opt.orthogonalized, bytes_sent=sent)
        return {**out, "construction": _construction(shape, world)}

    backward = lambda x, y: model.loss(x, y).backward()  # noqa: E731
    setup = dict(forward_backward=backward, step=opt.step, zero_grad=opt.zero_grad, stats=stats)
    return {**setup, "spent": {}, "windows": WINDOWS}


def _setup_peer(config, model, rank, world, shape):
    module, opt = peer(model, config, "Muon")
    muon, adamw = opt.opts
    spent = {"Muon": Timer(), "AdamW": Timer()}
    muon_step, adamw_step = spent["Muon"].wrap(muon.step), spent["AdamW"].wrap(adamw.step)

    def stats():
        n = sum(p.numel() for p in model.parameters())
        if config == "DDP":
            return {"bytes_sent": {"all-reduce (bwd)": int(2 * (world - 1) / world * n * 4)}}
        if config == "FSDP2":
            return {"bytes_sent": {"AG fwd+bwd, RS bwd": int(3 * (world - 1) / world * n * 4)}}
        owned = sum(p.numel() for o in (muon, adamw) for g in o.optim.param_groups for p in g["params"])
        sent = {"all-reduce (bwd)": int(2 * (world - 1) / world * n * 4)}
        sent["broadcast"] = (world - 1) * owned * 4
        return {"owned_numel": owned, "bytes_sent": sent}

    backward, step = lambda x, y: gpt_loss(module, x, y).backward(), lambda: (muon_step(), adamw_step())  # noqa: E731
    setup = dict(forward_backward=backward, step=step, zero_grad=opt.zero_grad, stats=stats)
    return {**setup, "spent": spent, "windows": {}}


def _profiled_step(config: str, s: dict) -> dict:
    """One step under the profiler: its seconds, its parts and the FLOPs of its matrix products."""
    for timer in s["spent"].values():
        timer.take()
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        t0 = time.perf_counter()
        s["step"]()
        total = time.perf_counter() - t0
    parts = {part: timer.take() for part, timer in s["spent"].items()}
    for part, prefixes in s["windows"].items():
        seconds = [window_seconds(prof, w) for w in prefixes]
        if all(x is None for x in seconds):
            raise RuntimeError(f"{config}: no profiler window {prefixes} in a step (did it move?)")
        parts[part] = sum(x for x in seconds if x is not None)
    return {"step": total, "parts": parts, "flops": matmul_flops(prof)}


def _rank(rank: int, world: int, configs: list[str], shape: dict, warmup: int, steps: int, profiled: int):
    """Every configuration on one rank, interleaved: round i steps each configuration once."""
    x, y = random_batch(shape["batch"], shape["seq"], shape["vocab"], seed=1000 + rank)
    out, setups = {}, {}
    for config in configs:
        model = shaped_gpt(shape)
        setup = _setup_ours if config == "ours" else _setup_peer
        setups[config] = {**setup(config, model, rank, world, shape), "model": model}
        out[config] = {"rank": rank, "times_s": [], "cpu_s": [], "profiled": []}
    flat, allreduce = torch.zeros(param_count(model)), []
    for i in range(warmup + steps + profiled):
        for config, s in setups.items():
            o = out[config]
            s["zero_grad"]()
            s["forward_backward"](x, y)
            dist.barrier()
            if i >= warmup + steps:
                o["profiled"].append(_profiled_step(config, s))
                continue
            t0, c0 = time.perf_counter(), time.process_time()
            s["step"]()
            o["times_s"].append(time.perf_counter() - t0)
            o["cpu_s"].append(time.process_time() - c0)
            if i == 0:
                full = _named(s["model"])  # a collective for FSDP2: every rank takes part
                if rank == 0:
                    o["after_first_step"] = full
        if i < warmup + steps:  # what DDP does in backward, outside its step: an all-reduce of every gradient
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(flat)
            allreduce.append(time.perf_counter() - t0)
    for config, s in setups.items():
        o = out[config]
        o.update(times_s=o["times_s"][warmup:], cpu_s=o["cpu_s"][warmup:], **s["stats"]())
    return {"configs": out, "allreduce_s": allreduce[warmup:]}


def _breakdown(res: list[dict]) -> dict:
    """The profiled step of the median length (over steps of the slowest rank): that rank's parts, ms."""
    slowest = [max(res, key=lambda r, i=i: r["profiled"][i]["step"]) for i in range(len(res[0]["profiled"]))]
    i = sorted(range(len(slowest)), key=lambda i: slowest[i]["profiled"][i]["step"])[(len(slowest) - 1) // 2]
    step = slowest[i]["profiled"][i]
    parts = {k: 1e3 * v for k, v in step["parts"].items()}
    other = 1e3 * step["step"] - sum(parts.values())
    return {"rank": slowest[i]["rank"], "step": 1e3 * step["step"], **parts, "other": other}


def part_a(world: int, shape: dict, warmup: int, steps: int, profiled: int, configs: list[str]) -> dict:
    t0 = time.perf_counter()
    per_rank = launch(_rank, world, configs, shape, warmup, steps, profiled, preload=PRELOAD)
    print(f"# part (a): {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    results = {c: [r["configs"][c] for r in per_rank] for c in configs}
    model = shaped_gpt(shape)
    init, names, hidden = _named(model), muon_names(model), muon_groups(model)[0]["params"]
    views = [matrix_view(tuple(p.shape)) for p in hidden]
    total = sum(count * ns_flops(rows, cols, MUON["ns_steps"]) for count, rows, cols in views)
    ref = results.get("DDP", [{}])[0].get("after_first_step")  # (popped below: not for the JSON)
    rows = []
    for config, res in results.items():
        row, got = {"config": LABEL[config], "key": config}, res[0].pop("after_first_step", None)
        rows.append(row)
        row["step ms"] = 1e3 * median_of_max([r["times_s"] for r in res])
        row["step CPU ms"] = 1e3 * median_of_max([r["cpu_s"] for r in res])
        if config in ("DDP", "ZeRO"):
            row["AR in bwd ms"] = 1e3 * median_of_max([r["allreduce_s"] for r in per_rank])
        row["breakdown"] = _breakdown(res)
        flops = [statistics.median(p["flops"] for p in r["profiled"]) for r in res]
        mean = statistics.mean(flops)
        row.update({"NS GFLOP max": max(flops) / 1e9, "NS GFLOP mean": mean / 1e9})
        row.update({"NS max/mean": max(flops) / mean, "NS sum / total": sum(flops) / total})
        row["NS GFLOP by rank (measured)"] = [f / 1e9 for f in flops]
        row["MB sent/rank max"] = max(sum(r["bytes_sent"].values()) for r in res) / 2**20
        row["MB sent (rank 0)"] = {k: v / 2**20 for k, v in res[0]["bytes_sent"].items()}
        if config == "ours":
            row["NS GFLOP by rank (stats)"] = [r["ns_flops"] / 1e9 for r in res]
            row["ns_load"] = res[0]["ns_load"]
            row["matrices by rank"] = [r["ns_matrices"] for r in res]
            row["orthogonalized by rank"] = [r["orthogonalized"] for r in res]
            row["construction"] = {k: all(r["construction"][k] for r in res) for k in res[0]["construction"]}
        if ref is not None:
            diff = {k: (got[k] - ref[k]).abs().max().item() for k in ref}
            row["max|Δ| Muon"] = max(diff[k] for k in names)
            row["max|Δ| AdamW"] = max(v for k, v in diff.items() if k not in names)
            row["Δ/update"] = row["max|Δ| Muon"] / max((ref[k] - init[k]).abs().max().item() for k in names)
    ours = next((r for r in rows if r["key"] == "ours"), None)
    for r in (r for r in rows if ours):
        r["ours faster x"] = r["step ms"] / ours["step ms"]
        r["ours faster x (+AR)"] = (r["step ms"] + r.get("AR in bwd ms", 0)) / ours["step ms"]
        r["ours faster x (CPU)"] = r["step CPU ms"] / ours["step CPU ms"]
        # Rounds share the ambient load, so the per-round ratio is the steadiest estimate.
        mine, theirs = (zip(*(x["times_s"] for x in results[c])) for c in ("ours", r["key"]))
        r["ours faster x (per round)"] = statistics.median(max(t) / max(m) for t, m in zip(theirs, mine))
    out = {"rows": rows, "params": param_count(model), "hidden_params": sum(p.numel() for p in hidden)}
    out.update(hidden_matrices=len(hidden), ns_total=total, threads=per_rank.threads, raw=results)
    return out


COLUMNS = "config|step ms|ours faster x|AR in bwd ms|ours faster x (+AR)|ours faster x (per round)"
COLUMNS = [*COLUMNS.split("|"), "step CPU ms", "ours faster x (CPU)", "NS GFLOP max", "NS GFLOP mean"]
COLUMNS += ["NS max/mean", "NS sum / total", "MB sent/rank max", "max|Δ| Muon", "max|Δ| AdamW", "Δ/update"]


A_NOTE = """`AR in bwd ms`: one all-reduce of all gradients, what DDP and ZeRO move in backward, outside
their step. `per round`: median over rounds of the ratio within a round. `step CPU ms`: process CPU
time (gloo threads included). `NS GFLOP`: each rank's Newton-Schulz work, from the profiler's FLOPs
of its matrix products in a profiled step; `sum / total`: all ranks' over the model's (every matrix
once). `MB sent`: peers and ours' reduce-scatter from buffer sizes and ring collectives, ours' step
from `step_stats`. `Δ/update`: max |Δ| of Muon parameters after a step vs DDP, over the largest
change it made.
"""


def _goals_a(by: dict, n: int, world: int) -> dict[str, bool]:
    """Part (a)'s checks of ours (those that apply), against the peers in `by`."""
    o = by["ours"]
    faster = [(p, x) for p, x in (("DDP", 2.5), ("FSDP2", 5.0)) if p in by]
    checks = [(f">= {x}x faster than {LABEL[p]}", by[p]["step ms"] >= x * o["step ms"]) for p, x in faster]
    once = sum(o["matrices by rank"]) == n and o["orthogonalized by rank"] == o["matrices by rank"]
    checks.append((f"each matrix orthogonalized once ({sum(o['matrices by rank'])} of {n})", once))
    measured = [f * 1e9 for f in o["NS GFLOP by rank (measured)"]]
    flops = zip(measured, [s * 1e9 for s in o["NS GFLOP by rank (stats)"]], o["ns_load"])
    same = lambda m, s, load: math.isclose(m, s, rel_tol=1e-6) and math.isclose(s, load, rel_tol=1e-9)  # noqa: E731
    flops = all(same(*f) for f in flops)
    checks.append(("each rank's Newton-Schulz FLOPs: measured == step_stats == opt.ns_load", flops))
    built = all(o["construction"].values())
    checks.append(("part (b)'s construction == vo.Muon's (units, layouts, ns_load)", built))
    if n >= 4 * world:
        checks.append(("NS max/mean <= 1.10 (>= 4 matrices per rank)", o["NS max/mean"] <= 1.10))
    if "Δ/update" in o:
        checks.append(("same parameters as DDP + torch Muon (Δ <= 5% of the update)", o["Δ/update"] <= 0.05))
    return dict(checks)


def print_a(a: dict, world: int, shape: dict, warmup: int, steps: int) -> dict:
    rows = a["rows"]
    require_finite(rows, COLUMNS)
    hidden = f"{a['hidden_params'] / 1e6:.2f} M in {a['hidden_matrices']} hidden matrices -> Muon, the rest"
    print(f"\n## (a) Optimizer step, GPT: {a['params'] / 1e6:.1f} M params, {hidden} -> AdamW")
    model = f"vocab {shape['vocab']}, d {shape['d_model']}, {shape['n_layers']} layers"
    print(f"({model}); world {world} (gloo); {warmup} warm-up + {steps} timed steps; median, slowest rank\n")
    print(f"{host_line(a['threads'])}\n")
    print(table(rows, COLUMNS, floatfmt=".4g"))
    print(f"\n{FSDP2_ON_CPU}\n\n{A_NOTE}")
    by = {r["key"]: r for r in rows}
    for r in by.values():
        parts = ", ".join(f"{k} {v:.1f}" for k, v in r["breakdown"].items() if k != "rank")
        sent = ", ".join(f"{k} {v:.2f}" for k, v in r["MB sent (rank 0)"].items())
        more = ""
        if r["key"] == "ours":
            stats = [round(f, 4) for f in r["NS GFLOP by rank (stats)"]]
            more = f"; matrices/rank {r['matrices by rank']}, orthogonalized/rank "
            more += f"{r['orthogonalized by rank']}, NS GFLOP/rank (stats) {stats}"
        step = f"ms in the median profiled step (rank {r['breakdown']['rank']})"
        print(f"- {r['config']}: {step}: {parts}; MB sent by rank 0: {sent}{more}")
    goals = _goals_a(by, a["hidden_matrices"], world) if "ours" in by else {}
    return print_goals("Goals (a):", goals)


VARIANTS = {"muon": {}, "polar": {"ns_coefficients": "polar_express"}, "normuon": {"normuon": True}}


def part_v(shape: dict, warmup: int, steps: int) -> list[dict]:
    """The step time of each Muon variant (`VARIANTS`: torch's coefficients, Polar Express,
    NorMuon) in one process on part (a)'s model, from the same weights and gradients: the
    median of `steps` timed `opt.step()` calls after `warmup`."""
    rows = []
    for name, keys in VARIANTS.items():
        torch.manual_seed(0)
        model = shaped_gpt(shape)
        opt = vo.Muon(muon_groups(model), **keys)
        x, y = random_batch(shape["batch"], shape["seq"], shape["vocab"], seed=0)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        times = []
        for t in range(warmup + steps):
            start = time.perf_counter()
            opt.step()
            if t >= warmup:
                times.append(time.perf_counter() - start)
        row = {"variant": name, "step ms": 1e3 * statistics.median(times)}
        rows.append({**row, "matrices": opt.step_stats["ns_matrices"]})
    return rows


def print_v(rows: list[dict]) -> dict[str, bool]:
    print("\n## Muon variants: one process, optimizer step (median)\n")
    print(table(rows, ["variant", "step ms", "matrices"]))
    same = len({r["matrices"] for r in rows}) == 1
    return print_goals("variants", {"every variant steps every matrix": same})


def main(argv: list[str] | None = None) -> dict:
    args = parse(
        __doc__,
        argv,
        "tiny model, fewer steps, small part (b)",
        world_size=4,
        steps=(5, "measured steps (median over these)"),
        warmup=1,
        profiled=(2, "profiled steps: breakdown and measured FLOPs"),
        part=dict(
            choices=["a", "b", "ab", "v", "abv"], default="abv", help="a: vs peers; b: owners; v: variants"
        ),
        configs=dict(nargs="+", default=list(LABEL), choices=list(LABEL)),
        models=dict(nargs="+", default=list(MODELS), choices=list(MODELS)),
    )
    shape = QUICK if args.quick else FULL
    if args.quick:
        args.steps, args.warmup, args.profiled = min(args.steps, 3), min(args.warmup, 1), 1
        print("--quick: a smoke run on a tiny model; its ratios say nothing about the goals")
    if args.profiled < 1:
        args.error("--profiled: at least 1 (the breakdown and the FLOPs come from it)")
    t0 = time.perf_counter()
    out: dict = {"world_size": args.world_size, "shape": shape, "muon": MUON, "adamw": MUON_ADAMW}
    out.update(warmup=args.warmup, steps=args.steps, profiled=args.profiled, goals={})
    if "a" in args.part:
        out["a"] = part_a(args.world_size, shape, args.warmup, args.steps, args.profiled, args.configs)
        out["goals"].update(print_a(out["a"], args.world_size, shape, args.warmup, args.steps))
    if "b" in args.part:
        models = ["llama3-8b", "gpt-oss-120b"] if args.quick else args.models
        out["b"] = part_b(models, (8, 64) if args.quick else (8, 64, 256))
        out["goals"].update(print_b(out["b"]))
    if "v" in args.part:
        out["v"] = part_v(shape, args.warmup, args.steps)
        out["goals"].update(print_v(out["v"]))
    print(f"total {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return finish("muon", args, out, out["a"]["threads"] if "a" in out else None)


if __name__ == "__main__":
    main()
