"""The rows of `benchmarks/fsdp.py`: one per configuration of a run, from every rank's results of
`benchmarks._fsdp_run` (see fsdp.py's docstring for the columns), with the ratios to its peer."""

from __future__ import annotations

import statistics

from benchmarks._fsdp_run import VARIANTS, WINDOWS, mesh_of
from benchmarks._gpt import shaped_gpt
from benchmarks._measure import median_ratio, slowest
from benchmarks._muon_plan import matrix_view, ns_flops
from benchmarks._optim import MUON, muon_groups, muon_names
from benchmarks._train import PHASES, against_peers, ms, timed_row

# row keys with no meaning on CUDA (fsdp.py's docstring says why)
NOT_ON_CUDA = ["_update", "update ms", "update % step", "exposed comm ms", "exposed/phase ms", "copies"]
NOT_ON_CUDA += [
    "own slice copies",
    "c10d copies",
    "compute copies",
    "copy events",
    "NS GF per rank (measured)",
]
NOT_ON_CUDA += [f"{k} win ms" for k in WINDOWS]


# the TP section's: Muon against the full_tensor integration; the TP-alone floor against nothing
TP_PEER = {"ours Muon": "FSDP2 full_tensor Muon", "TP alone AdamW": None}


def peer(config: str, world: int = 4) -> str | None:
    """The configuration a configuration is compared with: FSDP2's HSDP (2 x W/2) for one on a mesh,
    torch's optimizer under the same wrapper for ours inside one (`reference`), else FSDP2 with the
    same optimizer; none for a Muon variant (another algorithm)."""
    if config in TP_PEER:
        return TP_PEER[config]
    if set(config.split()) & set(VARIANTS):
        return None
    if config.startswith("ours") and {"DDP", "FSDP2"} & set(config.split()):  # inside a wrapper
        return reference(config)
    family = f"compiled {config.split()[-1]}" if "compiled" in config.split() else config.split()[-1]
    return f"FSDP2 2x{world // 2} {family}" if mesh_of(config) else f"FSDP2 {family}"


def hidden_flops(shape: dict) -> list[int]:
    """Newton–Schulz FLOPs of one step of each Muon matrix of the GPT (a stack's slices one each), or
    of the TP model's blocks (four d x d, three d x 4d)."""
    if "tp" in shape:
        d = shape["dim"]
        return [ns_flops(d, d, MUON["ns_steps"])] * 4 * shape["layers"] + [
            ns_flops(d, 4 * d, MUON["ns_steps"])
        ] * 3 * shape["layers"]
    hidden = [matrix_view(tuple(p.shape)) for p in muon_groups(shaped_gpt(shape, device="meta"))[0]["params"]]
    return [ns_flops(rows, cols, MUON["ns_steps"]) for n, rows, cols in hidden for _ in range(n)]


def _mean_mb(per_rank: list[list[dict]], where: str = "", kind: str = "") -> float:
    """Median over steps of the mean over ranks of the bytes sent `where` (of the `kind`), in MB."""
    sent = lambda d: sum(v for k, v in d.items() if k.startswith(where) and k.endswith(kind))  # noqa: E731
    per_step = [statistics.mean(sent(d) for d in col) for col in zip(*per_rank)]
    return statistics.median(per_step) / 2**20 if per_step else 0.0


def _comm(row: dict, res: list[dict]) -> None:
    """Exposed communication, what is left of the step without it, and the bytes sent (by kind, and
    inside / across shard groups)."""
    exposed = {k: slowest([r["exposed_s"][k] for r in res]) for k in PHASES}
    row["_update"] = slowest(
        [[t - e for t, e in zip(r["times_s"]["step"], r["exposed_s"]["step"])] for r in res]
    )
    row["update ms"] = ms(row["_update"])
    row["update % step"] = 100 * row["update ms"] / row["step ms"] if row["step ms"] else 0.0
    row["exposed comm ms"] = ms([sum(t) for t in zip(*exposed.values())])
    row["exposed/phase ms"] = {k: ms(v) for k, v in exposed.items()}
    sent = res[0]["comm"].get("sent", {})
    row.update(
        {"MB sent": sum(sent.values()) / 2**20, "MB sent by kind": {k: v / 2**20 for k, v in sent.items()}}
    )
    row["calls"] = res[0]["comm"].get("calls", {})
    by, step = [r["sent"] for r in res], [r["step_sent"] for r in res]
    row.update({f"MB {w}": _mean_mb(by, w) for w in ("inside", "across", "mixed", "unknown")})
    row.update({f"step MB {w}": _mean_mb(step, w) for w in ("inside", "across", "mixed")})
    row["step MB all-to-all"] = _mean_mb(step, kind="all-to-all")


def _profiled(row: dict, res: list[dict]) -> None:
    """The profiled step: rank 0's copies by path and stand-in time, the slowest rank's seconds in
    each profiler window, ours' own counts (`step_stats`) and the optimizer state."""
    r0, copies = res[0], res[0]["copies"] or {}
    row["copies"] = sum(copies.get(p, {}).get("copies", 0) for p in ("collective path", "grad accum"))
    row.update({f"{p} copies": copies.get(p, {}).get("copies", 0) for p in ("own slice", "c10d", "compute")})
    row["copy events"] = copies
    row["stand-in ms"] = 1e3 * (r0.get("stand_ins_s") or 0.0)
    row["stand-in % fwd"] = 100 * row["stand-in ms"] / row["fwd ms"] if row["fwd ms"] else 0.0
    for k in r0["windows_s"]:
        row[f"{k} win ms"] = 1e3 * max(r["windows_s"].get(k, 0.0) for r in res)
    row["opt state MB"] = max(r["state_bytes"] for r in res) / 2**20
    row["opt state MB mean"] = statistics.mean(r["state_bytes"] for r in res) / 2**20
    if r0["stats"]:
        stats = [r["stats"][-1] for r in res]
        row["stats MB"] = statistics.mean(s.get("bytes_sent", 0) for s in stats) / 2**20
        if row["config"].endswith("Muon"):
            row["NS GF per rank (stats)"] = [s["ns_flops"] / 1e9 for s in stats]
            row["NS matrices per rank"] = [s["ns_matrices"] for s in stats]
    if "ns_load" in r0:  # ours Muon: the plan's load of every rank, and what each did
        row.update(ns_load=r0["ns_load"], construction=r0["construction"])
        row["orthogonalized"] = [r["orthogonalized"] for r in res]


def _newton_schulz(row: dict, res: list[dict], flops: list[int], world: int) -> None:
    """Newton–Schulz work per rank against the model's total (measured on the CPU; from ours' stats
    on CUDA, `NS from`), and the goal of the busiest rank: the FLOPs of the ceil(n/W) largest of the
    n matrices, the most a rank carries when whole matrices are spread as evenly by count as they
    can be and it drew the largest."""
    total = sum(flops)
    row.update({"NS total GF": total / 1e9, "NS matrices": len(flops)})
    row["NS goal GF"] = sum(sorted(flops, reverse=True)[: -(-len(flops) // world)]) / 1e9
    row["NS GF per rank (measured)"] = [(r["ns_measured"] or 0) / 1e9 for r in res]
    measured = row["NS GF per rank (measured)"]
    if res[0]["device"] == "cuda":
        measured = row.get("NS GF per rank (stats)")
        row["NS from"] = "stats"
    if measured:
        row["NS GF max"] = max(measured)
        row["NS max rank / total"] = max(measured) * 1e9 / total
        row["NS sum / total"] = sum(measured) * 1e9 / total
        row["NS max/mean"] = max(measured) / statistics.mean(measured) if sum(measured) else 1.0


def _memory(row: dict, mem: list[dict]) -> None:
    if "first_s" in mem[0]:  # a compiled run's: its first step from an empty compiler cache
        row["first step s"] = max(m["first_s"] for m in mem)
        if "compiled" in row["config"].split():
            row["compile s"] = row["first step s"] - statistics.median(slowest([m["later_s"] for m in mem]))
    if "source" in mem[0]:  # CUDA: the allocator's peak; no place nor RSS
        peak, start = (max(m[k] for m in mem) / 2**20 for k in ("live_peak", "live_start"))
        row.update({"peak live MB": peak, "at step start MB": start, "memory": mem})
        return
    top = max(mem, key=lambda m: m["live_peak"])
    row["peak live MB"] = top["live_peak"] / 2**20
    row["at step start MB"] = max(m["live_start"] for m in mem) / 2**20
    row.update({"peak at": " > ".join(top["live_where"][1:]), "peak by": top["live_by"]})
    row["peak RSS MB"] = max(m["rss_peak_kb"] for m in mem) / 1024
    row["RSS-base MB"] = max(m["rss_peak_kb"] - m["rss_base_kb"] for m in mem) / 1024
    row["memory"] = mem


def _row(model: str, config: str, res: list[dict], mem: list[dict] | None, ns: list[int], world: int) -> dict:
    """One configuration's row from every rank's timing (and memory) results."""
    row = {"model": model, **timed_row(config, res)}
    _comm(row, res)
    _profiled(row, res)
    if config.endswith("Muon"):
        _newton_schulz(row, res, ns, world)
    if res[0]["device"] == "cuda":
        for k in NOT_ON_CUDA:
            row.pop(k, None)
    if mem:
        _memory(row, mem)
    return row


def reference(config: str) -> str:
    """Whose parameters a configuration's are held to: torchtitan's over FSDP2 for ours over FSDP2,
    else DDP's with the same optimizer."""
    return "FSDP2 full_tensor Muon" if config.startswith("ours FSDP2") else f"DDP {config.split()[-1]}"


def _same_parameters(rows: dict, timed: dict[str, list[dict]], shape: dict) -> None:
    """Each row's parameters (rank 0) after the first step and after training against its
    `reference`'s: `max|Δ| 1st` and `max|Δ|`, the latter over the most training moved one of the
    reference's (`Δ/moved`); Muon's, the first over the largest change the reference's first step
    made to a matrix (`Δ/update`: bf16 Newton–Schulz rounds apart)."""
    if not any(res[0].get("first") for res in timed.values()):
        return
    model = shaped_gpt(shape)
    init, names = dict(model.named_parameters()), muon_names(model)
    most = lambda a, b, keys: max((a[k] - b[k]).abs().max().item() for k in keys)  # noqa: E731
    for config, row in rows.items():
        mine, ref = timed[config][0], timed.get(reference(config), [{}])[0]
        if mine.get("first") is None or ref.get("first") is None or config == reference(config):
            continue
        row["max|Δ| 1st"], row["max|Δ|"] = (
            most(mine["first"], ref["first"], init),
            most(mine["last"], ref["last"], init),
        )
        row["Δ/moved"] = row["max|Δ|"] / most(ref["last"], init, init)
        if config.endswith("Muon"):
            row["Δ/update"] = most(mine["first"], ref["first"], names) / most(ref["first"], init, names)


def _data_parallel_part(rows: dict) -> dict:
    """What data parallelism adds to the TP model's AdamW train step, ours and FSDP2's: the median
    over steps of the slowest rank's train time less the TP-alone floor's in the same step (forward,
    backward and the TP all-reduces, which both issue alike), and their ratio."""
    floor = rows["TP alone AdamW"]["_train"]
    ours, fsdp2 = (
        statistics.median(1e3 * (a - f) for a, f in zip(rows[c]["_train"], floor))
        for c in ("ours AdamW", "FSDP2 AdamW")
    )
    return {"floor ms": ms(floor), "ours ms": ours, "FSDP2 ms": fsdp2, "x": ours / fsdp2}


def summarize(model: str, shape: dict, timed: dict, memory: dict, world: int) -> list[dict]:
    """Table rows for one run, with ratios against each configuration's FSDP2 peer."""
    ns = hidden_flops(shape)
    rows = {c: _row(model, c, res, memory.get(c), ns, world) for c, res in timed.items()}
    _same_parameters(rows, timed, shape)
    # FSDP2 eager stands in for FSDP2 compiled where that did not run
    mine = lambda c: peer(c, world) if peer(c, world) in rows else peer(c.replace(" compiled", ""), world)  # noqa: E731
    for row in rows.values():
        base, eager = rows.get(mine(row["config"])), rows.get(row["config"].replace(" compiled", ""))
        if "compiled" in row["config"].split() and eager:
            row["x eager"] = median_ratio(row["_train"], eager["_train"])
        if base is not None and row.get("compile s") and base.get("compile s", 0) > 0:
            row["compile x"] = row["compile s"] / base["compile s"]
        for k in ("peak live MB", "peak RSS MB", "opt state MB"):
            if base is not None and row.get(k) and base.get(k):
                row[f"{k.rsplit(' ', 1)[0]} x"] = row[k] / base[k]
        if base is not None and base.get("opt state MB"):
            row["opt state x mean"] = row["opt state MB mean"] / base["opt state MB"]
    if "TP alone AdamW" in rows:
        rows["TP alone AdamW"]["data-parallel part"] = _data_parallel_part(rows)
    keys = ["train", "step", "update"] if all("_update" in r for r in rows.values()) else ["train", "step"]
    return against_peers(rows, mine, keys)
