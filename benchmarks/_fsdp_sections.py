"""The `peers`, `hsdp`, `compile` and `tp` sections' tables and goals of `benchmarks/fsdp.py` (see its
docstring), and what every section's report shares: the columns measured on the device (`shown`)
and the note beside a time table (`time_note`)."""

from __future__ import annotations

import math

from benchmarks._fsdp_run import VARIANTS
from benchmarks._measure import load_average
from benchmarks._report import FSDP2_ON_CPU, table
from benchmarks._verdict import LOSS_TOL


def shown(columns: list[str], rows: list[dict], run: dict) -> list[str]:
    """The columns a table shows: on CUDA only those measured there (the scripts' docstrings say why)."""
    return [c for c in columns if any(c in r for r in rows)] if run.get("device") == "cuda" else columns


def time_note(run: dict, missing: str, script: str) -> None:
    """Print what a time table's numbers are on this device: on CUDA, that `missing` (columns) are
    not measured there; on CPU, what FSDP2's synchronous collectives mean for a ratio."""
    if run.get("device") == "cuda":
        print("\nCUDA: each phase timed until the device finished it; FSDP2 overlaps on its own streams;")
        print(f"{missing} are not measured here ({script}'s docstring says why)")
    else:
        print(f"\n{FSDP2_ON_CPU}")


PEERS_TIME = "config|train ms|train x|step ms|step x|fwd ms|bwd ms|zero_grad ms|RS win ms|update win ms"
PEERS_TIME = [*PEERS_TIME.split("|"), "AG win ms", "NS win ms", "moves win ms", "Muon win ms", "AdamW win ms"]
PEERS_TIME += ["MB sent", "stats MB"]
PEERS_MEMORY = ["config", "peak RSS MB", "peak RSS x", "RSS-base MB", "peak live MB", "peak live x"]
PEERS_MEMORY += ["opt state MB", "opt state x", "opt state x mean", "loss first", "loss after", "|Δ loss|"]
PEERS_NS = ["config", "NS GF per rank (measured)", "NS GF per rank (stats)", "NS goal GF", "NS max/mean"]
PEERS_NS += ["NS sum / total", "NS matrices per rank", "max|Δ| 1st", "max|Δ|", "Δ/moved", "Δ/update"]
# what one opt.step() contains, by the configuration's first words
CONTAINS = {"ours DDP": "DDP's averaged .grad taken into the shards (ZeRO-1), the update, AG"}
CONTAINS["ours FSDP2"] = "AdamW on FSDP2's shards; Muon's matrices moved whole to owners and back"
CONTAINS["ours"] = "the rest of RS (begun in bwd), the update (Muon: the moves and NS), AG"
CONTAINS["FSDP2 full_tensor"] = "AG of every matrix's gradient, NS of every matrix, AdamW on the shards"
CONTAINS.update(
    {"FSDP2 reshard=False": "update (RS in bwd, AG in fwd)", "FSDP2": "update (RS in bwd, AG in fwd+bwd)"}
)
CONTAINS.update({"ZeRO": "update + param broadcast (AR in bwd)", "DDP": "full update (AR in bwd)"})
STATE_SLACK = 1.05  # inside a wrapper, ours' state per rank <= STATE_SLACK / W of torch's
SAME = 1e-5  # inside a wrapper, max |Δ| of any parameter after the first step, ours against torch's
HSDP_TIME = ["config", "train ms", "train x", "step ms", "step x", "fwd ms", "bwd ms", "zero_grad ms"]
HSDP_TIME += ["exposed comm ms"]
HSDP_BYTES = (
    "config|MB inside|MB across|MB mixed|step MB inside|step MB across|step MB mixed|step MB all-to-all"
)
HSDP_BYTES = [*HSDP_BYTES.split("|"), "stats MB", "MB by kind"]
HSDP_NS = (
    "config|NS total GF|NS GF per rank (stats)|NS GF per rank (measured)|NS max rank / total|NS sum / total"
)
HSDP_NS = [*HSDP_NS.split("|"), "NS matrices per rank"]
LOSS = ["config", "loss first", "loss after", "|Δ loss|"]
COMPILE = "config|train ms|train x|x eager|fwd ms|bwd ms|step ms|peak live MB|peak live x|first step s"
COMPILE = [*COMPILE.split("|"), "compile s", "compile x", "loss after", "|Δ loss|"]
TP = "config|train ms|train x|step ms|step x|exposed comm ms|peak live MB|peak live x|peak at|MB sent"
TP = [*TP.split("|"), "stats MB", "NS GF max", "loss after", "|Δ loss|"]
TP_GOALS = {"train x": ("ours AdamW", 0.8), "step x": ("ours Muon", 0.3)}
BALANCE = 1.1  # the busiest rank's Newton–Schulz FLOPs within 10 % of an even split


def _listed(rows: list[dict]) -> list[dict]:
    """Per-rank lists and dicts as text, for a table."""
    out = []
    for r in rows:
        r = dict(r)
        for k, v in r.items():
            if isinstance(v, list):
                r[k] = " / ".join(f"{x:.3g}" if isinstance(x, float) else str(x) for x in v)
            elif isinstance(v, dict):
                r[k] = ", ".join(f"{n} {x:.3g}" for n, x in sorted(v.items()) if not isinstance(x, dict))
        out.append(r)
    return out


def _contains(config: str) -> str:
    return next(text for who, text in CONTAINS.items() if config.startswith(who))


def _peer_goals(by: dict[str, dict], world: int) -> dict[str, bool]:
    goals, o, base = {}, by.get("ours Z2 AdamW"), by.get("FSDP2 AdamW")
    if o and base and "step x" in o:
        goals[f"AdamW: opt.step() <= 0.5x FSDP2 ({o['step x']:.3f}x)"] = o["step x"] <= 0.5
        goals[f"AdamW: train step <= 1.0x FSDP2 ({o['train x']:.3f}x)"] = o["train x"] <= 1.0
        if "update win ms" in o:
            local = o["update win ms"] / base["step ms"]
            goals[f"AdamW: the local update <= 0.5x FSDP2's opt.step() ({local:.3f}x)"] = local <= 0.5
        if "peak RSS x" in o:
            goals[f"AdamW: peak RSS <= FSDP2 ({o['peak RSS x']:.3f}x)"] = o["peak RSS x"] <= 1.0
    if "ours Z2 Muon" in by:
        goals.update(_muon_goals(by, by["ours Z2 Muon"], world))
    wrapped = [r for c, r in by.items() if c.split()[:2] in (["ours", "DDP"], ["ours", "FSDP2"])]
    return {**goals, **_wrapper_goals(wrapped, world)}


def _muon_goals(by: dict[str, dict], m: dict, world: int) -> dict[str, bool]:
    goals = {}
    for p, x in (("DDP", 2.5), ("FSDP2", 5.0)):
        if f"{p} Muon" in by:
            faster = by[f"{p} Muon"]["step ms"] / m["step ms"]
            goals[f"Muon: opt.step() >= {x}x faster than {p} + torch Muon ({faster:.3g}x)"] = faster >= x
    n, done = m["NS matrices"], m.get("NS matrices per rank", [])
    once = sum(done) == n and m["orthogonalized"] == done
    goals[f"Muon: each matrix orthogonalized once ({sum(done)} of {n})"] = once
    if m.get("NS GF per rank (measured)"):
        loads = zip(m["NS GF per rank (measured)"], m["NS GF per rank (stats)"], m["ns_load"])
        close = lambda a, b, c: math.isclose(a, b, rel_tol=1e-6) and math.isclose(b * 1e9, c, rel_tol=1e-9)  # noqa: E731
        goals["Muon: each rank's Newton-Schulz FLOPs: measured == step_stats == opt.ns_load"] = all(
            close(*x) for x in loads
        )
    built = all(m["construction"].values())
    goals["Muon: the owners planned here (benchmarks._muon_plan) == vo.Muon's units, layouts, ns_load"] = (
        built
    )
    if n >= 4 * world:
        goals[f"Muon: NS max/mean <= 1.10 ({m['NS max/mean']:.3f})"] = m["NS max/mean"] <= 1.10
    if "Δ/update" in m:
        delta = m["Δ/update"]
        goals[f"Muon: the parameters of DDP + torch Muon after a step (Δ {delta:.3g} of it)"] = delta <= 0.05
    variants = [r for c, r in by.items() if c.endswith("Muon") and set(c.split()) & set(VARIANTS)]
    every = all(sum(r.get("NS matrices per rank", [])) == n for r in variants)
    goals[f"Muon: every variant ({', '.join(VARIANTS)}) steps every matrix"] = every
    return goals


def _wrapper_goals(rows: list[dict], world: int) -> dict[str, bool]:
    """Ours inside DDP and over FSDP2 against torch's optimizer under the same wrapper."""
    goals = {}
    for r in rows:
        at, family = r["config"], r["config"].split()[-1]
        whose, tol = "torch's" if " DDP " in at else "the full_tensor() peer's", LOSS_TOL[family]
        if " FSDP2 " in at and "step x" in r:
            goals[f"{at}: opt.step() <= 0.5x {whose} ({r['step x']:.3f})"] = r["step x"] <= 0.5
        if " FSDP2 " in at and "peak live x" in r:
            goals[f"{at}: peak live bytes <= 1.0x {whose} ({r['peak live x']:.3f})"] = r["peak live x"] <= 1.0
        if "opt state x" in r:  # torch's state is whole on every DDP rank; over FSDP2 only Muon's is
            x, most = r["opt state x"], STATE_SLACK / world if " DDP " in at else 1.0
            share = f"{STATE_SLACK}/W of" if " DDP " in at else "1.0x"
            goals[f"{at}: state per rank <= {share} {whose} ({x:.4f} <= {most:.4f})"] = x <= most
        if "max|Δ| 1st" in r:
            diff, loss = r["max|Δ| 1st"], r["|Δ loss|"] / abs(r["loss after"])
            goals[f"{at}: the parameters of {whose} after a step (max |Δ| {diff:.2g} <= {SAME:g})"] = (
                diff <= SAME
            )
            goals[f"{at}: the loss of {whose} after training (relative |Δ| {loss:.2g} <= {tol:g})"] = (
                loss <= tol
            )
        if family == "Muon" and "NS GF per rank (stats)" in r:
            busiest, most, n = max(r["NS GF per rank (stats)"]), r["NS goal GF"], r["NS matrices"]
            what = f"NS FLOPs on the busiest rank <= the {-(-n // world)} largest matrices'"
            goals[f"{at}: {what} ({busiest:.4g} <= {most:.4g} GF)"] = busiest <= most
            once = sum(r["NS matrices per rank"])
            goals[f"{at}: each matrix orthogonalized once in the world ({once} of {n})"] = once == n
    return goals


def print_peers(rows: list[dict], run: dict) -> dict[str, bool]:
    by = {r["config"]: r for r in rows}
    print(
        "\nx = vs FSDP2 with the same optimizer; win = the profiled step's profiler windows (slowest rank)\n"
    )
    print(table(rows, shown(PEERS_TIME, rows, run), floatfmt=".4g"))
    time_note(run, "profiler windows, exposed comm", "fsdp.py")
    if "peak live MB" in rows[0]:
        alone = "in turn in the same processes" if run.get("torchrun") else "alone in a fresh world"
        print(f"\nmemory: each config {alone}; load average {load_average()}\n")
        print(table(rows, shown(PEERS_MEMORY, rows, run), floatfmt=".4g"))
    muon = [r for r in rows if r["config"].endswith("Muon") or "max|Δ| 1st" in r]
    if muon:
        print("\nNewton–Schulz GFLOP per rank and step; Δ: against DDP's parameters (ours over FSDP2: the")
        print("full_tensor() peer's) after the first step and after training\n")
        print(table(_listed(muon), shown(PEERS_NS, muon, run), floatfmt=".4g"))
    print(f"\n{table([{'config': c, 'opt.step() contains': _contains(c)} for c in by])}")
    return _peer_goals(by, run["world"])


def _hsdp_goals(rows: list[dict], world: int) -> dict[str, bool]:
    goals = {}
    for r in rows:
        if not r["config"].endswith("Muon"):
            continue
        name, total = r["config"], r["NS total GF"]
        replicas = int(name.split()[1].split("x")[0])
        if "NS GF per rank (stats)" in r:
            s, done, n = sum(r["NS GF per rank (stats)"]), sum(r["NS matrices per rank"]), r["NS matrices"]
            goals[f"{name}: step_stats ns_flops over ranks = the total ({s:.4g} of {total:.4g} GF)"] = (
                abs(s - total) <= 1e-9 * total
            )
            goals[f"{name}: every matrix once in the world ({done} of {n})"] = done == n
        if name.startswith("ours"):
            worst, source = r["NS max rank / total"], r.get("NS from", "measured")
            what = f"busiest rank <= {BALANCE} x total/{world} ({worst:.3f} x total, {source})"
            goals[f"{name}: {what}"] = worst <= BALANCE / world
        elif "NS max rank / total" in r:  # measured (not on CUDA)
            worst, together = r["NS max rank / total"], r["NS sum / total"]
            what = f"busiest rank {worst:.3f} x total, ranks together {together:.3f} x total"
            what += f" ({replicas} replicas)"
            goals[f"{name} (peer, for reference): {what}"] = True
    return goals


def print_hsdp(rows: list[dict], run: dict) -> dict[str, bool]:
    world = run["hsdp_world"]
    print(f"\nx = vs FSDP2 2x{world // 2} with the same optimizer\n")
    print(table(rows, shown(HSDP_TIME, rows, run), floatfmt=".4g"))
    time_note(run, "exposed comm and measured FLOPs", "fsdp.py")
    print("\nMB sent per rank and train step (mean over ranks, median over steps), by where it goes;")
    print(f"step = inside opt.step(); load average {load_average()}\n")
    listed = _listed([{**r, "MB by kind": r["MB sent by kind"]} for r in rows])
    print(table(listed, HSDP_BYTES, floatfmt=".4g"))
    muon = [r for r in rows if r["config"].endswith("Muon")]
    if muon:
        ranks = " / ".join(map(str, range(world)))
        print(f"\nNewton–Schulz GFLOP per step, per rank (ranks {ranks}); load average {load_average()}\n")
        print(table(_listed(muon), shown(HSDP_NS, muon, run), floatfmt=".4g"))
    print(f"\n{table(rows, LOSS, floatfmt='.5g')}")
    return _hsdp_goals(rows, world)


def print_compile(rows: list[dict], run: dict) -> dict[str, bool]:
    import torch

    by, here = (
        {r["config"]: r for r in rows},
        f"on CPU/gloo here (torch {torch.__version__}, {run['backend']})",
    )
    print("\nx = vs FSDP2 in the same mode, x eager = vs the same library eager; first step and peak")
    print(f"live: each config alone in a fresh world, empty compiler caches; backend {run['backend']}\n")
    print(table(rows, COMPILE, floatfmt=".4g"))
    time_note(run, "exposed comm", "fsdp.py")
    if run["fsdp2_compiles"]:
        how = "`fully_shard` on every block and the model, then `block.compile()`; FSDP2's hooks are"
        print(
            f"\nFSDP2 + compile: runs {here}: {how} dynamo-disabled, so they run eagerly between the graphs"
        )
    else:
        why = run["fsdp2_compile_error"] or "not run"
        print(f"\nFSDP2 + compile: does NOT run {here}: {why}. `ours compiled` is compared with FSDP2 eager.")
    if "peak at" in rows[0]:
        print(f"\npeak at (rank with the highest peak); load average {load_average()}\n")
        print(table(rows, ["config", "peak live MB", "at step start MB", "peak at"], floatfmt=".4g"))
    goals, mine = {}, by.get("ours Z3 compiled AdamW", {})
    base = "FSDP2 compiled" if run["fsdp2_compiles"] else "FSDP2 eager (FSDP2 + compile did not run here)"
    if "train x" in mine:
        goals[f"ours compiled: train step <= 0.8x {base} ({mine['train x']:.3f}x)"] = mine["train x"] <= 0.8
    if "x eager" in mine:
        goals[f"ours compiled: train step faster than ours eager ({mine['x eager']:.3f}x)"] = (
            mine["x eager"] < 1
        )
    return goals


def print_tp(rows: list[dict], run: dict) -> dict[str, bool]:
    by = {r["config"]: r for r in rows}
    print("\nx = vs FSDP2 2-D with the same optimizer (Muon: + full_tensor() + torch.optim.Muon)\n")
    print(table(rows, shown(TP, rows, run), floatfmt=".3g"))
    time_note(run, "exposed comm", "fsdp.py")
    goals = {}
    for k, (config, most) in TP_GOALS.items():
        if k in by.get(config, {}):
            x = by[config][k]
            goals[f"{config}: {k} <= {most} against FSDP2 2-D ({x:.3f})"] = x <= most
    peaks = [by[c]["peak live x"] for c in ("ours AdamW", "ours Muon") if "peak live x" in by.get(c, {})]
    if peaks:
        goals[f"peak live bytes <= 1.0x FSDP2 2-D (AdamW and Muon: {max(peaks):.3f})"] = max(peaks) <= 1.0
    part = by.get("TP alone AdamW", {}).get("data-parallel part")
    if part:
        floor = f"train minus TP alone's {part['floor ms']:.0f} ms"
        print(f"\nthe data-parallel part of the AdamW train step ({floor}):")
        print(f"ours {part['ours ms']:.0f} ms, FSDP2 {part['FSDP2 ms']:.0f} ms, {part['x']:.3f}x")
    return goals
