"""The tables, goals, plot and JSON of `benchmarks/hsdp.py` (see its docstring)."""

from __future__ import annotations

from benchmarks._measure import load_average
from benchmarks._report import host_line, pyplot, save_png, table
from benchmarks._verdict import shape_words, shown, time_note, verdict

TIME = ["config", "train ms", "train x", "step ms", "step x", "fwd ms", "bwd ms", "zero_grad ms"]
TIME += ["exposed comm ms"]
BYTES = "config|MB inside|MB across|MB mixed|step MB inside|step MB across|step MB mixed|step MB all-to-all"
BYTES = [*BYTES.split("|"), "stats MB", "MB by kind (rank 0, last step)"]
NS = "config|NS total GF|NS GF per rank (stats)|NS GF per rank (measured)|NS max rank / total|NS sum / total"
NS = [*NS.split("|"), "NS matrices per rank"]
LOSS = ["config", "loss first", "loss after", "|Δ loss|"]
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
                r[k] = ", ".join(f"{n} {x:.3g}" for n, x in sorted(v.items()))
        out.append(r)
    return out


def _goals(rows: list[dict], world: int = 4) -> dict[str, bool]:
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


def _plot(rows: list[dict], name: str, world: int = 4):
    plt = pyplot()
    if plt is None:
        return None
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    muon = [r for r in rows if r["config"].endswith("Muon") and "NS GF per rank (measured)" in r]
    width = 0.8 / max(1, len(muon))
    for i, r in enumerate(muon):
        per_rank = r["NS GF per rank (measured)"]
        ax.bar([k + i * width for k in range(len(per_rank))], per_rank, width, label=r["config"])
    if muon:
        total = muon[0]["NS total GF"]
        for share, style in ((world, ":"), (world // 2, "--")):
            ax.axhline(total / share, color="gray", linestyle=style, label=f"total/{share}")
        ax.set_xticks([k + 0.4 - width / 2 for k in range(world)], [f"rank {k}" for k in range(world)])
        ax.legend(fontsize=7)
    ax.set(ylabel="Newton–Schulz GFLOP per step (measured)")
    ax.set_title("Muon: orthogonalization work per rank", fontsize=9)
    bottom = [0.0] * len(rows)
    for where, color in (("inside", "tab:blue"), ("across", "tab:orange"), ("mixed", "tab:gray")):
        vals = [r[f"MB {where}"] for r in rows]
        bx.bar(range(len(rows)), vals, bottom=bottom, color=color, label=where)
        bottom = [b + v for b, v in zip(bottom, vals)]
    bx.set_xticks(range(len(rows)), [r["config"] for r in rows], rotation=30, ha="right", fontsize=8)
    bx.set(ylabel="MB sent per rank per train step")
    bx.set_title("bytes by where they go", fontsize=9)
    bx.legend(fontsize=7)
    fig.tight_layout()
    return save_png(name, fig)


def report(rows: list[dict], run: dict) -> dict:
    shape, world = run["shape"], run["world"]
    hsdp = next(iter(run["meshes"]))  # FSDP2's mesh, 2 x world/2
    if run["quick"]:
        print("--quick: a smoke run on a tiny model; its ratios say nothing about the goals")
    backend = f"{run['backend']} under torchrun" if run.get("torchrun") else "gloo"
    print(f"\n## HSDP: {rows[0]['params'] / 1e6:.1f} M params {shape_words(shape)}, W={world} ({backend});")
    print(f"{run['warmup']} warm-up + {run['steps']} interleaved steps, median of the slowest rank;")
    print(f"x = vs FSDP2 {hsdp} with the same optimizer\n")
    print(f"{host_line(run['threads'])}\n")
    print(table(rows, shown(TIME, rows, run), floatfmt=".4g"))
    time_note(run, "exposed comm and measured FLOPs", "hsdp.py")
    print("\nMB sent per rank and train step (mean over ranks, median over steps), by where it goes;")
    print(f"step = inside opt.step(); load average {load_average()}\n")
    print(table(_listed(rows), BYTES, floatfmt=".4g"))
    muon = [r for r in rows if r["config"].endswith("Muon")]
    if muon:
        ranks = " / ".join(map(str, range(world)))
        print(f"\nNewton–Schulz GFLOP per step, per rank (ranks {ranks}); load average {load_average()}\n")
        print(table(_listed(muon), shown(NS, muon, run), floatfmt=".4g"))
    print()
    print(table(rows, LOSS, floatfmt=".5g"))
    plot = lambda name: _plot(rows, name, world)  # noqa: E731
    return verdict("hsdp", rows, run, _goals(rows, world), f"W={world}", f"FSDP2 {hsdp}", plot)
