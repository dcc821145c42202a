"""The tables, goals, plot and JSON of `benchmarks/fsdp.py` (see its docstring)."""

from __future__ import annotations

from benchmarks._measure import load_average
from benchmarks._report import host_line, pyplot, save_png, table
from benchmarks._verdict import shape_words, shown, time_note, verdict

TIME = "config|train ms|train x|step ms|step x|update ms|update x|update % step|fwd ms|bwd ms|zero_grad ms"
TIME = [*TIME.split("|"), "stand-in ms", "stand-in % fwd", "exposed comm ms", "MB sent", "copies"]
TIME += ["own slice copies", "c10d copies", "compute copies"]
MEMORY = "config|peak live MB|peak live x|at step start MB|peak at|peak RSS MB|peak RSS x|RSS-base MB"
MEMORY = [*MEMORY.split("|"), "loss first", "loss after", "|Δ loss|"]
COMM = ["config", "exposed fwd", "exposed bwd", "exposed step", "MB sent by kind (calls)"]
BY = ["config", "peak live MB", "alive at the peak, MB by where it was allocated"]
SCALING = [
    "config",
    "W",
    "peak live MB",
    "peak B/param",
    "at step start B/param",
    "at step start B/param x W",
]
PEAK_GOAL = {"wide": 0.9, "gpt": 1.0}


def _on_cuda(run: dict) -> bool:
    return run.get("device") == "cuda"


def _comm_row(r: dict) -> dict:
    sent, calls = r["MB sent by kind"], r["calls"]
    kinds = [f"{k} {v:.3g} ({calls.get(k, 0)})" for k, v in sorted(sent.items())]
    kinds += [f"{k} ({n})" for k, n in sorted(calls.items()) if k not in sent and n]
    row = {"config": r["config"], "MB sent by kind (calls)": ", ".join(kinds)}
    if "exposed/phase ms" in r:  # not on CUDA
        e = r["exposed/phase ms"]
        row.update({"exposed fwd": e["fwd"], "exposed bwd": e["bwd"], "exposed step": e["step"]})
    return row


def _by_row(r: dict) -> dict:
    by = sorted(r["peak by"].items(), key=lambda kv: -kv[1])
    shown = [f"{k} {v / 2**20:.3g}" for k, v in by if v >= 0.02 * r["peak live MB"] * 2**20]
    return {"config": r["config"], "peak live MB": r["peak live MB"], BY[2]: "; ".join(shown)}


def _goals(rows: list[dict]) -> dict[str, bool]:
    goals = {}
    for r in rows:
        if not r["config"].startswith("ours Z3"):
            continue
        m, fam = r["model"], r["config"].removeprefix("ours Z3 ")
        if "peak live x" in r:
            limit, x = PEAK_GOAL[m], r["peak live x"]
            goals[f"{m} {fam}: peak live bytes <= {limit}x FSDP2 ({x:.3f}x)"] = x <= limit
        if "train x" in r:
            update = f"; its update alone {r['update x']:.3f}x" if "update x" in r else ""
            goals[f"{m} {fam}: train step <= 0.8x FSDP2 ({r['train x']:.3f}x)"] = r["train x"] <= 0.8
            goals[f"{m} {fam}: opt.step() <= 0.5x FSDP2 ({r['step x']:.3f}x{update})"] = r["step x"] <= 0.5
        if "copies" in r:  # not counted on CUDA
            goals[f"{m} {fam}: 0 copies on the collective path ({r['copies']})"] = r["copies"] == 0
    return goals


def _scaling_rows(scaling: list[tuple[int, list[dict]]]) -> list[dict]:
    rows = []
    for w, res in sorted(scaling, key=lambda s: (s[1][0]["config"], s[0])):
        n = res[0]["params"]
        peak, start = max(m["live_peak"] for m in res), max(m["live_start"] for m in res)
        row = {"config": res[0]["config"], "W": w, "peak live MB": peak / 2**20, "peak B/param": peak / n}
        rows.append({**row, "at step start B/param": start / n, "at step start B/param x W": start / n * w})
    return rows


def _plot(rows: list[dict], scaling: list[dict], name: str):
    plt = pyplot()
    if plt is None:
        return None
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, 1 + len(models), figsize=(5 + 5 * len(models), 4.4))
    ax = axes[0]
    for config in dict.fromkeys(r["config"] for r in scaling):
        mine = [r for r in scaling if r["config"] == config]
        ws = [r["W"] for r in mine]
        line = ax.plot(ws, [r["peak B/param"] for r in mine], "o-", label=f"{config}")[0]
        ax.plot(ws, [r["at step start B/param"] for r in mine], "x--", color=line.get_color(), alpha=0.6)
    if scaling:
        ws = sorted({r["W"] for r in scaling})
        ax.plot(ws, [16 / w for w in ws], ":", color="gray", label="16/W (AdamW param+grad+2 states)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xticks(ws, [str(w) for w in ws])
        ax.legend(fontsize=7)
    ax.set(xlabel="world size W", ylabel="bytes per parameter")
    ax.set_title("wide model: peak (o) and between steps (x)", fontsize=9)
    colors = {"fwd": "tab:blue", "bwd": "tab:orange", "step": "tab:green", "zero_grad": "tab:gray"}
    for ax, model in zip(axes[1:], models):
        mine = [r for r in rows if r["model"] == model]
        x, bottom = range(len(mine)), [0.0] * len(mine)
        for phase, color in colors.items():
            vals = [r[f"{phase} ms"] for r in mine]
            ax.bar(x, vals, bottom=bottom, color=color, label=phase)
            bottom = [b + v for b, v in zip(bottom, vals)]
        if all("exposed comm ms" in r for r in mine):
            exposed = [r["exposed comm ms"] for r in mine]
            ax.scatter(x, exposed, marker="_", s=400, color="black", label="exposed comm", zorder=3)
        ax.set_xticks(x, [r["config"] for r in mine], rotation=30, ha="right", fontsize=8)
        ax.set(ylabel="ms per train step (median of each phase)")
        ax.set_title(f"{model}: time by phase", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save_png(name, fig)


def _print_model(model: str, mine: list[dict], run: dict) -> None:
    shape, w, cuda = run["shapes"][model], run["world"], _on_cuda(run)
    backend = f"{run['backend']} under torchrun" if run.get("torchrun") else "gloo"
    print(f"\n## {model}: {mine[0]['params'] / 1e6:.1f} M params {shape_words(shape)}, W={w} ({backend});")
    print(f"{run['warmup']} warm-up + {run['steps']} interleaved steps, median of the slowest rank;")
    print("x = vs FSDP2 with the same optimizer\n")
    print(f"{host_line(run['threads'])}\n")
    print(table(mine, shown(TIME, mine, run), floatfmt=".4g"))
    time_note(run, "exposed comm, update and copies", "fsdp.py")
    what = "what moved" if cuda else "exposed comm ms by phase (median, slowest rank) and what moved"
    print(f"\n{what} per rank and step; load average {load_average()}\n")
    comm = [_comm_row(r) for r in mine]
    print(table(comm, shown(COMM, comm, run), floatfmt=".4g"))
    if "peak live MB" not in mine[0]:
        return
    if cuda:
        after = f"{run['memory_steps'] - 1} step(s) after the first"
        print(f"\nmemory: torch.cuda.max_memory_allocated() over {after}, less what the rank held before the")
        print("configuration; each config in turn in the same processes\n")
        print(table(mine, shown(MEMORY, mine, run), floatfmt=".4g"))
        return
    alone = "in turn in the same processes" if run.get("torchrun") else "alone in a fresh world"
    print(f"\nmemory: each config {alone}, {run['memory_steps']} profiled steps and one after them, then one")
    print(f"more for RSS, malloc={run['malloc']}; load average {load_average()}\n")
    print(table(mine, MEMORY, floatfmt=".4g"))
    print(f"\nwhat is alive at the peak (rank with the highest peak); load average {load_average()}\n")
    print(table([_by_row(r) for r in mine], BY, floatfmt=".4g"))


def report(rows: list[dict], scaling: list, run: dict) -> dict:
    quick, w = run["quick"], run["world"]
    if quick:
        print("--quick: a smoke run on tiny models; its ratios say nothing about the goals")
    for model in dict.fromkeys(r["model"] for r in rows):
        _print_model(model, [r for r in rows if r["model"] == model], run)
    scale = _scaling_rows(scaling)
    if scale:
        print(
            f"\n## Peak live bytes per parameter, wide model, by world size; load average {load_average()}\n"
        )
        print(table(scale, SCALING, floatfmt=".4g"))
    goals_for, plot = (
        f"ours ZeRO-3 vs FSDP2 with the same optimizer, W={w}",
        lambda name: _plot(rows, scale, name),
    )
    return verdict("fsdp", rows, run, _goals(rows), goals_for, "FSDP2", plot, scaling=scale)
