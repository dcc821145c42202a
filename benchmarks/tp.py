"""Data parallelism over a tensor-parallel model (dp2 x tp2 on 4 gloo ranks): ours against
FSDP2 2-D with AdamW, and against the Muon integration users write today.

Every configuration trains its own copy of the same seeded Llama-like stack (attention wq/wk/wv/wo,
a SwiGLU MLP w1/w2/w3, RMSNorms) under torch's TP plan on world["tp"] (ColwiseParallel
wq/wk/wv/w1/w3, RowwiseParallel wo/w2), on the same batches per data-parallel rank: `ours AdamW`
(`vo.AdamW(mesh=world["dp"], shard_modules=[*blocks, model])`), `FSDP2 AdamW` (`fully_shard` per
block and the root over world["dp"]: FSDP2 2-D, `torch.optim.AdamW`), `ours Muon` (`vo.Muon` on the
TP-cut matrices, each full matrix orthogonalized once in the world), `FSDP2 full_tensor Muon`
(FSDP2 2-D; `full_tensor()` of each matrix gradient and `torch.optim.Muon` on full-size copies on
every rank, each keeping its own shard) and `TP alone AdamW` (no data parallelism: the forward,
backward and TP all-reduces the others pay alike; the train time above it is what data
parallelism adds, `the data-parallel part`, printed after the goals).

Time: one step of each in turn per round, the order rotating; `train` is the whole step after a
barrier, `step` `opt.step()`; the median over rounds of the slowest rank's, `x` the median of
per-round ratios to the peer. `comm ms`: time in collectives (`benchmarks._comm`); `MB sent`: per
rank and step, and ours' own count (`stats MB`, `step_stats["bytes_sent"]`). `NS GFLOP`:
Newton–Schulz FLOPs per rank and step (ours `step_stats["ns_flops"]`, the busiest rank; the peer
every full matrix on every rank). `peak live MB`: the most tensor bytes alive on a rank in a step
after the first (`benchmarks._live`), each configuration built and run alone; `peak at` where.

    python benchmarks/tp.py            # 4 ranks (dp2 x tp2)
    python benchmarks/tp.py --quick    # a tiny model, a few rounds (a smoke test)
"""

from __future__ import annotations

import gc
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

import vescale_optim as vo  # noqa: E402
from benchmarks import _train  # noqa: E402
from benchmarks._comm import CommMeter  # noqa: E402
from benchmarks._gpt import launch  # noqa: E402
from benchmarks._live import live_steps  # noqa: E402
from benchmarks._main import finish, parse  # noqa: E402
from benchmarks._measure import load_average, median_ratio  # noqa: E402
from benchmarks._muon_plan import ns_flops  # noqa: E402
from benchmarks._optim import FullTensorMuon, Steps, fully_shard_gpt  # noqa: E402
from benchmarks._report import FSDP2_ON_CPU, table  # noqa: E402
from benchmarks._train import PHASES, interleave  # noqa: E402

PRELOAD = ["benchmarks.tp"]
WORLD, TP = 4, 2
CONFIGS = ["ours AdamW", "FSDP2 AdamW", "ours Muon", "FSDP2 full_tensor Muon", "TP alone AdamW"]
FLOOR = "TP alone AdamW"  # no data-parallel synchronisation: what ours and FSDP2 both pay
PEER = {"ours AdamW": "FSDP2 AdamW", "ours Muon": "FSDP2 full_tensor Muon"}
MODEL = dict(dim=256, layers=4, head=32, batch=4, seq=64, rounds=7)
QUICK = dict(dim=32, layers=2, head=8, batch=2, seq=8, rounds=3)
PLAN = {
    **{name: ColwiseParallel() for name in ("wq", "wk", "wv", "w1", "w3")},
    **{name: RowwiseParallel() for name in ("wo", "w2")},
}
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
MUON = dict(lr=0.02, weight_decay=0.1)
GOALS = {"train x (AdamW)": 0.8, "step x (Muon)": 0.3, "peak live x": 1.0}


class Block(nn.Module):
    def __init__(self, dim: int, head: int):
        super().__init__()
        self.head = head
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(dim, 4 * dim, bias=False)
        self.w2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (w(h).view(b, t, -1, self.head).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.wo(attention)
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Trainer(_train.Trainer):
    """One configuration (see the module's docstring) of the TP model on the dp x tp mesh `world`;
    ours' `step_stats["bytes_sent"]` after each recorded step, and the Newton–Schulz FLOPs a rank
    does per step."""

    def __init__(self, config: str, sizes: dict, world, meter: CommMeter | None = None):
        self.world, self.stats, self.ns = world, [], 0
        super().__init__(config, sizes, meter)

    def build(self, sizes: dict) -> nn.Module:
        torch.manual_seed(0)
        self.blocks = [Block(sizes["dim"], sizes["head"]) for _ in range(sizes["layers"])]
        # the final norm gives the root unit parameters of its own, as a model's head and embedding do
        model = nn.Sequential(*self.blocks, nn.RMSNorm(sizes["dim"]))
        for block in self.blocks:
            parallelize_module(block, self.world["tp"], PLAN)
        return model

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.model(x), y)

    def optimizer(self, model: nn.Module):
        units, dp = [*self.blocks, model], self.world["dp"]
        cut = [p for p in model.parameters() if isinstance(p, DTensor)]
        norms = [p for p in model.parameters() if not isinstance(p, DTensor)]
        if self.config == FLOOR:  # each dp rank steps its own gradient: the TP model's forward, backward and
            # TP all-reduces with nothing data-parallel (its loss is not comparable: no averaging);
            # torch's foreach AdamW takes DTensors and plain tensors in separate optimizers
            return Steps(*(torch.optim.AdamW(ps, foreach=True, **ADAMW) for ps in (cut, norms)))
        if self.config == "ours AdamW":
            return vo.AdamW(model.parameters(), mesh=dp, shard_modules=units, **ADAMW)
        if self.config == "ours Muon":
            groups = [{"params": cut}, {"params": norms, "use_muon": False, **ADAMW}]
            return vo.Muon(groups, mesh=dp, shard_modules=units, **MUON)
        fully_shard_gpt(model, dp, blocks=self.blocks)  # FSDP2 2-D
        if self.config == "FSDP2 AdamW":
            return torch.optim.AdamW(model.parameters(), foreach=True, **ADAMW)
        cut, norms = ([p for p in model.parameters() if (p.ndim == 2) == matrix] for matrix in (True, False))
        self.ns = sum(ns_flops(*p.shape) for p in cut)  # every full matrix, on every rank
        return FullTensorMuon(hidden=cut, rest=norms, muon=MUON, adamw=ADAMW)

    def step(self, x, y, record: bool = True, around=None) -> None:
        super().step(x, y, record, around)
        if record and self.config.startswith("ours"):
            self.stats.append(self.opt.step_stats.get("bytes_sent", 0))
            self.ns = int(self.opt.step_stats.get("ns_flops", 0))

    def result(self, peak: dict) -> dict:
        """Per recorded round: train and opt.step() ms, the loss, bytes sent, exposed comm ms."""
        sent = [sum(sum(c[k]["sent"].values()) for k in PHASES) for c in self.comm]
        exposed = [1e3 * sum(c[k]["exposed_s"] for k in PHASES) for c in self.comm]
        out = {"train": [1e3 * sum(t) for t in zip(*(self.times[k] for k in PHASES))], "loss": self.losses}
        out.update(step=[1e3 * t for t in self.times["step"]], sent=sent, comm=exposed, stats=self.stats)
        return {**out, "ns": self.ns, "peak": peak}


def _batches(sizes: dict, dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1 + dp_rank)
    shape = (sizes["batch"], sizes["seq"], sizes["dim"])
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(2)]


def _rank(rank: int, world_size: int, sizes: dict) -> dict:
    world = init_device_mesh("cpu", (world_size // TP, TP), mesh_dim_names=("dp", "tp"))
    pool = _batches(sizes, world["dp"].get_local_rank())
    # memory: each configuration built and run alone under the profiler
    peak = {}
    for config in CONFIGS:
        gc.collect()
        tr, trace = live_steps(lambda: Trainer(config, sizes, world), pool, 3, tail=False)  # noqa: B023
        peak[config] = trace.peak("bench::steady")  # {"bytes", "where", "by"}
        del tr, trace
    gc.collect()
    # time and bytes: every configuration in one world, one step each per round (after one to warm up)
    meter = CommMeter().install()
    trainers = [Trainer(c, sizes, world, meter) for c in CONFIGS]
    interleave(trainers, pool[:1], 1, 0)
    interleave(trainers, pool, 0, sizes["rounds"])
    return {tr.config: tr.result(peak[tr.config]) for tr in trainers}


def _slowest(per_rank: list[dict], config: str, key: str) -> list[float]:
    return [max(r[config][key][i] for r in per_rank) for i in range(len(per_rank[0][config][key]))]


def _ratio(per_rank: list[dict], a: str, b: str, key: str) -> float:
    return median_ratio(_slowest(per_rank, a, key), _slowest(per_rank, b, key))


def summarize(per_rank: list[dict]) -> tuple[list[dict], dict]:
    rows = []
    for c in CONFIGS:
        peer = PEER.get(c)
        top = max((r[c]["peak"] for r in per_rank), key=lambda p: p["bytes"])  # the rank that peaks highest
        stats = [statistics.mean(r[c]["stats"]) for r in per_rank] if per_rank[0][c]["stats"] else None
        # "peak by": the bytes alive at the peak by who allocated them (JSON only)
        peak = {k: max(r[k]["peak"]["bytes"] for r in per_rank) / 2**20 for k in (c, peer) if k}
        row = {
            "config": c,
            **{f"{k} ms": statistics.median(_slowest(per_rank, c, k)) for k in ("train", "step")},
        }
        row.update({f"{k} x": _ratio(per_rank, c, peer, k) if peer else None for k in ("train", "step")})
        row.update({"comm ms": statistics.median(_slowest(per_rank, c, "comm")), "peak live MB": peak[c]})
        row["peak at"] = " / ".join(n[7:] if n.startswith("bench::") else n for n in top["where"][1:])
        row["MB sent"] = statistics.mean(statistics.mean(r[c]["sent"]) for r in per_rank) / 2**20
        row["stats MB"] = statistics.mean(stats) / 2**20 if stats else None
        row["NS GFLOP"] = max(r[c]["ns"] for r in per_rank) / 1e9
        row.update({"last loss": per_rank[0][c]["loss"][-1], "peak by": top["by"]})
        if peer:
            row["peak live x"] = peak[c] / peak[peer]
        rows.append(row)
    by = {r["config"]: r for r in rows}
    adamw, muon = by["ours AdamW"], by["ours Muon"]
    measured = {"train x (AdamW)": adamw["train x"], "step x (Muon)": muon["step x"]}
    measured["peak live x"] = max(adamw["peak live x"], muon["peak live x"])
    goals = {k: {"goal": f"<= {GOALS[k]}", "measured": v, "met": v <= GOALS[k]} for k, v in measured.items()}
    return rows, goals, data_parallel_part(per_rank)


def data_parallel_part(per_rank: list[dict]) -> dict:
    """What data parallelism adds to the AdamW train step, ours and FSDP2's: the median over rounds
    of the slowest rank's train time minus the TP-alone floor's in the same round (forward,
    backward and the TP all-reduces, which both issue alike), and their ratio."""
    floor = _slowest(per_rank, FLOOR, "train")
    train = {c: _slowest(per_rank, c, "train") for c in ("ours AdamW", "FSDP2 AdamW")}
    ours, fsdp2 = (statistics.median(a - f for a, f in zip(t, floor)) for t in train.values())
    return {"floor ms": statistics.median(floor), "ours ms": ours, "FSDP2 ms": fsdp2, "x": ours / fsdp2}


COLUMNS = "config|train ms|train x|step ms|step x|comm ms|peak live MB|peak live x|peak at|MB sent|stats MB"
COLUMNS = [*COLUMNS.split("|"), "NS GFLOP", "last loss"]


def main(argv: list[str] | None = None) -> dict:
    rounds = dict(type=int, help="timed rounds (default 7; 3 with --quick)")
    args = parse(__doc__, argv, "a tiny model, 3 rounds", rounds=rounds)
    sizes = dict(QUICK if args.quick else MODEL)
    if args.rounds:
        sizes["rounds"] = args.rounds
    print(f"load average before: {load_average()}")
    per_rank = launch(_rank, WORLD, sizes, preload=PRELOAD)
    rows, goals, dp_part = summarize(per_rank)
    blocks = (
        f"{sizes['layers']} blocks of width {sizes['dim']}, batch {sizes['batch']}x{sizes['seq']} per dp rank"
    )
    print(f"dp{WORLD // TP} x tp{TP}, {blocks}; medians of {sizes['rounds']} rounds\n")
    print(table(rows, COLUMNS, floatfmt=".3g"))
    print(f"\n{FSDP2_ON_CPU}\n")
    for name, g in goals.items():
        print(f"goal {name} {g['goal']}: measured {g['measured']:.3f}, {'met' if g['met'] else 'NOT met'}")
    part = dp_part
    print(
        f"\nthe data-parallel part of the AdamW train step (train minus {FLOOR}'s {part['floor ms']:.0f} ms):"
    )
    print(f"ours {part['ours ms']:.0f} ms, FSDP2 {part['FSDP2 ms']:.0f} ms, {part['x']:.3f}x")
    payload = {
        "world": WORLD,
        "tp": TP,
        "sizes": sizes,
        "rows": rows,
        "goals": goals,
        "data_parallel_part": part,
    }
    return finish("tp", args, payload, per_rank.threads)


if __name__ == "__main__":
    main()
