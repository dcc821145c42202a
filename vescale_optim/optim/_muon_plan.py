"""Where a step's Newton–Schulz runs: `muon_plan`, pure (no processes), the plan `vo.Muon` builds.

Each matrix is orthogonalized either whole, by one owner rank, or split by rows over a group of
ranks of one node (`_split_ns`: the exchange per step is an all-gather of X and one of A). The
planner balances Newton–Schulz FLOPs over the world and weighs them against the bytes a split
adds, with a stated cost model (`CostModel`; `H200` by default):

- time of a rank = its FLOPs / `flops` + its split exchanges; a ring all-gather of g blocks of
  s bytes takes `(g - 1) (latency + s / bw)`, bw = `nvlink` inside a node of `node` GPUs,
  `network` when the ring leaves the node (its slowest link);
- a matrix is *splittable* when two ranks of a node finish it sooner than one (the matmuls
  outweigh the bytes: on H200 a min dimension above about a thousand);

and then, with `mean` the world's FLOPs per rank:

1. splittable matrices costing more than `THETA * mean` go on *lines*, the rest stay whole;
2. a line matrix larger than a node's share (`node * mean`) gets nodes of its own: one, or k
   when k nodes finish it sooner (a ring across nodes runs at the network's bandwidth: on H200
   one node always wins, so no group leaves its node and such a matrix bounds max/mean from
   below by `cost / (node * mean)`); the other line matrices are dealt to the remaining nodes,
   largest first, each to the node with the least line work per rank;
3. inside a node its line matrices, largest first, are laid end to end over its ranks, each
   rank taking the node's line work / its ranks (McNaughton's wrap-around): a matrix that
   crosses ranks is split over them, rows in proportion to the work each takes; one that stays
   inside a rank is whole there. A rank is in at most two groups besides those it lies inside;
4. whole matrices go, largest first, to the least-loaded rank (LPT), after the lines' loads;
5. if every matrix whole (LPT alone) finishes no later than that, the plan is that.

Deterministic: every rank computes the same plan from the same shapes and `homes`. `homes`,
per matrix the world rank already holding it whole (None when it spans ranks; `vo.Muon` passes
its layout's, `opt.homes`), makes step 4 keep a whole matrix at its home while that rank's load
stays within 5 % of the mean, so it need not travel; without them whole matrices are placed as
if nothing lay anywhere (the same balance, other owners). `vo.Muon` then trades owners between
matrices of equal cost toward the ranks holding them (`owners.balance.keep_homes`), which leaves
`loads` as they are.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from ..owners.balance import assign_owners
from ._muon_math import matrix_view, ns_flops
from ._split_ns import Split

THETA = 0.5  # matrices above this share of the mean rank load are laid on node lines
BYTES = 2  # bf16: what every split exchange carries


@dataclass(frozen=True)
class CostModel:
    """Alpha-beta + roofline constants (H200 by default): `flops` bf16 dense matmul peak
    (FLOP/s), `hbm` memory bandwidth (bytes/s, for element-wise work: `benchmarks/scale.py`),
    `nvlink` per GPU inside a node of `node` GPUs and `network` per GPU across nodes (400 Gb/s),
    in bytes/s, `latency` per ring step (s). Presets: `CostModel.H200` (the defaults) and
    `CostModel.FREE_COMM` (communication free: FLOPs alone decide)."""

    flops: float = 989e12
    hbm: float = 4.8e12
    nvlink: float = 900e9
    network: float = 400e9 / 8
    latency: float = 5e-6
    node: int = 8
    H200: ClassVar[CostModel]
    FREE_COMM: ClassVar[CostModel]

    def all_gather(self, g: int, block_bytes: float, across: bool) -> float:
        """Seconds of a ring all-gather of `g` blocks of `block_bytes` (inside a node or not)."""
        return (g - 1) * (self.latency + block_bytes / (self.network if across else self.nvlink))

    def exchange(self, split: Split, steps: int, across: bool) -> tuple[int, float]:
        """Bytes a member of `split` receives and seconds its all-gathers take over `steps`
        Newton–Schulz steps (bf16 blocks, padded to the widest member's; `Split.gathers`)."""
        g, received, seconds = split.size, 0, 0.0
        for counts, cols in split.gathers(steps):
            block = max(counts) * cols * BYTES
            received += (g - 1) * block
            seconds += self.all_gather(g, block, across)
        return received, seconds


H200 = CostModel()
FREE_COMM = CostModel(nvlink=math.inf, network=math.inf, latency=0.0)  # FLOPs alone decide
CostModel.H200, CostModel.FREE_COMM = H200, FREE_COMM  # public as vo.CostModel.H200 / .FREE_COMM


def split_rows(shape: tuple[int, int], shares: Sequence[float]) -> tuple[Split, list[int]]:
    """The split of an `(m, n)` matrix over members taking `shares` of its work: X's rows in
    proportion (rounded), M's rows following X's for a tall matrix; members left without a
    row are dropped. Returns the split and the indices of the members kept."""
    m, n = shape
    a, total = min(m, n), float(sum(shares))
    ends, cum = [], 0.0
    for s in shares:
        cum += s
        ends.append(round(a * cum / total))
    ends[-1] = a
    keep = [i for i in range(len(ends)) if ends[i] > (ends[i - 1] if i else 0)]
    bounds = [0] + [ends[i] for i in keep]
    x_rows = tuple(hi - lo for lo, hi in zip(bounds, bounds[1:]))
    if m <= n:
        return Split(shape, x_rows, x_rows), keep
    mb = [m * x // a for x in bounds]  # floor: each member keeps at least one row (m >= a)
    return Split(shape, tuple(hi - lo for lo, hi in zip(mb, mb[1:])), x_rows), keep


def _split_seconds(split: Split, steps: int, across: bool, cost: CostModel) -> float:
    """Seconds the slowest member of `split` takes: its FLOPs and its exchanges."""
    comm = cost.exchange(split, steps, across)[1]
    return max(split.member_flops(i, steps) for i in range(split.size)) / cost.flops + comm


def splittable(rows: int, cols: int, steps: int, cost: CostModel) -> bool:
    """Whether two ranks of a node finish the matrix sooner than one."""
    if min(rows, cols) < 2:
        return False
    split, _ = split_rows((rows, cols), [1, 1])
    return _split_seconds(split, steps, False, cost) < ns_flops(rows, cols, steps) / cost.flops


@dataclass(frozen=True)
class MuonPlan:
    """Per matrix (in the order given): `owners[i]`, the rank orthogonalizing it whole, or None
    when `groups[i]` (ranks, ascending) split it as `splits[i]` says. Per rank: `loads`
    (Newton–Schulz FLOPs a step, split shares included), `bytes_per_rank` (what the split
    exchanges bring it a step) and `times` (modelled seconds: FLOPs at peak + exchanges)."""

    owners: list[int | None]
    groups: dict[int, tuple[int, ...]]
    splits: dict[int, Split]
    loads: list[float]
    bytes_per_rank: list[float]
    times: list[float]
    cost: CostModel = field(default=H200, repr=False)

    @property
    def imbalance(self) -> float:
        """max / mean of `loads`."""
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean if mean else 1.0

    @property
    def time_imbalance(self) -> float:
        """max / mean of `times`."""
        mean = sum(self.times) / len(self.times)
        return max(self.times) / mean if mean else 1.0


def muon_plan(
    shapes: Sequence[tuple[int, ...]],
    world_size: int,
    *,
    ns_steps: int | Sequence[int] = 5,
    mesh_shape: tuple[int, int] | None = None,
    cost: CostModel = H200,
    homes: Sequence[int | None] | None = None,
) -> MuonPlan:
    """The plan `vo.Muon` builds for parameters of `shapes` (2-D matrices, 3-D stacks, 4-D
    convolutions, in the optimizer's order) on `world_size` ranks; `ns_steps` for all or one per
    shape. `mesh_shape = (replicas, shards)` of a `replicate x shard` mesh (world ranks row-major,
    `torch.distributed.init_device_mesh`'s order) only checks the world: groups stay inside a
    node, and a node inside a shard group when shards are a multiple of the node. `homes`, one
    per matrix (a 3-D stack counts its matrices), is the world rank already holding it whole, if
    any: a whole matrix stays there while that rank's load stays within 5 % of the mean, so it
    need not travel (`vo.Muon` passes its layout's homes; None plans as if nothing lay anywhere)."""
    steps = [ns_steps] * len(shapes) if isinstance(ns_steps, int) else list(ns_steps)
    if len(steps) != len(shapes):
        raise ValueError(f"{len(steps)} ns_steps for {len(shapes)} shapes")
    if mesh_shape is not None and math.prod(mesh_shape) != world_size:
        raise ValueError(f"a mesh of shape {tuple(mesh_shape)} does not span {world_size} ranks")
    dims = []
    for shape, s in zip(shapes, steps):
        count, rows, cols = matrix_view(tuple(shape))
        dims += [(rows, cols, s)] * count
    if homes is not None and len(homes) != len(dims):
        raise ValueError(f"{len(homes)} homes for {len(dims)} matrices")
    return plan_matrices(dims, world_size, cost, homes)


def plan_matrices(
    dims: Sequence[tuple[int, int, int]],
    world: int,
    cost: CostModel = H200,
    homes: Sequence[int | None] | None = None,
    whole: Sequence[bool] | None = None,
    allowed: Sequence[Sequence[int] | None] | None = None,
) -> MuonPlan:
    """`muon_plan` over matrices `(rows, cols, ns_steps)` (see the module's docstring); a matrix
    marked in `whole` is never split (NorMuon's normalization needs all of it on one rank); one
    with `allowed` ranks (an expert matrix, on its EP rank's ranks) is whole and owned by one of them."""
    homes = list(homes) if homes is not None else [None] * len(dims)
    allowed = list(allowed) if allowed is not None else [None] * len(dims)
    whole = [bool(w) or a is not None for w, a in zip(whole or [False] * len(dims), allowed)]
    costs = [ns_flops(r, c, s) for r, c, s in dims]
    mean = sum(costs) / world
    loads = [0.0] * world
    owners: list[int | None] = [None] * len(dims)
    groups: dict[int, tuple[int, ...]] = {}
    splits: dict[int, Split] = {}
    line = [
        i
        for i, (r, c, s) in enumerate(dims)
        if world > 1 and not whole[i] and costs[i] > THETA * mean and splittable(r, c, s, cost)
    ]
    line.sort(key=lambda i: (-costs[i], i))
    for ranks, items in _pools(line, dims, costs, world, mean, cost):
        for i, members, shares in _wrap(items, ranks, costs):
            split, keep = split_rows(dims[i][:2], shares)
            if len(keep) == 1:
                owners[i] = members[keep[0]]
                loads[owners[i]] += costs[i]
                continue
            groups[i], splits[i] = tuple(members[k] for k in keep), split
            for k, r in enumerate(groups[i]):
                loads[r] += split.member_flops(k, dims[i][2])
    rest = [i for i in range(len(dims)) if owners[i] is None and i not in groups]
    placed = assign_owners(
        [costs[i] for i in rest],
        world,
        [homes[i] for i in rest],
        loads=loads,
        allowed=[allowed[i] for i in rest],
    )
    for i, o in zip(rest, placed):
        owners[i] = o
        loads[o] += costs[i]
    received, times = [0.0] * world, [x / cost.flops for x in loads]
    for i, members in groups.items():
        nbytes, seconds = cost.exchange(splits[i], dims[i][2], _across(members, cost))
        for r in members:
            received[r] += nbytes
            times[r] += seconds
    if groups and (unsplit := _unsplit(costs, world, homes, allowed, cost, max(times))) is not None:
        return unsplit  # every matrix whole (LPT alone) is the plan when it finishes no later
    return MuonPlan(owners, groups, splits, loads, received, times, cost)


def _unsplit(costs, world: int, homes, allowed, cost: CostModel, limit: float) -> MuonPlan | None:
    """The plan with every matrix whole on one owner (the balancer alone), if its busiest rank
    finishes within `limit` modelled seconds (the split plan's); else None."""
    whole = assign_owners(costs, world, homes, allowed=allowed)
    flat = [0.0] * world
    for c, o in zip(costs, whole):
        flat[o] += c
    if max(flat) / cost.flops > limit:
        return None
    return MuonPlan(list(whole), {}, {}, flat, [0.0] * world, [x / cost.flops for x in flat], cost)


def _pools(line: list[int], dims, costs, world: int, mean: float, cost: CostModel):
    """Line matrices (largest first) with the ranks they are laid over: a matrix larger than a
    node's share on a node of its own, or, when the cost model prefers a group across nodes
    (`_nodes_for`), with all such matrices over their share of the nodes; the rest dealt to the
    other nodes, each to the one with the least line work per rank."""
    nodes = [list(range(lo, min(lo + cost.node, world))) for lo in range(0, world, cost.node)]
    free, dealt, pooled = list(range(len(nodes))), [], []
    for i in line:
        if costs[i] <= cost.node * mean or len(free) < 2:
            dealt.append(i)
        elif _nodes_for(dims[i], costs[i], mean, len(nodes), cost) > 1:
            pooled.append(i)
        else:
            yield nodes[free.pop(0)], [i]
    if pooled:  # over their share of the free nodes, leaving one for the rest if there is a rest
        work = sum(costs[i] for i in pooled)
        share = round(len(free) * work / (work + sum(costs[i] for i in dealt)))
        k = max(1, min(share, len(free) - (1 if dealt else 0)))
        yield [r for n in free[:k] for r in nodes[n]], pooled
        del free[:k]
    work = {n: 0.0 for n in free}
    items: dict[int, list[int]] = {n: [] for n in free}
    heap = [(0.0, n) for n in free]
    for i in dealt:
        _, n = heapq.heappop(heap)
        items[n].append(i)
        work[n] += costs[i]
        heapq.heappush(heap, (work[n] / len(nodes[n]), n))
    for n in free:
        if items[n]:
            yield nodes[n], items[n]


def _wrap(items: list[int], ranks: list[int], costs) -> list[tuple[int, list[int], list[float]]]:
    """McNaughton's wrap-around: `items` laid end to end over `ranks`, each rank taking an equal
    part of their work; per item, the ranks it covers and the work each takes."""
    cap = sum(costs[i] for i in items) / len(ranks)
    out, r, room = [], 0, cap
    for i in items:
        left, mine, shares = float(costs[i]), [], []
        while True:
            take = left if r == len(ranks) - 1 else min(left, room)
            mine.append(ranks[r])
            shares.append(max(take, 0.0))
            left, room = left - take, room - take
            if left <= 1e-9 * costs[i]:
                break
            r, room = r + 1, cap
        if room <= 1e-9 * cap and r < len(ranks) - 1:
            r, room = r + 1, cap
        out.append((i, mine, shares))
    return out


def _across(members: Sequence[int], cost: CostModel) -> bool:
    return members[0] // cost.node != members[-1] // cost.node


def _nodes_for(dim: tuple[int, int, int], c: float, mean: float, most: int, cost: CostModel) -> int:
    """How many whole nodes a matrix larger than a node's share is best run on, up to the fewest
    that reach the mean: the count that finishes it soonest in the cost model (one, on H200)."""
    rows, cols, steps = dim
    enough = max(1, min(most, math.ceil(c / (cost.node * mean))))
    best, when = 1, math.inf
    for k in range(1, enough + 1):
        split, _ = split_rows((rows, cols), [1.0] * (k * cost.node))
        seconds = _split_seconds(split, steps, k > 1, cost)
        if seconds < when:
            best, when = k, seconds
    return best


__all__ = ["FREE_COMM", "H200", "CostModel", "MuonPlan", "muon_plan", "plan_matrices", "split_rows"]
