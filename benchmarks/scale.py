"""A whole training step at 64 to 16,384 ranks, simulated: ours (the library's layout planner and
Muon plan) against FSDP2 + torch.optim.Muon, modelled the same way. No processes: the layouts and
plans are the real ones, the times come from a stated cost model.

Workload: Llama-3-70B, GPT-OSS-120B and DeepSeek-V3 (`model_shapes`), fully sharded over all W
ranks (one unit per transformer block, the embedding and the head units too), `TOKENS` tokens per
rank per step (weak scaling), bf16 gathered parameters and fp32 gradient reduction and shards;
the hidden matrices take Muon steps (5 Newton–Schulz steps), the rest AdamW.

Cost model (`vo.CostModel.H200`: 989 TFLOP/s bf16, 4.8 TB/s HBM, 900 GB/s NVLink inside
8-GPU nodes, 400 Gb/s per GPU across nodes, 5 us a ring step):
- matmuls at `MFU` of peak for forward and backward (6 x active parameters FLOPs per token; a
  token uses `EXPERTS` of the routed experts; no attention-score FLOPs), Newton–Schulz at peak;
- element-wise work (optimizer updates, copies) at HBM bandwidth (`ELEMENTWISE` bytes per element);
- ring collectives over all W ranks: `(W - 1) (latency + chunk / bandwidth)`, the network's
  bandwidth once the ring leaves a node; moves of matrices to owners at that bandwidth;
- overlap as FSDP schedules it: each unit's all-gather under the previous unit's compute, in
  backward the next all-gather and the previous reduce-scatter under a unit's backward; the rest
  is exposed. The optimizer step is not overlapped.

Ours: `plan_layout` per unit (granule one row for Muon matrices), padding from it; Muon from
`vo.muon_plan` (its per-rank time: FLOPs at peak + split exchanges) plus moving the matrices to
their owners (those not held whole where the layout put them) and back. FSDP2: per-parameter
dim-0 sharding (each parameter padded to a multiple of W rows), copy-in and copy-out around every
all-gather and reduce-scatter (HBM traffic on the compute stream), and torch Muon replicated:
every rank all-gathers every matrix's update (fp32, one DTensor gather each) and runs all of
Newton–Schulz. Memory per rank: shards (fp32 parameters and gradients, Muon's momentum or
AdamW's moments), two gathered units and one unit's gradients in flight, the optimizer step's
buffers; activations are left out (the same for both). `plan s`: the planners' wall time,
measured (layouts of the distinct blocks and `vo.muon_plan`).

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
COLUMNS = ["model", "W", "config", "memory GB", "padding %", "AG GB", "RS GB", "Muon ms", "NS max/mean",
           "exposed comm s", "step s", "Muon %", "plan s"]  # fmt: skip
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
        out.append({"params": params, "active": active})
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
            layouts[key] = plan_layout(sizes, grans, world, vo.ShardingConfig().align,
                                       segments=[h for _, _, h in u["params"]])  # fmt: skip
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


def simulate(model: str, world: int) -> tuple[dict, dict, dict]:
    """Ours and FSDP2 at `world` ranks: two table rows, and the plans' figures."""
    us = units(model)
    spent = _layouts(us, world)
    shapes, dims, homes = _matrices(us)
    t0 = time.perf_counter()
    plan = vo.muon_plan(shapes, world, ns_steps=NS_STEPS, homes=homes)  # as vo.Muon plans
    spent += time.perf_counter() - t0
    total = sum(numel(s) for u in us for _, s, _ in u["params"])
    costs = [ns_flops(r, c, NS_STEPS) for r, c in dims]
    bw = COST.nvlink if world <= COST.node else COST.network

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
    split = max(((s.shape[0] * s.shape[1] + min(s.shape) ** 2) * 2 * PARAM for s in plan.splits.values()),
                default=0)  # fmt: skip
    flight = max(world * S for S in shard) * (2 * PARAM + GRAD)  # two gathered units, one unit's gradients
    memory = state + flight + sum(shard) * PARAM + max(moved) + split  # the update in bf16, owners' matrices
    ours = {"model": model, "W": world, "config": "ours", "memory GB": memory / 1e9,
            "padding %": 100 * (world * sum(shard) - total) / total,
            "AG GB": 2 * (world - 1) * sum(shard) * PARAM / 1e9,
            "RS GB": (world - 1) * sum(shard) * GRAD / 1e9,
            "Muon ms": 1e3 * muon, "NS max/mean": plan.imbalance, "exposed comm s": exposed,
            "step s": compute + exposed + elem + muon, "plan s": spent}  # fmt: skip

    def chunk(s):  # FSDP2's rows of a parameter per rank, as elements
        return -(-s[0] // world) * (numel(s) // s[0])

    shard2 = [sum(chunk(s) for _, s, _ in u["params"]) for u in us]
    ag2, rs2 = [ring(world, S * PARAM) for S in shard2], [ring(world, S * GRAD) for S in shard2]
    copies = [(2 * 2 * (S + world * S) * PARAM + 2 * (world * S + S) * GRAD) / COST.hbm for S in shard2]
    compute2, exposed2 = flow(us, ag2, rs2, copies)
    hidden = [s for u in us for _, s, h in u["params"] if h]
    gathers = sum(ring(world, chunk(s) * 4) for s in hidden)  # one fp32 DTensor gather per matrix
    muon2 = gathers + sum(costs) / COST.flops  # every rank runs every matrix
    elem2, state2 = _optimizer(shard2, us)
    flight2 = max(world * S for S in shard2) * (3 * PARAM + 2 * GRAD)  # and copy-in / copy-out buffers
    memory2 = state2 + flight2 + max(r * c for r, c in dims) * 10  # a gathered fp32 matrix, NS in bf16
    fsdp2 = {"model": model, "W": world, "config": "FSDP2 + torch Muon", "memory GB": memory2 / 1e9,
             "padding %": 100 * (world * sum(shard2) - total) / total,
             "AG GB": (world - 1) * (2 * sum(shard2) * PARAM + sum(chunk(s) for s in hidden) * 4) / 1e9,
             "RS GB": (world - 1) * sum(shard2) * GRAD / 1e9, "Muon ms": 1e3 * muon2, "NS max/mean": 1.0,
             "exposed comm s": exposed2 + gathers, "step s": compute2 + exposed2 + elem2 + muon2,
             "plan s": 0.0}  # fmt: skip
    for row, t in ((ours, muon), (fsdp2, muon2)):
        row["Muon %"] = 100 * t / row["step s"]
    lpt = rank_loads(costs, assign_owners(costs, world), world)
    free = vo.muon_plan(shapes, world, ns_steps=NS_STEPS, cost=vo.CostModel.FREE_COMM, homes=homes)
    if abs(_on_h200(plan) - max(plan.times)) > 1e-9 * max(plan.times):  # the re-timing is the library's
        raise AssertionError("_on_h200 differs from vo.muon_plan's own times")
    extra = {"model": model, "W": world, "NS max/mean": plan.imbalance,
             "whole only (LPT)": max(lpt) * world / sum(lpt), "comm free": free.imbalance,
             "NS ms": 1e3 * max(plan.times), "whole only ms": 1e3 * max(lpt) / COST.flops,
             "comm free ms": 1e3 * _on_h200(free), "Muon time max/mean": plan.time_imbalance,
             "split matrices": len(plan.groups),
             "largest group": max(map(len, plan.groups.values()), default=1),
             "split GB max/rank": max(plan.bytes_per_rank) / 1e9}  # fmt: skip
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
    print("\nNewton–Schulz per rank: FLOPs max/mean and the busiest rank's modelled ms (H200, split "
          "exchanges included) of the plan, of every matrix whole (LPT: today's owners) and of the plan "
          "made as if communication were free; the plan's time max/mean, its split matrices and "
          "exchanges:\n")  # fmt: skip
    print(table(plans))
    goals = {}
    for (model, world), bound in GOALS.items():
        got = next((p["NS max/mean"] for p in plans if p["model"] == model and p["W"] == world), None)
        if got is not None:
            goals[f"{model} W={world}: Newton–Schulz max/mean <= {bound:.2f} (got {got:.3f})"] = got <= bound
    print_goals("Goals:", goals)
    png = plot(rows)
    out = {"cost": vars(COST), "tokens_per_rank": TOKENS, "mfu": MFU, "rows": rows, "plans": plans,
           "goals": goals, "png": str(png) if png else None}  # fmt: skip
    return finish("scale", args, out, png=png)


if __name__ == "__main__":
    main()
