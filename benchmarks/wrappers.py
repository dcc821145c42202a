"""Inside torch's wrappers: the library's optimizers where a wrapper already averages the gradients
or holds the shards, against torch's optimizers under the same wrapper, on a local gloo world.

* `ddp`: a seeded GPT under `DistributedDataParallel`: `torch.optim.AdamW` against `vo.AdamW`
  (no `shard_modules=`: it reads DDP's averaged `.grad`, updates this rank's `1/W` and all-gathers
  the parameters, ZeRO-1), and `torch.optim.Muon` (+ AdamW on the rest, `muon_names`' split; every
  rank orthogonalizes every matrix) against `vo.Muon` (each matrix once in the world, by an owner).
* `fsdp2`: the GPT under FSDP2 (`fully_shard_gpt`): `vo.Muon` over FSDP2's shards against
  torchtitan's Muon (`benchmarks._optim.FullTensorMuon`: whole matrices on every rank).

All configurations of a section live in one world and take turns round by round (the order
rotating): the wrapper's forward and backward, a barrier, then `opt.step()`, timed on each rank.
Each section prints a note under its table that says how to read each column. Measured through
public surfaces only (`local_state_bytes()`, `memory_stats()`, `step_stats`, the profiler's windows
and memory events). The parameters are held to torch's after the first step (max |Δ| <= 1e-5) and
the loss after training (`benchmarks._verdict.LOSS_TOL`); after training they drift apart by fp32
and bf16 roundings while training alike, so that difference is printed, not held.

    python benchmarks/wrappers.py                    # W = 2 and 4, a 21 M GPT (~1 min on 2 CPU cores)
    python benchmarks/wrappers.py --quick            # tiny model, W = 2, 2 rounds
    python benchmarks/wrappers.py --sections fsdp2 --world-sizes 2   # one comparison only
"""

from __future__ import annotations

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
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks import _optim  # noqa: E402
from benchmarks._gpt import gpt_loss, launch, param_count, shaped_gpt  # noqa: E402
from benchmarks._main import finish, parse, print_goals  # noqa: E402
from benchmarks._measure import peak_bytes, slowest, window_seconds  # noqa: E402
from benchmarks._report import host_line, require_finite, table  # noqa: E402
from benchmarks._train import batches  # noqa: E402
from benchmarks._verdict import LOSS_TOL  # noqa: E402
from vescale_optim.optim.muon import matrix_view, ns_flops  # noqa: E402

FULL = dict(vocab=8192, d_model=384, n_layers=8, n_heads=6, seq_len=128, batch=2, seq=64)
QUICK = dict(vocab=512, d_model=64, n_layers=2, n_heads=4, seq_len=32, batch=2, seq=32)
PRELOAD = ["benchmarks.wrappers"]  # besides benchmarks._gpt.PEERS
SECTIONS = {"ddp": ("AdamW", "Muon"), "fsdp2": ("Muon",)}  # the optimizers each compares
STATE_SLACK = 1.05  # ours' state per rank <= STATE_SLACK / W of torch's
SAME = 1e-5  # max |Δ| of any parameter after the first step, ours against torch's
STEP_GOAL, PEAK_GOAL = 0.5, 1.0  # over FSDP2, ours against the full_tensor() peer: step time, peak bytes
# ours' profiled step under DDP: column -> profiler window (DDP's .grad into the shards, update, all-gather)
WINDOWS = {"take ms": "vescale_optim.sync_grads", "update ms": "vescale_optim.update"}
WINDOWS["AG ms"] = "vescale_optim.gather_params"


def _hidden_matrices(shape: dict) -> list[tuple[int, int]]:
    """(rows, cols) of every matrix Muon orthogonalizes in the GPT (`muon_names`' split)."""
    model = shaped_gpt(shape)
    names = _optim.muon_names(model)
    shapes = [matrix_view(tuple(p.shape)) for n, p in model.named_parameters() if n in names]
    return [(rows, cols) for count, rows, cols in shapes for _ in range(count)]


class _Config:
    """One configuration on this rank: its own seeded GPT under the section's wrapper, ours or
    torch's optimizer, and the seconds of each recorded `opt.step()`; in the profiled step, ours'
    profiler windows (DDP) or the bytes held as the step starts and its peak (FSDP2)."""

    def __init__(self, section: str, family: str, mine: bool, shape: dict):
        self.fsdp2, self.family, self.mine = section == "fsdp2", family, mine
        self.model = shaped_gpt(shape)
        if self.fsdp2:
            self.module = _optim.fully_shard_gpt(self.model)
            self.opt = _optim.ours(self.model, family) if mine else _optim.FullTensorMuon(self.model)
        elif mine:
            self.module, self.opt = DDP(self.model), _optim.ours(self.model, family)
        else:
            self.module, self.opt = _optim.peer(self.model, "DDP", family)
        self.step_s: list[float] = []
        self.losses: list[float] = []
        self.profiled: dict = {}

    def step(self, x: torch.Tensor, y: torch.Tensor, record: bool, profiled: bool) -> None:
        loss = gpt_loss(self.module, x, y)
        loss.backward()
        self.losses.append(loss.item())
        dist.barrier()
        watch = profiled and (self.fsdp2 or self.mine)
        held = self._held_bytes() if watch and self.fsdp2 else 0
        what = (
            profile(activities=[ProfilerActivity.CPU], profile_memory=self.fsdp2) if watch else nullcontext()
        )
        with what as prof:
            t0 = time.perf_counter()
            self.opt.step()
            seconds = time.perf_counter() - t0
        if record:
            self.step_s.append(seconds)
        if watch and self.fsdp2:
            self.profiled = {"held": held, "peak": held + peak_bytes(prof)}
        elif watch:
            self.profiled = {"step ms": 1e3 * seconds}
            for column, label in WINDOWS.items():
                if (s := window_seconds(prof, label)) is None:
                    raise RuntimeError(f"no profiler window {label!r} in vo.{self.family}'s step (moved?)")
                self.profiled[column] = 1e3 * s
        self.opt.zero_grad()

    def _held_bytes(self) -> int:
        """Bytes held as the step starts: FSDP2's shards of the parameters and of their gradients
        (alike on both sides), and every persistent tensor of the optimizer's (ours: all that
        `memory_stats()` counts; the peer's: its state and whole matrices)."""
        model = [p.to_local() for p in self.model.parameters()]
        model += [p.grad.to_local() for p in self.model.parameters() if p.grad is not None]
        own = sum(self.opt.memory_stats().values()) if self.mine else self.opt.held_bytes()
        return sum(t.numel() * t.element_size() for t in model) + own

    def params(self) -> dict[str, torch.Tensor]:
        """The whole parameters (under FSDP2 a collective)."""
        return {n: (p.full_tensor() if self.fsdp2 else p).detach() for n, p in self.model.named_parameters()}

    def stats(self) -> dict:
        out = {"step_s": self.step_s, "losses": self.losses, "profiled": self.profiled}
        if not self.mine:  # the full_tensor() peer counts its own (whole matrices, AdamW's state)
            return {
                **out,
                "state_bytes": self.opt.state_bytes() if self.fsdp2 else _optim.state_bytes(self.opt),
            }
        stats = {k: self.opt.step_stats[k] for k in ("ns_flops", "ns_matrices", "bytes_sent")}
        return {**out, "state_bytes": _optim.state_bytes(self.opt), **stats}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((p - b[n]).abs().max().item() for n, p in a.items())


def _rank(rank: int, world: int, section: str, shape: dict, warmup: int, rounds: int) -> dict:
    """Every configuration of `section` on this rank, interleaved (warm-up, timed rounds, one
    profiled round); then each one's stats, per optimizer and round the max |Δ| between ours'
    parameters and torch's, and how far training moved torch's."""
    families = SECTIONS[section]
    configs = [_Config(section, family, mine, shape) for family in families for mine in (False, True)]
    init = {n: p.clone() for n, p in configs[0].params().items()}  # all alike (seeded)
    pool = batches(shape, rank, world)
    total, diff = warmup + rounds + 1, {family: [] for family in families}
    for s in range(total):
        k = s % len(configs)
        for c in configs[k:] + configs[:k]:
            c.step(*pool[s % len(pool)], record=warmup <= s < total - 1, profiled=s == total - 1)
        for family in families:
            diff[family].append(_max_diff(*(c.params() for c in configs if c.family == family)))
    moved = {c.family: _max_diff(c.params(), init) for c in configs if not c.mine}
    return {"configs": {(c.family, c.mine): c.stats() for c in configs}, "max_diff": diff, "moved": moved}


def _ns_goal(matrices: list[tuple[int, int]], world: int, steps: int) -> int:
    """FLOPs of the ceil(n/W) largest of the n matrices: the most a rank carries when whole matrices
    are spread as evenly by count as they can be and it drew the largest."""
    flops = sorted((ns_flops(r, c, steps) for r, c in matrices), reverse=True)
    return sum(flops[: math.ceil(len(flops) / world)])


def _rows(section: str, world: int, per_rank: list[dict], matrices: list[tuple[int, int]]) -> list[dict]:
    rows = []
    for family in SECTIONS[section]:
        mine, theirs = ([r["configs"][(family, m)] for r in per_rank] for m in (True, False))
        slow = [slowest([r["step_s"] for r in res]) for res in (mine, theirs)]
        state = [[r["state_bytes"] for r in res] for res in (mine, theirs)]
        row = {"W": world, "optimizer": family}
        row["state MB ours"], row["state MB torch"] = max(state[0]) / 2**20, max(state[1]) / 2**20
        row["state x"], row["state goal x"] = max(state[0]) / max(state[1]), STATE_SLACK / world
        row["state x mean"] = statistics.mean(state[0]) / max(state[1])
        row["state MB by rank"] = state[0]
        row["step ms ours"], row["step ms torch"] = (1e3 * statistics.median(s) for s in slow)
        row["step x"] = statistics.median(m / t for m, t in zip(*slow))
        if section == "ddp":
            profiled = max((r["profiled"] for r in mine), key=lambda p: p["step ms"])  # the slowest rank's
            row["AG ms"], row["profiled ours"] = profiled["AG ms"], profiled
        else:
            peaks = [max(r["profiled"]["peak"] for r in res) for res in (mine, theirs)]
            row["peak MB ours"], row["peak MB torch"] = peaks[0] / 2**20, peaks[1] / 2**20
            row["peak x"], row["peak MB by rank"] = (
                peaks[0] / peaks[1],
                [r["profiled"]["peak"] / 2**20 for r in mine],
            )
        row["step MB sent ours"] = max(r["bytes_sent"] for r in mine) / 2**20
        if family == "Muon":
            every = sum(ns_flops(r, c, _optim.MUON["ns_steps"]) for r, c in matrices)
            flops = [r["ns_flops"] for r in mine]
            row["NS GFLOP ours"], row["NS GFLOP torch"] = max(flops) / 1e9, every / 1e9
            row["NS goal GFLOP"] = _ns_goal(matrices, world, _optim.MUON["ns_steps"]) / 1e9
            row["NS GFLOP by rank"], row["NS sum / torch"] = [f / 1e9 for f in flops], sum(flops) / every
            row["matrices"], row["matrices by rank"] = len(matrices), [r["ns_matrices"] for r in mine]
        diffs = [max(d) for d in zip(*(r["max_diff"][family] for r in per_rank))]  # by round
        row["max|Δ| 1st"], row["max|Δ|"], row["max|Δ| by round"] = diffs[0], diffs[-1], diffs
        row["Δ/moved"] = diffs[-1] / max(r["moved"][family] for r in per_rank)
        last = [statistics.mean(r["losses"][-1] for r in res) for res in (mine, theirs)]
        row["loss last"], row["|Δ loss|"] = last[0], abs(last[0] - last[1]) / abs(last[1])
        rows.append(row)
    return rows


def _goals(section: str, rows: list[dict]) -> dict[str, bool]:
    goals, whose = {}, "torch's" if section == "ddp" else "the peer's"
    for r in rows:
        at = f"W={r['W']} {r['optimizer']}" + (" over FSDP2" if section == "fsdp2" else "")
        if section == "fsdp2":
            step, peak = r["step x"], r["peak x"]
            goals[f"{at}: step time <= {STEP_GOAL}x the full_tensor() peer's ({step:.3f})"] = (
                step <= STEP_GOAL
            )
            goals[f"{at}: peak bytes <= {PEAK_GOAL}x the peer's ({peak:.3f})"] = peak <= PEAK_GOAL
        x, goal = r["state x"], r["state goal x"]
        goals[f"{at}: state per rank <= {STATE_SLACK}/W of {whose} ({x:.4f} <= {goal:.4f})"] = x <= goal
        diff, loss, tol = r["max|Δ| 1st"], r["|Δ loss|"], LOSS_TOL[r["optimizer"]]
        what = f"the same parameters as {whose} after one step (max |Δ| {diff:.2g} <= {SAME:g})"
        goals[f"{at}: {what}"] = diff <= SAME
        goals[f"{at}: the same loss as {whose} after training (relative |Δ| {loss:.2g} <= {tol:g})"] = (
            loss <= tol
        )
        if r["optimizer"] == "AdamW":
            continue
        n, busiest, most = r["matrices"], r["NS GFLOP ours"], r["NS goal GFLOP"]
        largest = f"the {math.ceil(n / r['W'])} largest matrices'"
        what = f"NS FLOPs on the busiest rank <= {largest} ({busiest:.4g} <= {most:.4g} GFLOP)"
        goals[f"{at}: {what}"] = busiest <= most
        once = sum(r["matrices by rank"])
        what = f"each matrix orthogonalized once in the world ({once} of {n})"
        goals[f"{at}: {what}"] = once == n and math.isclose(r["NS sum / torch"], 1, rel_tol=1e-9)
    return goals


COLUMNS = (
    "W|optimizer|state MB ours|state MB torch|state x|state x mean|state goal x|step ms ours|step ms torch"
)
COLUMNS = [*COLUMNS.split("|"), "step x", "AG ms", "step MB sent ours", "NS GFLOP ours", "NS GFLOP torch"]
COLUMNS += ["NS goal GFLOP", "max|Δ| 1st", "max|Δ|", "Δ/moved", "|Δ loss|"]
FSDP2_COLUMNS = ["W", "step ms ours", "step ms torch", "step x", "peak MB ours", "peak MB torch", "peak x"]
FSDP2_COLUMNS += ["state MB ours", "state MB torch", "state x", "step MB sent ours", "NS GFLOP ours"]
FSDP2_COLUMNS += ["NS GFLOP torch", "NS goal GFLOP", "max|Δ| 1st", "max|Δ|", "|Δ loss|"]
NS_NOTE = (
    "`NS GFLOP`: Newton-Schulz work per step on the busiest rank (ours `step_stats['ns_flops']`; torch's: "
    "every matrix, on every rank); `NS goal GFLOP`: the FLOPs of the ceil(n/W) largest of the n matrices, "
    "the most a rank carries when whole matrices are spread as evenly by count as they can be and it drew "
    "the largest. `max|Δ|`: the largest difference of a whole parameter, ours against torch's, after the "
    "first step (`1st`) and after training."
)
DDP_NOTE = (
    "`state x`: ours' optimizer state on its busiest rank over torch's on every rank (goal `state goal x` = "
    f"{STATE_SLACK}/W); `mean`: the mean over ranks'. `step ms`: `opt.step()`, median over rounds of the "
    "slowest rank's; `step x`: median over rounds of ours' over torch's in the same round. DDP's all-reduce "
    "runs in backward for both and is in neither. On CPU gloo's all-gather of ours' updated parameters "
    "(`AG ms`, its profiler window in one more step) is synchronous and all inside ours' step, while torch's "
    f"step communicates nothing: a CPU step ratio is not what a GPU shows. {NS_NOTE} `Δ/moved`: the latter "
    "over the most training moved a parameter of torch's; `|Δ loss|`: the last round's loss (mean over "
    "ranks), relative. The first step's fp32 rounding differences grow in training (AdamW's division by the "
    "gradients' RMS where they are near zero, Muon's bf16 Newton-Schulz), so the parameters are checked "
    "after the first step and the loss after training."
)
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
    "`memory_stats()`, which counts its copies of the local shards it does not use in place; the peer's "
    "state and whole matrices) plus the most the step allocates above that (the profiler's memory events; "
    f"goal `peak x` <= {PEAK_GOAL}). `state x`: ours' optimizer state on its busiest rank over the peer's "
    f"(goal {STATE_SLACK}/W). {NS_NOTE}"
)
TITLE = {
    "ddp": "DDP (ZeRO-1)",
    "fsdp2": "FSDP2: vo.Muon against torchtitan's full_tensor() + torch.optim.Muon",
}
TABLES = {"ddp": (COLUMNS, DDP_NOTE), "fsdp2": (FSDP2_COLUMNS, FSDP2_NOTE)}


def run_section(section: str, worlds: list[int], shape: dict, warmup: int, rounds: int) -> dict:
    """Torch's optimizers against ours under the `section`'s wrapper at each world size: rows and goals."""
    matrices, rows, threads = _hidden_matrices(shape), [], {}
    for world in worlds:
        t0 = time.perf_counter()
        per_rank = launch(_rank, world, section, shape, warmup, rounds, preload=PRELOAD)
        print(f"# {section} W={world}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        rows += _rows(section, world, per_rank, matrices)
        threads[world] = per_rank.threads
    columns, note = TABLES[section]
    require_finite(rows, columns)
    model = f"vocab {shape['vocab']}, d {shape['d_model']}, {shape['n_layers']} layers"
    print(f"\n## {TITLE[section]}; GPT of {param_count(shaped_gpt(shape)) / 1e6:.2f} M parameters ({model}),")
    print(f"{len(matrices)} hidden matrices -> Muon; {warmup} warm-up + {rounds} timed rounds\n")
    print(f"{host_line(threads[worlds[-1]])}\n")
    print(table(rows, columns, floatfmt=".4g"))
    print(f"\n{note}")
    goals = print_goals(f"Goals ({TITLE[section].split(':')[0]}):", _goals(section, rows))
    return {"rows": rows, "threads": threads, "goals": goals}


def main(argv: list[str] | None = None) -> dict:
    args = parse(
        __doc__,
        argv,
        "tiny model, W = 2, 2 rounds",
        world_sizes=dict(type=int, nargs="+", default=[2, 4]),
        rounds=(7, "timed rounds (median over these)"),
        warmup=1,
        sections=dict(nargs="+", choices=list(SECTIONS), default=list(SECTIONS), help="default: both"),
    )
    shape = QUICK if args.quick else FULL
    if args.quick:
        args.world_sizes, args.rounds, args.warmup = [2], min(args.rounds, 2), 0
        print("--quick: a smoke run on a tiny model; its times say nothing")
    out: dict = dict(world_sizes=args.world_sizes, shape=shape, warmup=args.warmup, rounds=args.rounds)
    out.update(adamw=_optim.ADAMW, muon=_optim.MUON, muon_adamw=_optim.MUON_ADAMW)
    for name in args.sections:
        out[name] = run_section(name, args.world_sizes, shape, args.warmup, args.rounds)
    out["goals"] = {k: v for name in args.sections for k, v in out[name]["goals"].items()}
    return finish("wrappers", args, out, out[args.sections[0]]["threads"][args.world_sizes[-1]])


if __name__ == "__main__":
    main()
