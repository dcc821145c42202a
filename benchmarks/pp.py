"""Pipeline x data parallelism (pp2 x dp2 on 4 gloo ranks): ours against FSDP2 under the same
pipeline schedule, with AdamW and with Muon.

Every configuration trains its own copy of the same seeded GPT (`benchmarks._gpt`), cut into two
stages the torchtitan way (each stage keeps only its own modules, under the whole model's names),
on the same batches per data-parallel rank, each step through torch's `PipelineStage` and
`Schedule1F1B` with `microbatches` micro-batches over world["pp"]:
- `ours AdamW`: `vo.AdamW(stage.parameters(), mesh=world["dp"], shard_modules=[*blocks, stage])`;
- `FSDP2 AdamW`: `fully_shard` on each block and on the stage over world["dp"] (torchtitan's PP x
  FSDP; the schedule syncs its gradients at the last micro-batch's backward only), with
  `torch.optim.AdamW(foreach=True)`;
- `ours Muon`: `vo.Muon` on the blocks' matrices (AdamW on the rest), ZeRO-3 as above: each
  matrix orthogonalized once in the world, by one rank of its stage;
- `FSDP2 full_tensor Muon`: FSDP2 as above with `torch.optim.Muon` on `full_tensor()` copies of
  the matrices (`benchmarks._optim.FullTensorMuon`): every rank of a stage orthogonalizes all of
  the stage's matrices.

`train`: one whole step after a barrier (the schedule's forwards and backwards, `opt.step()`,
`opt.zero_grad()`); `step`: `opt.step()`; each the median over rounds of the slowest rank's, `x`
the median of per-round ratios to the peer (the configurations take turns round by round, the
order rotating). `MB sent`: per rank and step, the collectives' bytes (`benchmarks._comm`; the
pipeline's point-to-point sends, alike on both sides, are not counted); `reduce MB` ours' gradient
reductions per step (`step_stats["reduce_bytes"]`). `peak live MB`: the most tensor bytes alive on
a rank in a step after the first (`benchmarks._live`), each configuration built and run alone.
`NS GFLOP`: Newton-Schulz FLOPs per step on the busiest rank (ours `step_stats["ns_flops"]`; the
peer every matrix of its stage), `NS x` ours over the peer's (goal <= 0.5: dp2 shares each
stage's matrices), `NS sum/model` ours summed over the 4 ranks over the model's matrices each
counted once (1: nothing orthogonalized twice). Runs on CPU (gloo) only.

    python benchmarks/pp.py            # pp2 x dp2, ~5 M parameters, 7 rounds
    python benchmarks/pp.py --quick    # a tiny model, 2 rounds (a smoke test)
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.pipelining import PipelineStage, Schedule1F1B  # noqa: E402
from torch.profiler import record_function  # noqa: E402

import vescale_optim as vo  # noqa: E402
from benchmarks._comm import CommMeter  # noqa: E402
from benchmarks._gpt import launch, param_count, shaped_gpt  # noqa: E402
from benchmarks._live import live_steps  # noqa: E402
from benchmarks._main import finish, parse, print_goals  # noqa: E402
from benchmarks._measure import load_average, median_ratio  # noqa: E402
from benchmarks._muon_plan import matrix_view, ns_flops  # noqa: E402
from benchmarks._optim import ADAMW, MUON, MUON_ADAMW, FullTensorMuon, fully_shard_gpt  # noqa: E402
from benchmarks._report import FSDP2_ON_CPU, host_line, require_finite, table  # noqa: E402
from benchmarks._train import batches, interleave  # noqa: E402
from benchmarks._verdict import LOSS_TOL  # noqa: E402

PRELOAD = ["benchmarks.pp", "torch.distributed.pipelining"]
PP, DP = 2, 2
CONFIGS = ["ours AdamW", "FSDP2 AdamW", "ours Muon", "FSDP2 full_tensor Muon"]
PEER = {"ours AdamW": "FSDP2 AdamW", "ours Muon": "FSDP2 full_tensor Muon"}
MODEL = dict(vocab=4096, d_model=256, n_layers=4, n_heads=4, seq_len=64, batch=8, seq=64, microbatches=4)
QUICK = dict(vocab=256, d_model=32, n_layers=2, n_heads=2, seq_len=16, batch=4, seq=16, microbatches=2)
NS_GOAL = 0.5  # ours' busiest rank's Newton-Schulz FLOPs over the full_tensor() peer's


class Stage(nn.Module):
    """Pipeline stage `stage` of `pp` of a benchmark GPT: its modules, under the GPT's names (the
    blocks by number), the others left out; the first stage embeds, the last one norms and
    projects onto the vocabulary."""

    def __init__(self, gpt: nn.Module, stage: int, pp: int):
        super().__init__()
        per = len(gpt.blocks) // pp
        first, last = stage == 0, stage == pp - 1
        self.tok_emb, self.pos_emb = (gpt.tok_emb, gpt.pos_emb) if first else (None, None)
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in range(stage * per, (stage + 1) * per)})
        self.ln_f, self.head = (gpt.ln_f, gpt.head) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.head is not None else x


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def hidden_and_rest(stage: Stage) -> tuple[list, list]:
    """The blocks' matrices (Muon's), and every other parameter of the stage (AdamW's)."""
    hidden = [p for p in stage.blocks.parameters() if p.ndim == 2]
    return hidden, [p for p in stage.parameters() if all(p is not h for h in hidden)]


def stage_ns_flops(stage: Stage) -> int:
    """Newton-Schulz FLOPs of one step on every matrix of the stage, each once."""
    shapes = [matrix_view(tuple(p.shape)) for p in hidden_and_rest(stage)[0]]
    return sum(n * ns_flops(r, c, MUON["ns_steps"]) for n, r, c in shapes)


class Trainer:
    """One configuration (see the module's docstring) on this rank of the (pp, dp) mesh `world`:
    its stage, optimizer and schedule; per recorded step the train and step seconds, the bytes the
    meter saw, ours' reduced bytes, and every step's loss on the last stage."""

    def __init__(self, config: str, shape: dict, world, meter: CommMeter | None = None):
        self.config, self.meter = config, meter
        pp_rank = world["pp"].get_local_rank()
        self.first, self.last = pp_rank == 0, pp_rank == PP - 1
        self.part = Stage(shaped_gpt(shape, seed=0), pp_rank, PP)
        self.model_ns = stage_ns_flops(self.part)  # before FSDP2 makes the shapes DTensors'
        self.sent, self.reduced, self.losses, self.ns = [], [], [], 0
        self.microbatches = shape["microbatches"]  # ours reduce once per step, as FSDP2 under PP
        self.opt = self.optimizer(world["dp"])
        stage = PipelineStage(self.part, pp_rank, PP, torch.device("cpu"), group=world["pp"].get_group())
        self.schedule = Schedule1F1B(stage, shape["microbatches"], loss_fn=loss_fn)
        self.times: dict[str, list[float]] = {"train": [], "step": []}

    def optimizer(self, dp):
        hidden, rest = hidden_and_rest(self.part)
        units = [*self.part.blocks.values(), self.part]
        sharded = dict(mesh=dp, shard_modules=units, microbatches=self.microbatches)
        aux = {k: MUON_ADAMW[k] for k in ("lr", "betas", "weight_decay")}
        if self.config == "ours AdamW":
            return vo.AdamW(self.part.parameters(), **ADAMW, **sharded)
        if self.config == "ours Muon":
            groups = [{"params": hidden, **MUON}, {"params": rest, "use_muon": False, **aux}]
            return vo.Muon(groups, **sharded)
        fully_shard_gpt(self.part, dp, blocks=list(self.part.blocks.values()))  # params now DTensors
        if self.config == "FSDP2 AdamW":
            return torch.optim.AdamW(self.part.parameters(), foreach=True, **ADAMW)
        hidden, rest = hidden_and_rest(self.part)
        self.ns = self.model_ns  # every matrix of the stage, on every rank
        return FullTensorMuon(hidden=hidden, rest=rest, muon=MUON, adamw=MUON_ADAMW)

    def step(self, x: torch.Tensor, y: torch.Tensor, record: bool = True) -> None:
        losses: list[torch.Tensor] = []
        if self.meter is not None:
            self.meter.take()
        (self.meter.barrier if self.meter is not None else dist.barrier)()
        t0 = time.perf_counter()
        with record_function("bench::schedule"):
            if self.first:
                self.schedule.step(x)
            elif self.last:
                self.schedule.step(target=y, losses=losses)
            else:
                self.schedule.step()
        t1 = time.perf_counter()
        with record_function("bench::step"):
            self.opt.step()
        t2 = time.perf_counter()
        with record_function("bench::zero_grad"):
            self.opt.zero_grad()
        t3 = time.perf_counter()
        if losses:
            self.losses.append(torch.stack(losses).mean().item())
        if not record:
            return
        self.times["train"].append(t3 - t0)
        self.times["step"].append(t2 - t1)
        if self.meter is not None:
            self.sent.append(sum(self.meter.take()["sent"].values()))
        if self.config.startswith("ours"):
            self.reduced.append(self.opt.step_stats["reduce_bytes"])
            self.ns = self.opt.step_stats["ns_flops"]

    def result(self, peak: dict) -> dict:
        out = {"times": self.times, "sent": self.sent, "reduced": self.reduced, "losses": self.losses}
        return {**out, "ns": self.ns, "model_ns": self.model_ns, "peak": peak, "last": self.last}


def _rank(rank: int, world_size: int, shape: dict, rounds: int) -> dict:
    world = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    pool = batches(shape, world["dp"].get_local_rank(), DP)  # the same on both stages of a dp rank
    peak = {}  # memory: each configuration built and run alone under the recorder
    for config in CONFIGS:
        gc.collect()
        tr, trace = live_steps(lambda: Trainer(config, shape, world), pool, 3, tail=False)  # noqa: B023
        peak[config] = trace.peak("bench::steady")
        del tr, trace
    gc.collect()
    meter = CommMeter().install()  # time and bytes: every configuration in one world, in turns
    trainers = [Trainer(c, shape, world, meter) for c in CONFIGS]
    interleave(trainers, pool, 1, rounds)
    return {tr.config: tr.result(peak[tr.config]) for tr in trainers}


def _slowest(per_rank: list[dict], config: str, key: str) -> list[float]:
    return [
        max(r[config]["times"][key][i] for r in per_rank)
        for i in range(len(per_rank[0][config]["times"][key]))
    ]


def summarize(per_rank: list[dict]) -> list[dict]:
    rows = []
    for c in CONFIGS:
        peer, res = PEER.get(c), [r[c] for r in per_rank]
        row = {
            "config": c,
            **{f"{k} ms": 1e3 * statistics.median(_slowest(per_rank, c, k)) for k in ("train", "step")},
        }
        for k in ("train", "step"):
            row[f"{k} x"] = (
                median_ratio(_slowest(per_rank, c, k), _slowest(per_rank, peer, k)) if peer else None
            )
        row["MB sent"] = max(statistics.mean(r["sent"]) for r in res) / 2**20
        row["reduce MB"] = (
            max(statistics.mean(r["reduced"]) for r in res) / 2**20 if res[0]["reduced"] else None
        )
        row["peak live MB"] = max(r["peak"]["bytes"] for r in res) / 2**20
        if peer:
            row["peak x"] = row["peak live MB"] / (max(r[peer]["peak"]["bytes"] for r in per_rank) / 2**20)
        if c.endswith("Muon"):
            row["NS GFLOP"] = max(r["ns"] for r in res) / 1e9
            model = sum(r["model_ns"] for r in res) / DP  # each stage's, counted once
            row["NS sum/model"] = sum(r["ns"] for r in res) / model if c.startswith("ours") else None
        row["loss first"] = statistics.mean(r["losses"][0] for r in res if r["last"])
        row["loss last"] = statistics.mean(r["losses"][-1] for r in res if r["last"])
        where = max(res, key=lambda r: r["peak"]["bytes"])["peak"]["where"][1:3]  # two windows deep
        row["peak at"] = " / ".join(n.removeprefix("bench::") for n in where)
        rows.append(row)
    by = {r["config"]: r for r in rows}
    for mine, peer in PEER.items():
        by[mine]["|Δ loss|"] = abs(by[mine]["loss last"] - by[peer]["loss last"]) / abs(by[peer]["loss last"])
        if mine.endswith("Muon"):
            by[mine]["NS x"] = by[mine]["NS GFLOP"] / by[peer]["NS GFLOP"]
    return rows


def goals(rows: list[dict]) -> dict[str, bool]:
    by = {r["config"]: r for r in rows}
    ns_x, once = by["ours Muon"]["NS x"], by["ours Muon"]["NS sum/model"]
    out = {
        f"Muon: NS FLOPs on the busiest rank <= {NS_GOAL}x the full_tensor() peer's ({ns_x:.3f})": ns_x
        <= NS_GOAL
    }
    out[f"Muon: each matrix orthogonalized once in the world (sum/model {once:.6f})"] = abs(once - 1) < 1e-9
    for mine in PEER:
        family, r = mine.split()[-1], by[mine]
        lowered, delta = r["loss last"] < r["loss first"], r["|Δ loss|"]
        what = (
            f"lowers the loss and ends within {LOSS_TOL[family]:g} of the peer's (relative |Δ| {delta:.2g})"
        )
        out[f"{family}: {what}"] = lowered and delta <= LOSS_TOL[family]
    return out


COLUMNS = "config|train ms|train x|step ms|step x|MB sent|reduce MB|peak live MB|peak x|NS GFLOP|NS x"
COLUMNS = [*COLUMNS.split("|"), "NS sum/model", "loss last", "|Δ loss|"]  # "peak at" in the JSON


def main(argv: list[str] | None = None) -> dict:
    args = parse(
        __doc__,
        argv,
        "a tiny model, 2 rounds",
        rounds=dict(type=int, help="timed rounds (default 7; 2 with --quick)"),
    )
    shape = dict(QUICK if args.quick else MODEL)
    rounds = args.rounds or (2 if args.quick else 7)
    if args.quick:
        print("--quick: a smoke run on a tiny model; its times say nothing")
    print(f"load average before: {load_average()}")
    per_rank = launch(_rank, PP * DP, shape, rounds, preload=PRELOAD)
    rows = summarize(per_rank)
    require_finite(rows, COLUMNS[1:])
    words = f"vocab {shape['vocab']}, d {shape['d_model']}, {shape['n_layers']} layers"
    params = param_count(shaped_gpt(shape)) / 1e6
    what = f"1F1B, {shape['microbatches']} micro-batches; GPT of {params:.2f} M parameters ({words})"
    print(f"\n## pp{PP} x dp{DP}, {what}")
    print(f"{shape['batch']}x{shape['seq']} tokens per dp rank and step; medians of {rounds} rounds\n")
    print(f"{host_line(per_rank.threads)}\n")
    print(table(rows, COLUMNS, floatfmt=".4g"))
    print(f"\n{FSDP2_ON_CPU}")
    met = print_goals("Goals (ours vs FSDP2 under the same schedule):", goals(rows))
    payload = {"pp": PP, "dp": DP, "shape": shape, "rounds": rounds, "rows": rows, "goals": met}
    return finish("pp", args, payload, per_rank.threads)


if __name__ == "__main__":
    main()
