"""The tables, goals and JSON of `benchmarks/fsdp.py` (see its docstring): the `zero3`
section's here, the others' in `benchmarks._fsdp_sections`."""

from __future__ import annotations

from benchmarks._fsdp_sections import print_compile, print_hsdp, print_peers, print_tp, shown, time_note
from benchmarks._main import print_goals
from benchmarks._measure import load_average
from benchmarks._report import environment, host_line, save_json, table
from benchmarks._verdict import LOSS_TOL, loss_check

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


def shape_words(shape: dict) -> str:
    """A benchmark model's shape and its tokens per rank and step, in words."""
    if "tp" in shape:
        blocks = f"{shape['layers']} blocks of width {shape['dim']}, tp {shape['tp']}"
        return f"({blocks}), {shape['batch']}x{shape['seq']} per dp rank"
    model = f"vocab {shape['vocab']}, d {shape['d_model']}, {shape['n_layers']} layers"
    return f"({model}), {shape['batch']}x{shape['seq']} tokens/rank/step"


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


def _print_zero3(mine: list[dict], run: dict) -> dict[str, bool]:
    cuda = _on_cuda(run)
    print(table(mine, shown(TIME, mine, run), floatfmt=".4g"))
    time_note(run, "exposed comm, update and copies", "fsdp.py")
    what = "what moved" if cuda else "exposed comm ms by phase (median, slowest rank) and what moved"
    print(f"\n{what} per rank and step; load average {load_average()}\n")
    comm = [_comm_row(r) for r in mine]
    print(table(comm, shown(COMM, comm, run), floatfmt=".4g"))
    if "peak live MB" not in mine[0]:
        return _goals(mine)
    if cuda:
        after = f"{run['memory_steps'] - 1} step(s) after the first"
        print(f"\nmemory: torch.cuda.max_memory_allocated() over {after}, less what the rank held before the")
        print("configuration; each config in turn in the same processes\n")
        print(table(mine, shown(MEMORY, mine, run), floatfmt=".4g"))
        return _goals(mine)
    alone = "in turn in the same processes" if run.get("torchrun") else "alone in a fresh world"
    print(f"\nmemory: each config {alone}, {run['memory_steps']} profiled steps and one after them, then one")
    print(f"more for RSS, malloc={run['malloc']}; load average {load_average()}\n")
    print(table(mine, MEMORY, floatfmt=".4g"))
    print(f"\nwhat is alive at the peak (rank with the highest peak); load average {load_average()}\n")
    print(table([_by_row(r) for r in mine], BY, floatfmt=".4g"))
    return _goals(mine)


PRINT = {"zero3": _print_zero3, "peers": print_peers, "hsdp": print_hsdp, "compile": print_compile}
PRINT["tp"] = print_tp


def report(sections: dict[str, dict], run: dict) -> dict:
    """Print every section's tables and goals (one table set per run), then the loss check, and write
    the JSON (`verdict`)."""
    if run["quick"]:
        print("--quick: a smoke run on tiny models; its ratios say nothing about the goals")
    goals, backend = {}, f"{run['backend']} under torchrun" if run.get("torchrun") else "gloo"
    for name, section in sections.items():
        for model in dict.fromkeys(r["model"] for r in section["rows"]):
            mine, shape = [r for r in section["rows"] if r["model"] == model], run["shapes"][model]
            w = run["worlds"][name]
            params = f"{mine[0]['params'] / 1e6:.1f} M params {shape_words(shape)}"
            label = name if model == name else f"{name}, {model}"
            print(f"\n## {label}: {params}, W={w} ({backend});")
            print(f"{run['warmup']} warm-up + {run['steps']} interleaved steps, median of the slowest rank\n")
            print(host_line(run["threads"]))
            goals.update(print_goals(f"Goals ({label}, W={w}):", PRINT[name](mine, run)))
        if section.get("scaling"):
            section["scaling"] = _scaling_rows(section["scaling"])
            print(f"\n## Peak live bytes per parameter, wide model, by W; load average {load_average()}\n")
            print(table(section["scaling"], SCALING, floatfmt=".4g"))
    return verdict(run, goals, sections)


def verdict(run: dict, goals: dict[str, bool], sections: dict[str, dict]) -> dict:
    """Print the loss check of every section's rows against their FSDP2 peers, write
    `run["name"]`.json (_torchrun with `run["torchrun"]`, then _quick with `run["quick"]`), and return
    what was written: the environment, `run`, the goals, the check and each section."""
    sane, notes = loss_check([r for s in sections.values() for r in s["rows"]])
    tol = ", ".join(f"{k} {v:g}" for k, v in LOSS_TOL.items())
    tol = f"relative tolerance {tol}"
    print(f"\nLoss check (loss after training vs FSDP2 with the same optimizer, {tol}; every config")
    print(f"lowered the loss): {'OK' if sane else 'MISMATCH'}" + "".join(f"\n  {n}" for n in notes))
    name = f"{run['name']}_torchrun" if run.get("torchrun") else run["name"]
    name = f"{name}_quick" if run["quick"] else name
    payload = {"env": environment(run.get("threads")), **run, "load_average": load_average(), "goals": goals}
    payload.update(loss_check_ok=sane, **sections)
    path = save_json(name, payload)
    print(f"\nwrote {path}; {run['wall_s']:.0f} s")
    return payload
