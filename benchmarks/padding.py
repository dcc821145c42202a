"""Padding of the ragged layout planner on real model shapes, against peer layouts.

One bucket per transformer block (the embedding and the head are buckets too), for world sizes W
and granules of `1 row` (`shape[-1]` elements: row-wise state, Muon's and Shampoo's rows), `32
rows` and `128 rows` (32x32 and 128x128 block quantization). A matrix `[..., R, C]` takes `k*C`
elements when `k` divides its `R` rows (for a fused 3-D expert tensor, `R`: no tile straddles two
experts), else the whole matrix `R*C` (its last tile is ragged: it lives on one rank); vectors
(norms, biases, sinks, GPT-OSS's stacks of expert biases) one element.

Columns, summed over the model's blocks (padding % = padding / parameters): `ours %` is
`plan_layout`'s (`align=1`); `ref %` an independent search (shard sizes walked upward from the
bound, tensors placed greedily in three orders: `ref % < ours %` is a planner miss, counted in
`planner misses`); `bound %` a lower bound no layout beats (`S >= ceil(total/W)`, `S >=` the
largest granule, and `S` a multiple of the granule of every tensor longer than `2S`); `FSDP2 %`
per-parameter `Shard(0)` (dim 0 padded to a multiple of W) and `FSDP2 cuts` the granules its
chunks split; `LCM %` a Megatron-FSDP-style packing (each start a multiple of its granule, the
shard a multiple of the lcm of the bucket's granules); `flat cuts` the granules a structure-blind
flat split cuts; `plan s` / `max ms` the planner's time (each distinct block planned once), over
all buckets and for the slowest. `goal`: the 3 % goal, for buckets whose ideal shard holds at
least 64 of their largest granules: `ok n/n`, `miss k/n (bound)` when the bound itself is above
3 %, `PLANNER` when the search found a layout within it, `n/a` when no bucket qualifies. A second
table lists every block above 3 % and why. Every layout is verified as it is produced (no overlap,
no rank boundary inside a granule, `placement()` consistent), so this doubles as a planner test.

    python benchmarks/padding.py            # all models, W in 8..1024, three granules
    python benchmarks/padding.py --quick    # W in {8, 1024}, two granules
"""

from __future__ import annotations

import math
import re
import sys
import time
from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._main import finish, parse  # noqa: E402
from benchmarks._report import pyplot, save_png, table  # noqa: E402
from benchmarks.model_shapes import MODELS, Block, Shape, is_vector, numel  # noqa: E402
from vescale_optim.shard import plan_layout  # noqa: E402

UNITS = {"1 row": 1, "32 rows": 32, "128 rows": 128}
WORLD_SIZES = (8, 64, 256, 1024)
GOAL = 0.03
MIN_UNITS_PER_RANK = 64


def granule_of(name: str, shape: Shape, rows: int) -> int:
    """Unit in elements of parameter `name` for `rows`-row granularity (see module doc)."""
    if is_vector(name, shape):
        return 1
    r, c = shape[-2], shape[-1]
    return rows * c if r % rows == 0 else r * c


@dataclass
class Bucket:
    label: str
    count: int  # identical blocks this bucket stands for
    shapes: tuple[Shape, ...]
    sizes: tuple[int, ...]
    granules: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.sizes)


def _block_label(block: Block) -> str:
    m = re.match(r"model\.layers\.(\d+)\.", block[0][0])
    if m:
        return m.group(1)
    return "embed" if "embed" in block[0][0] else "head"


def distinct_buckets(blocks: list[Block], rows: int) -> list[Bucket]:
    """The model's blocks as buckets, identical ones merged (same shapes and granules)."""
    seen: dict[tuple, Bucket] = {}
    labels: dict[tuple, list[str]] = {}
    for block in blocks:
        shapes = tuple(s for _, s in block)
        granules = tuple(granule_of(n, s, rows) for n, s in block)
        key = (shapes, granules)
        if key in seen:
            seen[key].count += 1
        else:
            seen[key] = Bucket("", 1, shapes, tuple(numel(s) for s in shapes), granules)
        labels.setdefault(key, []).append(_block_label(block))
    for key, bucket in seen.items():
        names = labels[key]
        if names[0].isdigit():
            lo, hi = names[0], names[-1]
            bucket.label = f"layer {lo}" if lo == hi else f"layers {lo}-{hi} ({len(names)})"
        else:
            bucket.label = names[0]
    return list(seen.values())


# ------------------------------------------------------------------ invariant check


def verify(layout, bucket: Bucket, world_size: int) -> None:
    """Raise AssertionError unless the layout is a valid ragged layout of the bucket."""
    sizes, granules, S = bucket.sizes, bucket.granules, layout.shard_size
    W, total = world_size, bucket.total
    assert layout.world_size == W and tuple(layout.sizes) == sizes
    assert total <= S * W and -(-total // W) <= S, (S, total, W)
    assert layout.padding == S * W - total
    offsets = layout.offsets
    end = 0
    for i in sorted(range(len(sizes)), key=lambda i: offsets[i]):
        e, g, lo = sizes[i], granules[i], offsets[i]
        if e == 0:
            continue
        assert lo >= end, f"tensor {i} at {lo} overlaps the previous one ending at {end}"
        end = lo + e
        assert end <= W * S, f"tensor {i} ends at {end} > W*S = {W * S}"
        b = (lo // S + 1) * S  # first rank boundary after the start
        if b < end:
            assert (b - lo) % g == 0, f"tensor {i}: boundary {b} splits a granule of {g}"
            if b + S < end:
                assert S % g == 0, f"tensor {i}: S={S} spans boundaries but is not a multiple of {g}"
        local = layout.local_granules(i)
        assert sum(local) * g == e, (i, local, g, e)
        placement = layout.placement(i, bucket.shapes[i])
        placement.check(bucket.shapes[i], W)
        # the placement's pieces must be where the offsets put the tensor's rank pieces
        for r in (lo // S, (end - 1) // S):
            start, stop = layout.rank_range(i, r)
            assert placement.local_range(bucket.shapes[i], r) == (start - lo, stop - lo)


# ----------------------------------------------------------------- other layouts


def next_candidate(sizes, granules, s: int) -> tuple[int, int]:
    """Smallest S' >= s that passes the necessary condition "S is a multiple of the granule
    of every tensor longer than 2S" (such a tensor holds at least two rank boundaries
    wherever it sits, and two consecutive boundaries both fall on its granule grid only
    when S is a multiple of its granule). Returns (S', lcm of the granules that bind there)."""
    while True:
        spanning = [(e, g) for e, g in zip(sizes, granules) if e > 2 * s]
        if not spanning:
            return s, 1
        lcm = math.lcm(*(g for _, g in spanning))
        cand = -(-s // lcm) * lcm
        # {t : e_t > 2S} is the same for S in [s, nxt) and only shrinks after
        nxt = min((e - 1) // 2 + 1 for e, _ in spanning)
        if cand < nxt:
            return cand, lcm
        s = nxt


def lower_bound_shard(sizes, granules, world_size: int) -> tuple[int, int]:
    """A lower bound on S for any valid layout: at least ceil(total/W), at least the
    largest granule, and passing `next_candidate`'s condition. Returns (S, binding lcm)."""
    s = max(-(-sum(sizes) // world_size), max((g for e, g in zip(sizes, granules) if e), default=1))
    return next_candidate(sizes, granules, s)


def _earliest(cursor: int, size: int, granule: int, shard: int, limit: int) -> int | None:
    """Earliest start >= cursor at which every rank boundary inside the tensor falls on
    its granule grid (an independent re-implementation of the planner's greedy step)."""
    start = cursor
    while start + size <= limit:
        b = (start // shard + 1) * shard
        if b >= start + size:
            return start
        if (b - start) % granule:
            start += (b - start) % granule
        elif b + shard >= start + size or shard % granule == 0:
            return start
        else:
            start = b
    return None


def reference_shard(sizes, granules, world_size: int, stop: int, tries: int = 64) -> int | None:
    """Smallest S < stop found by walking the lattice of `next_candidate` sizes upward
    from the lower bound and placing tensors greedily (model order, then by granule, then
    by size); None if none of the first `tries` candidates fits. A cross-check of the
    planner's search: a result below the planner's S is a planner miss."""
    n = len(sizes)
    orders = [range(n), sorted(range(n), key=lambda i: (-granules[i], -sizes[i]))]
    orders.append(sorted(range(n), key=lambda i: (-sizes[i], -granules[i])))
    s, _ = lower_bound_shard(sizes, granules, world_size)
    for _ in range(tries):
        if s >= stop:
            return None
        for order in orders:
            cursor = 0
            for i in order:
                if sizes[i]:
                    start = _earliest(cursor, sizes[i], granules[i], s, world_size * s)
                    if start is None:
                        break
                    cursor = start + sizes[i]
            else:
                return s
        s, _ = next_candidate(sizes, granules, s + 1)
    return None


def fsdp2_padding(shapes, world_size: int) -> int:
    """Per-parameter dim-0 sharding: pad dim 0 of each tensor to a multiple of W."""
    return sum((-(-s[0] // world_size) * world_size - s[0]) * (numel(s) // s[0]) for s in shapes if s[0])


def fsdp2_cuts(shapes, granules, world_size: int) -> int:
    """Units split by per-parameter dim-0 sharding (chunks of ceil(dim0/W) along dim 0)."""
    cuts = 0
    for shape, g in zip(shapes, granules):
        row = numel(shape[1:])  # elements per dim-0 slice
        if not shape[0] or g % row:  # a granule inside one dim-0 slice is never cut
            continue
        u, chunk = g // row, -(-shape[0] // world_size)
        cuts += sum(1 for b in range(chunk, shape[0], chunk) if b % u)
    return cuts


def lcm_padding(sizes, granules, world_size: int) -> int:
    """Megatron-FSDP-style: granule-aligned contiguous packing, shard a multiple of lcm(granules)."""
    cursor = 0
    for e, g in zip(sizes, granules):
        cursor = -(-cursor // g) * g + e
    lcm = math.lcm(*granules)
    ideal = -(-cursor // world_size)
    shard = -(-ideal // lcm) * lcm
    return world_size * shard - sum(sizes)


def flat_cuts(sizes, granules, world_size: int) -> int:
    """Units split by a structure-blind flat split into W pieces of ceil(total/W)."""
    starts = [0, *accumulate(sizes)]
    piece = -(-starts[-1] // world_size)
    cut = set()
    for k in range(1, world_size):
        b = k * piece
        t = bisect_right(starts, b) - 1
        if t >= len(sizes):
            break
        pos = b - starts[t]
        if 0 < pos < sizes[t] and pos % granules[t]:
            cut.add((t, pos // granules[t]))
    return len(cut)


# ------------------------------------------------------------------------ driver


def measure(bucket: Bucket, world_size: int) -> dict:
    W = world_size
    t0 = time.perf_counter()
    layout = plan_layout(bucket.sizes, bucket.granules, W)
    seconds = time.perf_counter() - t0
    verify(layout, bucket, W)
    total, gmax = bucket.total, max(bucket.granules)
    ideal = -(-total // W)
    bound, _ = lower_bound_shard(bucket.sizes, bucket.granules, W)
    start = max(ideal, gmax)
    lcm = math.lcm(*(g for e, g in zip(bucket.sizes, bucket.granules) if e > 2 * start))
    assert layout.shard_size >= bound, (layout.shard_size, bound)
    ref = layout.shard_size
    if ref > bound:
        ref = reference_shard(bucket.sizes, bucket.granules, W, stop=ref) or ref
    sizes, shapes, granules = bucket.sizes, bucket.shapes, bucket.granules
    out = {
        "block": bucket.label,
        "count": bucket.count,
        "tensors": len(sizes),
        "numel": total,
        "max_unit": gmax,
    }
    out.update(ideal_shard=ideal, largest_units_per_rank=ideal / gmax, shard=layout.shard_size)
    out.update(padding=layout.padding, ref_padding=W * ref - total, bound_shard=bound)
    out.update(bound_padding=W * bound - total, spanning_lcm=lcm)  # spanning_lcm: at max(ideal, gmax)
    out.update(fsdp2_padding=fsdp2_padding(shapes, W), fsdp2_cuts=fsdp2_cuts(shapes, granules, W))
    out.update(lcm_padding=lcm_padding(sizes, granules, W), flat_cuts=flat_cuts(sizes, granules, W))
    return {**out, "plan_s": seconds, "qualifies": ideal >= MIN_UNITS_PER_RANK * gmax}


def explain(b: dict) -> str:
    """Why a bucket's padding exceeds the goal."""
    pct = lambda x: f"{100 * x / b['numel']:.1f}%"  # noqa: E731
    if b["padding"] > b["ref_padding"]:
        found, bound = pct(b["ref_padding"]), pct(b["bound_padding"])
        return f"PLANNER MISS: a valid layout with {found} exists (bound {bound})"
    if b["max_unit"] > b["ideal_shard"]:
        why = f"a granule of {b['max_unit']:,} elements exceeds the ideal shard {b['ideal_shard']:,}"
    else:
        why = (
            f"S must be a multiple of {b['spanning_lcm']:,}, the lcm of the granules of tensors "
            f"longer than 2S; the ideal shard is {b['ideal_shard'] / b['spanning_lcm']:.2f} of it"
        )
        rounded = -(-b["ideal_shard"] // b["spanning_lcm"]) * b["spanning_lcm"]
        if b["bound_shard"] < rounded:
            why += ", or at least half the longest such tensor (which then crosses one boundary)"
    if b["padding"] > b["bound_padding"]:
        return f"{why}; bound {pct(b['bound_padding'])}, nothing better found"
    return f"{why}: optimal"


def _goal(res: list[dict]) -> str:
    """The goal column of one model, granule and W (see the module's docstring)."""
    qual = [r for r in res if r["qualifies"]]
    missed = [r for r in qual if r["padding"] > GOAL * r["numel"]]
    n_qual, n_missed = sum(r["count"] for r in qual), sum(r["count"] for r in missed)
    if not n_qual:
        return "n/a"
    if not n_missed:
        return f"ok {n_qual}/{n_qual}"
    if any(r["ref_padding"] <= GOAL * r["numel"] for r in missed):  # a layout within the goal exists
        return f"miss {n_missed}/{n_qual} PLANNER"
    bound = all(r["bound_padding"] > GOAL * r["numel"] for r in missed)  # none can exist
    return f"miss {n_missed}/{n_qual} {'(bound)' if bound else '(open)'}"


def summarize(at: dict, res: list[dict]) -> tuple[dict, list[dict]]:
    """The row of one model, granule and W (`at`) from its buckets' results, and its misses."""
    n = lambda key: sum(r[key] * r["count"] for r in res)  # noqa: E731
    pct = lambda key: 100 * n(key) / n("numel")  # noqa: E731
    row = {**at, "ours %": pct("padding"), "ref %": pct("ref_padding"), "bound %": pct("bound_padding")}
    row.update({"FSDP2 %": pct("fsdp2_padding"), "FSDP2 cuts": n("fsdp2_cuts"), "LCM %": pct("lcm_padding")})
    plan = [r["plan_s"] for r in res]
    row.update(
        {"flat cuts": n("flat_cuts"), "plan s": sum(plan), "max ms": 1e3 * max(plan), "goal": _goal(res)}
    )
    over = [r for r in res if r["padding"] > GOAL * r["numel"]]
    row[">3% blocks"] = sum(r["count"] for r in over)
    row["planner misses"] = sum(r["count"] for r in res if r["padding"] > r["ref_padding"])
    row["blocks"] = sum(r["count"] for r in res)
    misses = []
    for r in over:
        miss = {k: 100 * r[key] / r["numel"] for k, key in (("ours %", "padding"), ("ref %", "ref_padding"))}
        miss["bound %"] = 100 * r["bound_padding"] / r["numel"]
        misses.append({**at, "block": r["block"], **miss, "granules/rank": r["largest_units_per_rank"]})
        misses[-1]["why"] = explain(r)
    return row, misses


def run(models, granules, world_sizes) -> tuple[list[dict], list[dict], list[dict]]:
    rows, misses, details = [], [], []
    for model in models:
        blocks = MODELS[model]()
        for unit_name in granules:
            buckets = distinct_buckets(blocks, UNITS[unit_name])
            for W in world_sizes:
                res = [measure(b, W) for b in buckets]
                at = {"model": model, "granule": unit_name, "W": W}
                row, missed = summarize(at, res)
                rows.append(row)
                misses += missed
                details += [{**at, **r} for r in res]
                seconds = sum(r["plan_s"] for r in res)
                print(
                    f"  {model:13s} {unit_name:8s} W={W:<5d} {len(res)} distinct buckets in {seconds:.2f}s",
                    file=sys.stderr,
                )
    return rows, misses, details


def plot(rows, name: str):
    plt = pyplot()
    if plt is None:
        return None
    granules = list(dict.fromkeys(r["granule"] for r in rows))
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(granules), figsize=(5 * len(granules), 4), sharey=True, squeeze=False)
    for ax, granule in zip(axes[0], granules):
        for color, model in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], models):
            sel = [r for r in rows if r["granule"] == granule and r["model"] == model]
            ws = [r["W"] for r in sel]
            for key, style in (("ours %", "-o"), ("FSDP2 %", "--"), ("LCM %", ":")):
                label = f"{model} {key[:-2]}" if granule == granules[0] else None
                ax.plot(ws, [r[key] for r in sel], style, color=color, label=label)
        ax.axhline(100 * GOAL, color="k", lw=0.5)
        ax.set_yscale("symlog", linthresh=0.1)
        ax.set(xscale="log", title=f"granule = {granule}", xlabel="world size W")
        ax.set_xticks(sorted({r["W"] for r in rows}), [str(w) for w in sorted({r["W"] for r in rows})])
    axes[0][0].set_ylabel("padding % of parameters")
    fig.legend(loc="upper center", ncol=len(models), fontsize=7, bbox_to_anchor=(0.5, 1.12))
    return save_png(name, fig)


def main(argv: list[str] | None = None) -> dict:
    models = dict(nargs="+", choices=list(MODELS), default=list(MODELS))
    args = parse(
        __doc__,
        argv,
        "W in {8, 1024}, granules 1 and 128 rows",
        models=models,
        world_sizes=dict(nargs="+", type=int),
    )
    granules = ["1 row", "128 rows"] if args.quick else list(UNITS)
    world_sizes = args.world_sizes or ([8, 1024] if args.quick else list(WORLD_SIZES))
    name = "padding_quick" if args.quick else "padding"

    t0 = time.perf_counter()
    rows, misses, details = run(args.models, granules, world_sizes)
    wall = time.perf_counter() - t0

    print(table(rows, floatfmt=".2f"))
    print(f"\nBlocks above {100 * GOAL:.0f}% padding ({len(misses)} distinct), and why:\n")
    print(table(misses, floatfmt=".2f") if misses else "(none)")
    print(f"\nall layouts verified; benchmark wall time {wall:.1f}s")
    payload = dict(goal=GOAL, min_units_per_rank=MIN_UNITS_PER_RANK, wall_s=wall, rows=rows, misses=misses)
    payload["buckets"] = details
    return finish("padding", args, payload, png=plot(rows, name))


if __name__ == "__main__":
    main()
