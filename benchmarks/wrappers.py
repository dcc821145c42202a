"""Inside torch's wrappers: the library's optimizers where a wrapper already averages the
gradients, against torch's optimizers under the same wrapper.

DDP (ZeRO-1). On a local gloo world of W ranks, four copies of the same seeded GPT
(`benchmarks._gpt.build_gpt`) train under `DistributedDataParallel(model)` on the same per-rank
batches (a pool of two, cycled):

* `torch AdamW` - `torch.optim.AdamW(model.parameters(), foreach=True)`: every rank holds all state;
* `vo.AdamW`    - `vo.AdamW(model.parameters())` (no `shard_modules=`): it reads DDP's averaged
                  `.grad`, updates this rank's `1/W` of the parameters and state, all-gathers the
                  parameters (ZeRO-1);
* `torch Muon`  - `torch.optim.Muon` on the hidden matrices + `torch.optim.AdamW` on the rest
                  (`benchmarks._optim.muon_names`' split): every rank orthogonalizes every matrix;
* `vo.Muon`     - `vo.Muon` with the same groups (the rest `use_muon=False`): each matrix is
                  orthogonalized once in the world, by an owner, then the parameters all-gathered.

All four live in one world and take turns round by round, the order rotating, so load on the
machine hits them alike. A round is, per configuration: DDP's forward and backward (its
all-reduce, the same for all four), a barrier, then `opt.step()`, timed on each rank. A step
lasts as long as its slowest rank; `step ms` is the median over rounds of that, `step x` the
median over rounds of ours / torch's within a round. One more round runs ours' step under the
profiler: `AG ms` is its `vescale_optim.gather_params` window, the all-gather of the updated
parameters. On CPU, gloo's all-gather is synchronous: it is all inside ours' step, while
torch's step communicates nothing, so a CPU step ratio is not what a GPU shows.

Measured through public surfaces only: ours' state `opt.local_state_bytes()` (checked against
`opt.memory_stats()["state"]`), torch's the bytes of every tensor in its `state`; ours'
Newton-Schulz FLOPs and matrices per rank `opt.step_stats["ns_flops"]`, `["ns_matrices"]`, its
step's bytes `["bytes_sent"]`; torch.optim.Muon's FLOPs per rank `vescale_optim.optim.muon.ns_flops`
over every hidden matrix (each rank does all of them). Goals: ours' state on its busiest rank
<= 1.05/W of torch's; Newton-Schulz FLOPs on the busiest rank <= the FLOPs of the ceil(n/W)
largest of the n matrices, and every matrix once in the world; the same parameters as torch's
after the first step (max |Δ| <= 1e-5) and the same loss after training (relative, within
`benchmarks._verdict.LOSS_TOL`: AdamW 1e-4, Muon 1e-2). The parameters after training are
printed, not held to 1e-5: the first step leaves fp32 rounding differences (~1e-8), which
AdamW's division by the gradient's running RMS scales up where gradients are near zero, and
Muon's bf16 Newton-Schulz turns into different bf16 roundings of the next updates; they drift
apart (here by ~1e-5 with AdamW, a few 1e-3 with Muon) while training alike.

    python benchmarks/wrappers.py                    # W = 2 and 4, a 21 M GPT (~1 min on 2 CPU cores)
    python benchmarks/wrappers.py --quick            # tiny model, W = 2, 2 rounds
    python benchmarks/wrappers.py --world-sizes 2 4 8 --rounds 9
    python benchmarks/wrappers.py --sections fsdp2 --world-sizes 2   # one comparison only
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks._gpt import launch, param_count, shaped_gpt  # noqa: E402
from benchmarks._main import print_goals  # noqa: E402
from benchmarks._measure import peak_bytes, slowest, window_seconds  # noqa: E402
from benchmarks._optim import (  # noqa: E402
    ADAMW,
    MUON,
    MUON_ADAMW,
    FullTensorMuon,
    fully_shard_gpt,
    muon_names,
    ours,
    peer,
)
from benchmarks._report import environment, host_line, require_finite, save_json, table  # noqa: E402
from benchmarks._train import batches  # noqa: E402
from benchmarks._verdict import LOSS_TOL  # noqa: E402
from vescale_optim.optim.muon import matrix_view, ns_flops  # noqa: E402

FULL = dict(vocab=8192, d_model=384, n_layers=8, n_heads=6, seq_len=128, batch=2, seq=64)
QUICK = dict(vocab=512, d_model=64, n_layers=2, n_heads=4, seq_len=32, batch=2, seq=32)
PRELOAD = ["benchmarks.wrappers"]  # besides benchmarks._gpt.PEERS
FAMILIES = ("AdamW", "Muon")
STATE_SLACK = 1.05  # ours' state per rank <= STATE_SLACK / W of torch's
SAME = 1e-5  # max |Δ| of any parameter after the first step, ours against torch's
# ours' profiled step: column -> profiler window (copy of DDP's .grad into the shards, update, all-gather)
WINDOWS = {"take ms": "vescale_optim.sync_grads", "update ms": "vescale_optim.update"}
WINDOWS["AG ms"] = "vescale_optim.gather_params"


_goals, _model = print_goals, shaped_gpt  # the goals printed, a GPT of a shape (both sections)


def _rounds(n: int, rank: int, desc: str):
    """`range(n)`, with a progress bar on rank 0 where tqdm is installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return range(n)
    return tqdm(range(n), desc=desc, disable=rank != 0, file=sys.stderr, leave=False)


def _hidden_matrices(shape: dict) -> list[tuple[int, int]]:
    """(rows, cols) of every matrix Muon orthogonalizes in the GPT (`muon_names`' split)."""
    model = _model(shape)
    names = muon_names(model)
    shapes = [matrix_view(tuple(p.shape)) for n, p in model.named_parameters() if n in names]
    return [(rows, cols) for count, rows, cols in shapes for _ in range(count)]


# ====================================================================== DDP (ZeRO-1)


def _torch_state_bytes(opt) -> int:
    """Bytes of every tensor in the state of a torch optimizer (or of each of a `Steps`)."""
    values = [v for o in getattr(opt, "opts", [opt]) for s in o.state.values() for v in s.values()]
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


class _UnderDDP:
    """One configuration on this rank: its own seeded GPT under `DDP`, built before its optimizer,
    and the seconds of each recorded `opt.step()`."""

    def __init__(self, family: str, mine: bool, shape: dict):
        self.family, self.mine = family, mine
        self.model = _model(shape)
        if mine:
            self.ddp, self.opt = DDP(self.model), ours(self.model, family)
        else:
            self.ddp, self.opt = peer(self.model, "DDP", family)
        self.step_s: list[float] = []
        self.losses: list[float] = []
        self.windows: dict[str, float] = {}

    def step(self, x: torch.Tensor, y: torch.Tensor, record: bool, profiled: bool = False) -> None:
        loss = F.cross_entropy(self.ddp(x).flatten(0, 1), y.flatten())
        loss.backward()
        self.losses.append(loss.item())
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) if profiled else nullcontext() as prof:
            t0 = time.perf_counter()
            self.opt.step()
            seconds = time.perf_counter() - t0
        if record:
            self.step_s.append(seconds)
        if profiled:
            self.windows = {"step ms": 1e3 * seconds}
            for column, label in WINDOWS.items():
                if (s := window_seconds(prof, label)) is None:
                    raise RuntimeError(f"no profiler window {label!r} in vo.{self.family}'s step (moved?)")
                self.windows[column] = 1e3 * s
        self.opt.zero_grad()

    def stats(self) -> dict:
        if not self.mine:
            return {"state_bytes": _torch_state_bytes(self.opt)}
        held, counted = self.opt.local_state_bytes(), self.opt.memory_stats()["state"]
        if held != counted:  # two public counts of the same tensors
            raise RuntimeError(f"local_state_bytes() {held} != memory_stats()['state'] {counted}")
        stats = {k: self.opt.step_stats[k] for k in ("ns_flops", "ns_matrices", "bytes_sent")}
        return {"state_bytes": held, "profiled": self.windows, **stats}


def _max_diff(a: torch.nn.Module, b: torch.nn.Module | dict) -> float:
    """The largest |Δ| of a parameter between two GPTs (or a GPT and its named parameters)."""
    other = b if isinstance(b, dict) else dict(b.named_parameters())
    return max((p - other[n]).abs().max().item() for n, p in a.named_parameters())


def _ddp_rank(rank: int, world: int, shape: dict, warmup: int, rounds: int) -> dict:
    """Every configuration on this rank, interleaved (warm-up, timed rounds, one profiled round);
    then each one's stats, per family and round the max |Δ| between ours' parameters and torch's,
    and how far training moved torch's."""
    configs = [_UnderDDP(family, mine, shape) for family in FAMILIES for mine in (False, True)]
    init = {n: p.detach().clone() for n, p in configs[0].model.named_parameters()}  # all alike (seeded)
    pool = batches(shape, rank, world)
    total, diff = warmup + rounds + 1, {family: [] for family in FAMILIES}
    for s in _rounds(total, rank, f"DDP W={world}"):
        k = s % len(configs)
        for c in configs[k:] + configs[:k]:
            c.step(*pool[s % len(pool)], record=warmup <= s < total - 1, profiled=s == total - 1 and c.mine)
        for family in FAMILIES:
            diff[family].append(_max_diff(*(c.model for c in configs if c.family == family)))
    moved = {c.family: _max_diff(c.model, init) for c in configs if not c.mine}
    stats = {(c.family, c.mine): {"step_s": c.step_s, "losses": c.losses, **c.stats()} for c in configs}
    return {"configs": stats, "max_diff": diff, "moved": moved}


def _ns_goal(matrices: list[tuple[int, int]], world: int, steps: int) -> int:
    """FLOPs of the ceil(n/W) largest of the n matrices: the most a rank carries when whole matrices
    are spread as evenly by count as they can be and it drew the largest."""
    flops = sorted((ns_flops(r, c, steps) for r, c in matrices), reverse=True)
    return sum(flops[: math.ceil(len(flops) / world)])


def _ddp_rows(world: int, per_rank: list[dict], matrices: list[tuple[int, int]]) -> list[dict]:
    rows = []
    for family in FAMILIES:
        theirs, mine = ([r["configs"][(family, m)] for r in per_rank] for m in (False, True))
        slow_theirs, slow_mine = (slowest([r["step_s"] for r in res]) for res in (theirs, mine))
        by_rank, peer_state = [r["state_bytes"] for r in mine], theirs[0]["state_bytes"]
        profiled = max((r["profiled"] for r in mine), key=lambda p: p["step ms"])  # the slowest rank's
        row = {"W": world, "optimizer": family}
        row["state MB ours"], row["state MB torch"] = max(by_rank) / 2**20, peer_state / 2**20
        row["state x"], row["state goal x"] = max(by_rank) / peer_state, STATE_SLACK / world
        row["state x mean"], row["state MB by rank"] = statistics.mean(by_rank) / peer_state, by_rank
        row["step ms ours"] = 1e3 * statistics.median(slow_mine)
        row["step ms torch"] = 1e3 * statistics.median(slow_theirs)
        row["step x"] = statistics.median(m / t for m, t in zip(slow_mine, slow_theirs))
        row["AG ms"], row["profiled ours"] = profiled["AG ms"], profiled
        row["step MB sent ours"] = max(r["bytes_sent"] for r in mine) / 2**20
        diffs = [max(d) for d in zip(*(r["max_diff"][family] for r in per_rank))]  # by round
        row["max|Δ| 1st"], row["max|Δ|"], row["max|Δ| by round"] = diffs[0], diffs[-1], diffs
        row["Δ/moved"] = diffs[-1] / max(r["moved"][family] for r in per_rank)
        last = [statistics.mean(r["losses"][-1] for r in res) for res in (mine, theirs)]
        row["loss last"], row["|Δ loss|"] = last[0], abs(last[0] - last[1]) / abs(last[1])
        if family == "Muon":
            every = sum(ns_flops(r, c, MUON["ns_steps"]) for r, c in matrices)
            by_rank = [r["ns_flops"] for r in mine]
            row["NS GFLOP ours"], row["NS GFLOP torch"] = max(by_rank) / 1e9, every / 1e9
            row["NS goal GFLOP"] = _ns_goal(matrices, world, MUON["ns_steps"]) / 1e9
            row["NS GFLOP by rank"], row["NS sum / torch"] = [f / 1e9 for f in by_rank], sum(by_rank) / every
            row["matrices"], row["matrices by rank"] = len(matrices), [r["ns_matrices"] for r in mine]
        rows.append(row)
    return rows


def _ddp_goals(rows: list[dict]) -> dict[str, bool]:
    goals = {}
    for r in rows:
        at, x, goal = f"W={r['W']} {r['optimizer']}", r["state x"], r["state goal x"]
        goals[f"{at}: state per rank <= {STATE_SLACK}/W of torch's ({x:.4f} <= {goal:.4f})"] = x <= goal
        diff, loss, tol = r["max|Δ| 1st"], r["|Δ loss|"], LOSS_TOL[r["optimizer"]]
        goals[f"{at}: the same parameters as torch's after one step (max |Δ| {diff:.2g} <= {SAME:g})"] = (
            diff <= SAME
        )
        goals[f"{at}: the same loss as torch's after training (relative |Δ| {loss:.2g} <= {tol:g})"] = (
            loss <= tol
        )
        if r["optimizer"] == "AdamW":
            continue
        n, busiest, most = r["matrices"], r["NS GFLOP ours"], r["NS goal GFLOP"]
        largest = f"the {math.ceil(n / r['W'])} largest matrices'"
        goals[f"{at}: NS FLOPs on the busiest rank <= {largest} ({busiest:.4g} <= {most:.4g} GFLOP)"] = (
            busiest <= most
        )
        once = sum(r["matrices by rank"])
        goals[f"{at}: each matrix orthogonalized once in the world ({once} of {n})"] = (
            once == n and math.isclose(r["NS sum / torch"], 1, rel_tol=1e-9)
        )
    return goals


COLUMNS = (
    "W|optimizer|state MB ours|state MB torch|state x|state x mean|state goal x|step ms ours|step ms torch"
)
COLUMNS = [*COLUMNS.split("|"), "step x", "AG ms", "step MB sent ours", "NS GFLOP ours", "NS GFLOP torch"]
COLUMNS += ["NS goal GFLOP", "max|Δ| 1st", "max|Δ|", "Δ/moved", "|Δ loss|"]


DDP_NOTE = (
    "`state x`: ours' optimizer state on its busiest rank over torch's on every rank (goal `state goal x` = "
    f"{STATE_SLACK}/W); `mean`: the mean over ranks'. `step ms`: `opt.step()`, median over rounds of the "
    "slowest rank's; `step x`: median over rounds of ours' over torch's in the same round. DDP's all-reduce "
    "runs in backward for both and is in neither. On CPU gloo's all-gather of ours' updated parameters "
    "(`AG ms`, its profiler window in one more step) is synchronous and all inside ours' step, while torch's "
    "step communicates nothing: a CPU step ratio is not what a GPU shows. `NS GFLOP`: Newton-Schulz work "
    "per step on the busiest rank (ours `step_stats['ns_flops']`; torch.optim.Muon: every matrix, on every "
    "rank). `NS goal GFLOP`: the FLOPs of the ceil(n/W) largest of the n matrices, the most a rank carries "
    "when whole matrices are spread as evenly by count as they can be and it drew the largest (exactly 1/W "
    "is reachable only where whole matrices split evenly). `max|Δ|`: the largest difference of a "
    "parameter, ours against torch's, on any rank, after the first step (`1st`) and after training; "
    "`Δ/moved`: the latter over the most training moved a parameter of torch's; `|Δ loss|`: the last "
    "round's loss (mean over ranks), relative. The first step's fp32 rounding differences grow in training "
    "(AdamW's division by the gradients' RMS where they are near zero, Muon's bf16 Newton-Schulz), so the "
    "parameters are checked after the first step and the loss after training."
)


def ddp_section(worlds: list[int], shape: dict, warmup: int, rounds: int) -> dict:
    """DDP + torch's optimizers against DDP + ours (ZeRO-1) at each world size: rows and goals."""
    matrices, rows, threads = _hidden_matrices(shape), [], {}
    for world in worlds:
        t0 = time.perf_counter()
        per_rank = launch(_ddp_rank, world, shape, warmup, rounds, preload=PRELOAD)
        print(f"# DDP W={world}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        rows += _ddp_rows(world, per_rank, matrices)
        threads[world] = per_rank.threads
    require_finite(rows, COLUMNS[2:])
    model = f"vocab {shape['vocab']}, d {shape['d_model']}, {shape['n_layers']} layers"
    print(
        f"\n## DDP (ZeRO-1): GPT of {param_count(_model(shape)) / 1e6:.2f} M parameters ({model}), "
        f"{len(matrices)} hidden matrices -> Muon; {warmup} warm-up + {rounds} timed rounds\n"
    )
    print(f"{host_line(threads[worlds[-1]])}\n")
    print(table(rows, COLUMNS, floatfmt=".4g"))
    print(f"\n{DDP_NOTE}")
    return {"rows": rows, "threads": threads, "goals": _goals("Goals (DDP):", _ddp_goals(rows))}


# ====================================================================== FSDP2


STEP_GOAL, PEAK_GOAL = 0.5, 1.0  # ours over the full_tensor() peer: step time, peak bytes


class _OverFSDP2:
    """One Muon configuration on this rank: its own seeded GPT under FSDP2 (`fully_shard_gpt`), then
    ours over FSDP2's shards or torchtitan's whole-matrix `torch.optim.Muon` (`FullTensorMuon`); the
    seconds of each recorded `opt.step()`, and in the profiled one the bytes held at its start and
    its peak."""

    def __init__(self, mine: bool, shape: dict):
        self.mine = mine
        self.model = fully_shard_gpt(_model(shape))
        self.opt = ours(self.model, "Muon") if mine else FullTensorMuon(self.model)
        self.step_s: list[float] = []
        self.losses: list[float] = []
        self.held = self.peak = 0

    def step(self, x: torch.Tensor, y: torch.Tensor, record: bool, profiled: bool = False) -> None:
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        loss.backward()
        self.losses.append(loss.item())
        dist.barrier()
        if profiled:
            self.held = self._held_bytes()
        watch = profile(activities=[ProfilerActivity.CPU], profile_memory=True) if profiled else nullcontext()
        with watch as prof:
            t0 = time.perf_counter()
            self.opt.step()
            seconds = time.perf_counter() - t0
        if record:
            self.step_s.append(seconds)
        if profiled:
            self.peak = self.held + peak_bytes(prof)
        self.opt.zero_grad()

    def _held_bytes(self) -> int:
        """Bytes held as the step starts: FSDP2's shards of the parameters and of their gradients
        (alike on both sides), and every persistent tensor of the optimizer's (ours: all that
        `memory_stats()` counts; the peer's: its state and whole matrices)."""
        model = [p.to_local() for p in self.model.parameters()]
        model += [p.grad.to_local() for p in self.model.parameters() if p.grad is not None]
        own = sum(self.opt.memory_stats().values()) if self.mine else self.opt.held_bytes()
        return sum(t.numel() * t.element_size() for t in model) + own

    def stats(self) -> dict:
        out = {"step_s": self.step_s, "losses": self.losses, "held": self.held, "peak": self.peak}
        if not self.mine:
            return {**out, "state_bytes": self.opt.state_bytes()}
        stats = {k: self.opt.step_stats[k] for k in ("ns_flops", "ns_matrices", "bytes_sent")}
        return {**out, "state_bytes": self.opt.local_state_bytes(), **stats}


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole parameters of an FSDP2 model (collective)."""
    return {n: p.full_tensor().detach() for n, p in model.named_parameters()}


def _fsdp2_rank(rank: int, world: int, shape: dict, warmup: int, rounds: int) -> dict:
    """Both configurations on this rank, interleaved (warm-up, timed rounds, one profiled round);
    then each one's stats, per round the max |Δ| between ours' whole parameters and the peer's,
    and how far training moved the peer's."""
    configs = [_OverFSDP2(mine, shape) for mine in (False, True)]
    init = _full(configs[0].model)
    pool = batches(shape, rank, world)
    total, diff = warmup + rounds + 1, []
    for s in _rounds(total, rank, f"FSDP2 W={world}"):
        k = s % len(configs)
        for c in configs[k:] + configs[:k]:
            c.step(*pool[s % len(pool)], record=warmup <= s < total - 1, profiled=s == total - 1)
        diff.append(_fsdp2_diff(*configs))
    moved = max((p - init[n]).abs().max().item() for n, p in _full(configs[0].model).items())
    return {"configs": {c.mine: c.stats() for c in configs}, "max_diff": diff, "moved": moved}


def _fsdp2_diff(peer: _OverFSDP2, mine: _OverFSDP2) -> float:
    theirs = _full(peer.model)
    return max((p - theirs[n]).abs().max().item() for n, p in _full(mine.model).items())


def _fsdp2_rows(world: int, per_rank: list[dict], matrices: list[tuple[int, int]]) -> list[dict]:
    theirs, mine = ([r["configs"][m] for r in per_rank] for m in (False, True))
    slow_theirs, slow_mine = (slowest([r["step_s"] for r in res]) for res in (theirs, mine))
    row = {"W": world, "optimizer": "Muon"}
    row["step ms ours"] = 1e3 * statistics.median(slow_mine)
    row["step ms torch"] = 1e3 * statistics.median(slow_theirs)
    row["step x"] = statistics.median(m / t for m, t in zip(slow_mine, slow_theirs))
    peaks = [max(r["peak"] for r in res) for res in (mine, theirs)]
    row["peak MB ours"], row["peak MB torch"] = peaks[0] / 2**20, peaks[1] / 2**20
    row["peak x"] = peaks[0] / peaks[1]
    row["peak MB by rank"] = [r["peak"] / 2**20 for r in mine]
    state = [max(r["state_bytes"] for r in res) for res in (mine, theirs)]
    row["state MB ours"], row["state MB torch"] = state[0] / 2**20, state[1] / 2**20
    row["state x"], row["state goal x"] = state[0] / state[1], STATE_SLACK / world
    row["step MB sent ours"] = max(r["bytes_sent"] for r in mine) / 2**20
    every = sum(ns_flops(r, c, MUON["ns_steps"]) for r, c in matrices)
    by_rank = [r["ns_flops"] for r in mine]
    row["NS GFLOP ours"], row["NS GFLOP torch"] = max(by_rank) / 1e9, every / 1e9
    row["NS goal GFLOP"] = _ns_goal(matrices, world, MUON["ns_steps"]) / 1e9
    row["NS GFLOP by rank"], row["NS sum / torch"] = [f / 1e9 for f in by_rank], sum(by_rank) / every
    row["matrices"], row["matrices by rank"] = len(matrices), [r["ns_matrices"] for r in mine]
    diffs = [max(d) for d in zip(*(r["max_diff"] for r in per_rank))]
    row["max|Δ| 1st"], row["max|Δ|"], row["max|Δ| by round"] = diffs[0], diffs[-1], diffs
    row["Δ/moved"] = diffs[-1] / max(r["moved"] for r in per_rank)
    last = [statistics.mean(r["losses"][-1] for r in res) for res in (mine, theirs)]
    row["loss last"], row["|Δ loss|"] = last[0], abs(last[0] - last[1]) / abs(last[1])
    return [row]


def _fsdp2_goals(rows: list[dict]) -> dict[str, bool]:
    goals = {}
    for r in rows:
        at = f"W={r['W']} Muon over FSDP2"
        step, peak, state, goal = r["step x"], r["peak x"], r["state x"], r["state goal x"]
        goals[f"{at}: step time <= {STEP_GOAL}x the full_tensor() peer's ({step:.3f})"] = step <= STEP_GOAL
        goals[f"{at}: peak bytes <= {PEAK_GOAL}x the peer's ({peak:.3f})"] = peak <= PEAK_GOAL
        goals[f"{at}: state per rank <= {STATE_SLACK}/W of the peer's ({state:.4f} <= {goal:.4f})"] = (
            state <= goal
        )
        n, busiest, most = r["matrices"], r["NS GFLOP ours"], r["NS goal GFLOP"]
        largest = f"the {math.ceil(n / r['W'])} largest matrices'"
        goals[f"{at}: NS FLOPs on the busiest rank <= {largest} ({busiest:.4g} <= {most:.4g} GFLOP)"] = (
            busiest <= most
        )
        once = sum(r["matrices by rank"])
        goals[f"{at}: each matrix orthogonalized once in the world ({once} of {n})"] = (
            once == n and math.isclose(r["NS sum / torch"], 1, rel_tol=1e-9)
        )
        diff, loss, tol = r["max|Δ| 1st"], r["|Δ loss|"], LOSS_TOL["Muon"]
        goals[f"{at}: the same parameters as the peer's after one step (max |Δ| {diff:.2g} <= {SAME:g})"] = (
            diff <= SAME
        )
        goals[f"{at}: the same loss as the peer's after training (relative |Δ| {loss:.2g} <= {tol:g})"] = (
            loss <= tol
        )
    return goals


FSDP2_COLUMNS = ["W", "step ms ours", "step ms torch", "step x", "peak MB ours", "peak MB torch", "peak x"]
FSDP2_COLUMNS += ["state MB ours", "state MB torch", "state x", "step MB sent ours", "NS GFLOP ours"]
FSDP2_COLUMNS += ["NS GFLOP torch", "NS goal GFLOP", "max|Δ| 1st", "max|Δ|", "|Δ loss|"]

FSDP2_NOTE = (
    "The peer is torchtitan's Muon over FSDP2: every rank keeps each hidden matrix whole "
    "(`full_tensor()`), all-gathers its gradient at the step, runs `torch.optim.Muon` on every matrix and "
    "writes its own rows back; the rest is `torch.optim.AdamW` on FSDP2's shards. Ours: `vo.Muon` over the "
    "same shards, each matrix whole on one owner (two all-to-alls). `step x`: median over rounds of ours' "
    f"`opt.step()` over the peer's in the same round, the slowest rank's each (goal <= {STEP_GOAL}). On CPU "
    "gloo's collectives are synchronous, FSDP2's as well as both optimizers' (FSDP2 overlaps its own only "
    "with CUDA streams): all inside the timed step, so a CPU step ratio is not what a GPU shows. "
    "`peak MB`: on the rank that holds most, the bytes held as the step starts (FSDP2's parameter and "
    "gradient shards, alike on both sides, and every persistent tensor of the optimizer's: ours "
    "`memory_stats()`, which counts its copies of the local shards it does not use in place (a large "
    "shard's unit updates FSDP2's memory itself); the peer's state and whole matrices) "
    "plus the most the step allocates above that (the profiler's memory events; goal `peak x` <= "
    f"{PEAK_GOAL}). `state x`: ours' optimizer state on its busiest rank over the peer's (goal "
    f"{STATE_SLACK}/W). "
    "`NS GFLOP`: Newton-Schulz work per step on the busiest rank (the peer: every matrix, on every rank); "
    "`max|Δ|`: the largest difference of a whole parameter after the first step (`1st`) and after training."
)


def fsdp2_section(worlds: list[int], shape: dict, warmup: int, rounds: int) -> dict:
    """FSDP2 + the full_tensor() peer against FSDP2 + ours (Muon) at each world size: rows and goals."""
    matrices, rows, threads = _hidden_matrices(shape), [], {}
    for world in worlds:
        t0 = time.perf_counter()
        per_rank = launch(_fsdp2_rank, world, shape, warmup, rounds, preload=PRELOAD)
        print(f"# FSDP2 W={world}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        rows += _fsdp2_rows(world, per_rank, matrices)
        threads[world] = per_rank.threads
    require_finite(rows, FSDP2_COLUMNS[1:])
    peer = "torchtitan's full_tensor() + torch.optim.Muon"
    print(f"\n## FSDP2: vo.Muon against {peer}; {warmup} warm-up + {rounds} timed rounds\n")
    print(f"{host_line(threads[worlds[-1]])}\n")
    print(table(rows, FSDP2_COLUMNS, floatfmt=".4g"))
    print(f"\n{FSDP2_NOTE}")
    return {"rows": rows, "threads": threads, "goals": _goals("Goals (FSDP2):", _fsdp2_goals(rows))}


# ====================================================================== main

SECTIONS = {"ddp": ddp_section, "fsdp2": fsdp2_section}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds (median over these)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="tiny model, W = 2, 2 rounds")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                    help="which comparisons to run (default: both)")  # fmt: skip
    args = ap.parse_args(argv)
    shape = QUICK if args.quick else FULL
    if args.quick:
        args.world_sizes, args.rounds, args.warmup = [2], min(args.rounds, 2), 0
        print("--quick: a smoke run on a tiny model; its times say nothing")
    t0 = time.perf_counter()
    out: dict = dict(world_sizes=args.world_sizes, shape=shape, warmup=args.warmup, rounds=args.rounds)
    out.update(adamw=ADAMW, muon=MUON, muon_adamw=MUON_ADAMW)
    for name in args.sections:
        out[name] = SECTIONS[name](args.world_sizes, shape, args.warmup, args.rounds)
    out["goals"] = {k: v for name in args.sections for k, v in out[name]["goals"].items()}
    out["env"] = environment(out[args.sections[0]]["threads"][args.world_sizes[-1]])
    path = save_json("wrappers_quick" if args.quick else "wrappers", out)
    print(f"total {time.perf_counter() - t0:.0f} s; wrote {path}", file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
