"""Muon's setup of a layout: who orthogonalizes which matrix, and how each gets there and back.

`plan_setup` runs once the runtime has laid out the parameters (`vo.Muon._plan_work`, at
construction and again when the parameters were swapped before the first step) and returns a
`MuonSetup`; a step only reads it. One plan covers every matrix of the step and every rank of
the world (replicas too), so the step's total is balanced and each matrix is orthogonalized once:
`vo.muon_plan`'s balance (`_muon_plan.plan_matrices`), over the data-parallel world, or over the
dp x tp world when some matrix is cut over tensor parallelism (`_muon_tp`); a matrix lying whole
on one rank stays there when the balance allows. It makes groups (the dp x tp world, Muon's
split groups), which every rank does alike; it changes nothing of the optimizer's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..owners.balance import keep_homes, spread_homes
from ..owners.plan import plan_owners
from ..units.fsdp_shards import FsdpGrads
from ..units.segment import FROZEN, Segment, StateSpec
from ..units.tp_view import DpTpWorld, ParamCut
from . import _muon_tp, state_tiers
from ._muon_fsdp import FsdpMuon
from ._muon_fsdp import refused as over_fsdp_refused
from ._muon_math import ns_flops, ns_steps_of
from ._muon_plan import CostModel, MuonPlan, plan_matrices
from ._muon_split import SplitStep
from ._muon_tp import Experts, TPMatrix, needs_world, tp_kind
from ._muon_work import MatrixWork, SegmentWork, matrix_work

Kind = TPMatrix | Experts | None


@dataclass
class MuonSetup:
    """Muon's plan of one layout. `segs`: the Muon segments that step (`position`: each one's index
    by id); `plan`: who orthogonalizes what (`vo.MuonPlan`); `homes`: per matrix the world rank
    holding it whole (or None); `world`: the dp x tp world the matrices travel over (None: the
    data-parallel one). Per segment: its parameters' `cuts` and `kinds` (how each lies over TP),
    `blocks` (`(param, block)` per matrix), `owners` (per matrix, None where split); `parts`, by
    segment id, its moves and this rank's matrices (`SegmentWork`, a part per view of the world);
    `variance`: NorMuon's `v` of the matrices owned here, by `(segment, matrix)`; `split`: the step
    of the split matrices (None: none); `over_fsdp`: the whole step over FSDP2's shards instead."""

    segs: list[Segment]
    plan: MuonPlan
    homes: list[int | None] = field(default_factory=list)
    world: DpTpWorld | None = None
    cuts: list[list[ParamCut]] = field(default_factory=list)
    kinds: list[list[Kind]] = field(default_factory=list)
    blocks: list[list[tuple[int, int]]] = field(default_factory=list)
    owners: list[list[int | None]] = field(default_factory=list)
    parts: dict[int, list[SegmentWork]] = field(default_factory=dict)
    variance: dict[tuple[int, int], state_tiers.Kept] = field(default_factory=dict)
    split: SplitStep | None = None
    over_fsdp: FsdpMuon | None = None
    position: dict[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.position = {id(seg): s for s, seg in enumerate(self.segs)}

    @property
    def ns_load(self) -> list[float]:
        """Newton–Schulz FLOPs per world rank per step."""
        return [float(x) for x in self.plan.loads]


def plan_setup(runtime, cost_model: CostModel, variance: StateSpec) -> MuonSetup:
    """Muon's setup of `runtime`'s layout (`variance`: the spec of NorMuon's `v`)."""
    segs = [seg for seg in runtime.segments if seg.group["use_muon"] and seg.tier != FROZEN]
    if isinstance(runtime.wrapper, FsdpGrads):  # over FSDP2's shards: whole matrices to owners
        problem = over_fsdp_refused(segs)
        if problem is not None:
            raise NotImplementedError(problem)
        over = FsdpMuon(segs, runtime.wrapper, runtime.dp, cost_model, runtime.tensor_parallel)
        return MuonSetup(segs, over.plan, parts={id(seg): [] for seg in segs}, over_fsdp=over)
    tp = runtime.tensor_parallel
    cuts = [[tp.cut(p) for p in seg.params] for seg in segs]
    kinds = [[tp_kind(c) for c in seg_cuts] for seg_cuts in cuts]
    world = tp.world() if needs_world(kinds, any(seg.group["normuon"] for seg in segs)) else None
    work = [
        matrix_work(seg, ns_steps_of(seg.group), c, k, world is not None)
        for seg, c, k in zip(segs, cuts, kinds)
    ]
    plan, homes, owners = _balance(runtime, world, segs, work, cost_model)
    setup = MuonSetup(segs, plan, homes, world, cuts, kinds, [w.blocks for w in work])
    rank = runtime.dp.rank if world is None else world.comm.rank
    _assign(setup, runtime, work, owners, rank, variance)
    if plan.groups:
        items, shapes = [w.items for w in work], [w.shapes for w in work]
        setup.split = SplitStep(plan, segs, items, shapes, runtime.topology, runtime.dp)
    return setup


def _balance(runtime, world: DpTpWorld | None, segs: list[Segment], work: list[MatrixWork], cost_model):
    """The plan over every matrix (`plan_matrices`), each matrix's home and its owner (`keep_homes`:
    equal costs trade owners so that a matrix stays at a rank holding it whole, loads unchanged)."""
    topo = runtime.topology
    dims = [(r, c, ns_steps_of(seg.group)) for seg, w in zip(segs, work) for r, c in w.shapes]
    whole_only = [
        bool(seg.group["normuon"]) or world is not None for seg, w in zip(segs, work) for _ in w.shapes
    ]
    size = topo.world_size if world is None else world.comm.world_size
    items = [item for w in work for item in w.items]
    costs = [ns_flops(*d) for d in dims]
    # a matrix lying whole on one shard rank stays there when the balance allows (with
    # replicas, the matrices of a shard rank are dealt over its replicas)
    if world is None:
        homes = spread_homes(costs, [it.home for it in items], topo.ranks)
        holders = [() if it.home is None else tuple(row[it.home] for row in topo.ranks) for it in items]
        allowed, keys = None, costs
    else:  # an expert matrix is owned on its own EP rank's ranks, and trades owners only there
        tags = [tag for w in work for tag in w.tags]
        (homes, holders), allowed = _muon_tp.homes(world, costs, items, tags), _muon_tp.allowed(world, tags)
        keys = list(zip(costs, allowed))
    plan = plan_matrices(dims, size, cost_model, homes, whole_only, allowed)
    return plan, homes, keep_homes(plan.owners, keys, holders)


def _assign(setup: MuonSetup, runtime, work: list[MatrixWork], owners: list, rank: int, variance) -> None:
    """Per segment the owners of its matrices, NorMuon's `v` of those owned here, and the moves
    of the matrices orthogonalized whole (`setup.parts`)."""
    whole, pos = [], 0  # per segment, the matrices orthogonalized whole: items, shapes, owners, ids
    for s, (seg, w) in enumerate(zip(setup.segs, work)):
        keep = [k for k in range(len(w.items)) if owners[pos + k] is not None]
        mine = [owners[pos + k] for k in keep]
        whole.append(([w.items[k] for k in keep], [w.shapes[k] for k in keep], mine, keep))
        setup.owners.append(owners[pos : pos + len(w.items)])
        for k in keep if seg.group["normuon"] else ():
            if owners[pos + k] == rank:
                codec, device = state_tiers.codec_of(seg.tier), seg.local_params.device  # momentum's tier
                setup.variance[s, k] = state_tiers.Kept(codec, variance, w.shapes[k][0], device)
        pos += len(w.items)
    counts = [seg.counts for seg in setup.segs]
    if setup.world is None:  # one part per segment
        fixed = [o for w in whole for o in w[2]]
        found = plan_owners([w[0] for w in whole], runtime.topology, rank, sources=counts, owners=fixed)
        planned = [[(list(range(len(w[0]))), m)] for w, m in zip(whole, found.segments)]
    else:  # a part per view of the dp x tp world a segment's matrices use
        tags = [[work[s].tags[k] for k in w[3]] for s, w in enumerate(whole)]
        planned = _muon_tp.moves(setup.world, [w[0] for w in whole], [w[2] for w in whole], counts, tags)
    for seg, parts, (its, shs, _, ids) in zip(setup.segs, planned, whole):
        picked = [[[xs[k] for k in at] for xs in (its, shs, ids)] for at, _ in parts]
        setup.parts[id(seg)] = [SegmentWork.of(m, *p) for (_, m), p in zip(parts, picked)]
