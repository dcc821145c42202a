"""A whole training step at 64 to 16,384 ranks, simulated: ours (the library's layout planner and
Muon plan) against FSDP2 + torch.optim.Muon, modelled the same way. No processes: the layouts and
plans are the real ones, the times come from a stated cost model.

Workload: Llama-3-70B, GPT-OSS-120B and DeepSeek-V3 (`model_shapes`) fully sharded over all W ranks
(a unit per block, the embedding and head too), `TOKENS` tokens per rank (weak scaling), bf16
gathers, fp32 gradient reduction and shards; Muon (5 Newton–Schulz steps) on the hidden matrices.
Cost model `vo.CostModel.H200` (989 TFLOP/s, 4.8 TB/s HBM, 900 GB/s NVLink inside 8-GPU nodes, 400
Gb/s per GPU across, 5 us a ring step): matmuls at `MFU` (6 x active parameters FLOPs per token; a
token uses `EXPERTS` of the routed experts), Newton–Schulz at peak, element-wise work at HBM speed
(`ELEMENTWISE` bytes an element), ring collectives `(W - 1) (latency + chunk / bandwidth)`, FSDP's
overlap (each all-gather under the previous unit's compute, in backward the next all-gather and the
previous reduce-scatter under a unit's backward; the optimizer step not overlapped).

Ours: `plan_layout` per unit, `vo.muon_plan`'s per-rank time plus moving matrices to their owners
and back. FSDP2: each parameter padded to a multiple of W rows, copy-in and copy-out around every
collective (HBM traffic), torch Muon replicated (every rank gathers every matrix's update, fp32,
and runs all of Newton–Schulz). Memory per rank: shards and state, two gathered units and one
unit's gradients in flight, the step's buffers (activations left out: the same for both). `plan
s`: the planners' measured wall time.

    python benchmarks/scale.py            # three models, W in {64, 1024, 8192, 16384}
    python benchmarks/scale.py --quick    # Llama-3-70B, W in {64, 1024}
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vescale_optim as vo  # noqa: E402
from benchmarks._main import finish, parse, print_goals  # noqa: E402
from benchmarks._report import pyplot, require_finite, save_png, table  # noqa: E402
from benchmarks.model_shapes import MODELS, matrices, numel  # noqa: E402
from vescale_optim.optim.muon import matrix_view, ns_flops  # noqa: E402
from vescale_optim.owners.balance import assign_owners, rank_loads  # noqa: E402
from vescale_optim.shard import plan_layout  # noqa: E402

COST = vo.CostModel.H200
TOKENS, MFU, NS_STEPS = 4096, 0.5, 5
EXPERTS = {"gpt-oss-120b": 4 / 128, "deepseek-v3": 8 / 256}  # routed experts a token uses
PARAM, GRAD, SHARD = 2, 4, 4  # bytes per element: gathered bf16, reduced fp32, fp32 shards
STATE = {True: 4, False: 8}  # Muon's momentum / AdamW's two moments, fp32
ELEMENTWISE = {True: 24, False: 28}  # HBM bytes an optimizer step touches per element (Muon / AdamW)
WORLDS, QUICK_WORLDS = (64, 1024, 8192, 16384), (64, 1024)
RUN, QUICK_RUN = ("llama3-70b", "gpt-oss-120b", "deepseek-v3"), ("llama3-70b",)
GOALS = {("llama3-70b", 1024): 1.10, ("llama3-70b", 8192): 1.25}
COLUMNS = "model|W|config|memory GB|padding %|AG GB|RS GB|Muon ms|NS max/mean|exposed comm s|step s|Muon %"
COLUMNS = [*COLUMNS.split("|"), "plan s"]
NUMBERS = COLUMNS[3:]


def ring(world: int, chunk: float) -> float:
    """Seconds of a ring collective over `world` ranks moving `chunk` bytes a step."""
    bw = COST.nvlink if world <= COST.node else COST.network
    return (world - 1) * (COST.latency + chunk / bw) if world > 1 else 0.0


def units(model: str) -> list[dict]:
    """The model's units (its blocks) with what the simulation needs of each parameter."""
    hidden = {name for name, _ in matrices(model, hidden_only=True)}
    frac = EXPERTS.get(model, 1.0)
    out = []
    for block in MODELS[model]():
        params = [(name, tuple(shape), name in hidden) for name, shape in block]
        embed = all("embed_tokens" in name for name, _, _ in params)
        active = 0.0 if embed else sum(numel(s) * (frac if ".experts." in n else 1.0) for n, s, _ in params)
        out.append({"params": params, "active": active, "numel": sum(numel(s) for _, s, _ in params)})
    return out


def flow(units_: list[dict], ag: list[float], rs: list[float], copies: list[float]) -> tuple[float, float]:
    """(compute seconds on the critical path, exposed communication) of forward and backward."""
    fwd = [2 * u["active"] * TOKENS / (COST.flops * MFU) for u in units_]
    bwd = [2 * f for f in fwd]
    exposed = ag[0] + sum(max(0.0, ag[u + 1] - fwd[u]) for u in range(len(units_) - 1))
    order = list(reversed(range(len(units_))))
    for k, u in enumerate(order):
        nxt = ag[order[k + 1]] if k + 1 < len(order) else 0.0
        prev = rs[order[k - 1]] if k else 0.0
        exposed += max(0.0, nxt + prev - bwd[u])
    exposed += rs[order[-1]]
    return sum(fwd) + sum(bwd) + sum(copies), exposed


def _layouts(us: list[dict], world: int) -> float:
    """Each unit's layout by the library's planner (once per distinct block); the wall time."""
    layouts, spent = {}, 0.0
    for u in us:
        key = tuple((s, h) for _, s, h in u["params"])
        if key not in layouts:
            sizes = [numel(s) for _, s, _ in u["params"]]
            grans = [s[-1] if h else 1 for _, s, h in u["params"]]  # a row for Muon's matrices
            t0 = time.perf_counter()
            segments = [h for _, _, h in u["params"]]
            layouts[key] = plan_layout(sizes, grans, world, vo.ShardingConfig().align, segments=segments)
            spent += time.perf_counter() - t0
        u["layout"] = layouts[key]
    return spent


def _matrices(us: list[dict]) -> tuple[list[tuple[int, ...]], list[tuple[int, int]], list[int | None]]:
    """The Muon parameters' shapes in unit order, each matrix's `(rows, cols)` and its home (the
    shard rank holding it whole in its unit's layout, or None)."""
    shapes, dims, homes = [], [], []
    for u in us:
        lay = u["layout"]
        for (_, s, h), start in zip(u["params"], lay.offsets):
            if h:
                shapes.append(s)
                count, rows, cols = matrix_view(s)
                for k in range(count):
                    lo = start + k * rows * cols
                    first, last = lo // lay.shard_size, (lo + rows * cols - 1) // lay.shard_size
                    dims.append((rows, cols))
                    homes.append(first if first == last else None)
    return shapes, dims, homes


def _optimizer(shard: list[int], us: list[dict]) -> tuple[float, float]:
    """Element-wise seconds of the optimizer step and the bytes of its shards' state, per rank."""
    seconds = state = 0.0
    for S, u in zip(shard, us):
        total = sum(numel(s) for _, s, _ in u["params"])
        f = sum(numel(s) for _, s, h in u["params"] if h) / max(1, total)  # Muon's share of the unit
        seconds += S * (f * ELEMENTWISE[True] + (1 - f) * ELEMENTWISE[False]) / COST.hbm
        state += S * (2 * SHARD + f * STATE[True] + (1 - f) * STATE[False])
    return seconds, state


def _ours(us: list[dict], world: int, plan, dims: list, homes: list) -> tuple[dict, float]:
    """Ours' row (less the model's name and the planners' time) and its Muon seconds."""
    bw, total = COST.nvlink if world <= COST.node else COST.network, sum(u["numel"] for u in us)
    shard = [u["layout"].shard_size for u in us]
    ag, rs = [ring(world, S * PARAM) for S in shard], [ring(world, S * GRAD) for S in shard]
    compute, exposed = flow(us, ag, rs, [0.0] * len(us))
    moved = [0.0] * world  # bf16 bytes a rank receives to orthogonalize (and sends back)
    for i, (r, c) in enumerate(dims):
        if plan.owners[i] is None:
            for j, m in enumerate(plan.groups[i]):
                moved[m] += plan.splits[i].rows[j] * c * PARAM
        elif homes[i] != plan.owners[i]:
            moved[plan.owners[i]] += r * c * PARAM
    muon = max(t + 2 * m / bw for t, m in zip(plan.times, moved))
    elem, state = _optimizer(shard, us)
    # a split member holds X and A whole, and their gather buffers
    split = [(s.shape[0] * s.shape[1] + min(s.shape) ** 2) * 2 * PARAM for s in plan.splits.values()]
    split = max(split, default=0)
    flight = max(world * S for S in shard) * (2 * PARAM + GRAD)  # two gathered units, one unit's gradients
    memory = state + flight + sum(shard) * PARAM + max(moved) + split  # the update in bf16, owners' matrices
    row = {
        "config": "ours",
        "memory GB": memory / 1e9,
        "padding %": 100 * (world * sum(shard) - total) / total,
    }
    row["AG GB"] = 2 * (world - 1) * sum(shard) * PARAM / 1e9
    row["RS GB"] = (world - 1) * sum(shard) * GRAD / 1e9
    row.update({"Muon ms": 1e3 * muon, "NS max/mean": plan.imbalance, "exposed comm s": exposed})
    return {**row, "step s": compute + exposed + elem + muon}, muon


def _fsdp2(us: list[dict], world: int, dims: list, costs: list) -> tuple[dict, float]:
    """FSDP2 + torch Muon's row (less the model's name) and its Muon seconds."""
    chunk = lambda s: -(-s[0] // world) * (numel(s) // s[0])  # noqa: E731 (its rows of a parameter per rank)
    shard = [sum(chunk(s) for _, s, _ in u["params"]) for u in us]
    ag, rs = [ring(world, S * PARAM) for S in shard], [ring(world, S * GRAD) for S in shard]
    copies = [(2 * 2 * (S + world * S) * PARAM + 2 * (world * S + S) * GRAD) / COST.hbm for S in shard]
    compute, exposed = flow(us, ag, rs, copies)
    hidden = [s for u in us for _, s, h in u["params"] if h]
    gathers = sum(ring(world, chunk(s) * 4) for s in hidden)  # one fp32 DTensor gather per matrix
    muon = gathers + sum(costs) / COST.flops  # every rank runs every matrix
    elem, state = _optimizer(shard, us)
    flight = max(world * S for S in shard) * (3 * PARAM + 2 * GRAD)  # and copy-in / copy-out buffers
    memory = state + flight + max(r * c for r, c in dims) * 10  # a gathered fp32 matrix, NS in bf16
    total = sum(u["numel"] for u in us)
    row = {"config": "FSDP2 + torch Muon", "memory GB": memory / 1e9}
    row["padding %"] = 100 * (world * sum(shard) - total) / total
    row["AG GB"] = (world - 1) * (2 * sum(shard) * PARAM + sum(chunk(s) for s in hidden) * 4) / 1e9
    row.update({"RS GB": (world - 1) * sum(shard) * GRAD / 1e9, "Muon ms": 1e3 * muon, "NS max/mean": 1.0})
    row.update({"exposed comm s": exposed + gathers, "step s": compute + exposed + elem + muon})
    return {**row, "plan s": 0.0}, muon


def simulate(model: str, world: int) -> tuple[dict, dict, dict]:
    """Ours and FSDP2 at `world` ranks: two table rows, and the plans' figures."""
    us = units(model)
    spent = _layouts(us, world)
    shapes, dims, homes = _matrices(us)
    t0 = time.perf_counter()
    plan = vo.muon_plan(shapes, world, ns_steps=NS_STEPS, homes=homes)  # as vo.Muon plans
    spent += time.perf_counter() - t0
    costs = [ns_flops(r, c, NS_STEPS) for r, c in dims]
    (ours, muon), (fsdp2, muon2) = _ours(us, world, plan, dims, homes), _fsdp2(us, world, dims, costs)
    ours, fsdp2 = {"model": model, "W": world, **ours, "plan s": spent}, {"model": model, "W": world, **fsdp2}
    for row, t in ((ours, muon), (fsdp2, muon2)):
        row["Muon %"] = 100 * t / row["step s"]
    lpt = rank_loads(costs, assign_owners(costs, world), world)
    free = vo.muon_plan(shapes, world, ns_steps=NS_STEPS, cost=vo.CostModel.FREE_COMM, homes=homes)
    if abs(_on_h200(plan) - max(plan.times)) > 1e-9 * max(plan.times):  # the re-timing is the library's
        raise AssertionError("_on_h200 differs from vo.muon_plan's own times")
    extra = {"model": model, "W": world, "NS max/mean": plan.imbalance}
    extra["whole only (LPT)"] = max(lpt) * world / sum(lpt)
    extra.update({"comm free": free.imbalance, "NS ms": 1e3 * max(plan.times)})
    extra.update({"whole only ms": 1e3 * max(lpt) / COST.flops, "comm free ms": 1e3 * _on_h200(free)})
    extra.update({"Muon time max/mean": plan.time_imbalance, "split matrices": len(plan.groups)})
    extra["largest group"] = max(map(len, plan.groups.values()), default=1)
    extra["split GB max/rank"] = max(plan.bytes_per_rank) / 1e9
    return ours, fsdp2, extra


def _on_h200(plan) -> float:
    """The busiest rank's Newton–Schulz seconds of `plan` (made with any cost model) on H200."""
    times = [x / COST.flops for x in plan.loads]
    for i, members in plan.groups.items():
        across = members[0] // COST.node != members[-1] // COST.node
        seconds = COST.exchange(plan.splits[i], NS_STEPS, across)[1]
        for r in members:
            times[r] += seconds
    return max(times)


def plot(rows: list[dict]):
    """Step time and Muon's share of it against W, ours and FSDP2, one line per model."""
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for k, model in enumerate(dict.fromkeys(r["model"] for r in rows)):
        for config, style in (("ours", "-o"), ("FSDP2 + torch Muon", "--s")):
            mine = [r for r in rows if r["model"] == model and r["config"] == config]
            label = f"{model}, {'ours' if config == 'ours' else 'FSDP2 + torch Muon'}"
            for ax, key in zip(axes, ("step s", "Muon %")):
                ax.plot([r["W"] for r in mine], [r[key] for r in mine], style, color=f"C{k}", label=label)
    for ax, title in zip(axes, ("step time (s, modelled)", "Muon's share of the step (%, modelled)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("W (ranks)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    return save_png("scale_quick" if len(rows) <= 4 else "scale", fig)


def main(argv: list[str] | None = None) -> dict:
    args = parse(__doc__, argv, "Llama-3-70B at W in {64, 1024}")
    models, worlds = (QUICK_RUN, QUICK_WORLDS) if args.quick else (RUN, WORLDS)
    rows, plans = [], []
    for model in models:
        for world in worlds:
            ours, fsdp2, extra = simulate(model, world)
            rows += [ours, fsdp2]
            plans.append(extra)
    require_finite(rows, NUMBERS)
    print(table(rows, COLUMNS))
    print(
        "\nNewton–Schulz per rank: FLOPs max/mean and the busiest rank's modelled ms (H200, split exchanges"
    )
    print("included) of the plan, of every matrix whole (LPT: today's owners) and of the plan made as if")
    print("communication were free; the plan's time max/mean, its split matrices and exchanges:\n")
    print(table(plans))
    goals = {}
    for (model, world), bound in GOALS.items():
        got = next((p["NS max/mean"] for p in plans if p["model"] == model and p["W"] == world), None)
        if got is not None:
            goals[f"{model} W={world}: Newton–Schulz max/mean <= {bound:.2f} (got {got:.3f})"] = got <= bound
    print_goals("Goals:", goals)
    png = plot(rows)
    out = {
        "cost": vars(COST),
        "tokens_per_rank": TOKENS,
        "mfu": MFU,
        "rows": rows,
        "plans": plans,
        "goals": goals,
    }
    out["png"] = str(png) if png else None
    return finish("scale", args, out, png=png)


if __name__ == "__main__":
    main()
