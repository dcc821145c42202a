"""HSDP on a 2-D mesh (replicate x shard) against FSDP2's HSDP on gloo: step time, bytes
inside and across shard groups, Newton–Schulz FLOPs per rank.

Configurations on 4 ranks, each training its own copy of the same seeded GPT on the same
per-rank batches: `ours 2x2 AdamW|Muon` (`vo.AdamW` / `vo.Muon(muon_groups(model))` with
`mesh=init_device_mesh(..., (2, 2), ("replicate", "shard"))` and `shard_modules=[*model.blocks,
model]`), `ours 1x4` (one shard group of 4, no replicas) and `FSDP2 2x2` (`benchmarks._optim.fsdp2`
over the same mesh: FSDP2's HSDP with torch's optimizers). Time as in `benchmarks/fsdp.py`: all
configurations in one world, interleaved; the median over steps of the slowest rank's; `x` the
median of per-step ratios to FSDP2 2x2 with the same optimizer.

Bytes (`benchmarks._comm`), per rank and train step, the mean over ranks: `inside` a shard group,
`across` shard groups (replicate groups, and an all-to-all's peers in another replica), `mixed`
(a group spanning both, e.g. the world: left unsplit); `step` columns count what is sent inside
`opt.step()`; `stats MB` is ours' own count (`step_stats["bytes_sent"]`), a cross-check of the
meter's all-to-all. Kinds are counted as asked (gloo runs reduce-scatters as all-reduces).

Newton–Schulz FLOPs per rank and step: `total` the model's (every Muon matrix once, `5 * (4a²b +
2a³)` for `a x b`, a <= b); `stats` ours' `step_stats["ns_flops"]`; `measured` the profiler's FLOP
count of the innermost matrix products in one more `opt.step()` (a DTensor's product counted on
its local pieces). Ours orthogonalize each matrix once in the world, owners balanced, so a rank
does about total/4; torch.optim.Muon over FSDP2's DTensors has its products redistributed by
DTensor's sharding rules: about total/2 a rank on 2x2, the work split within a shard group but
repeated across replicas.

Under torchrun (`--torchrun`, `benchmarks._torchrun`) every process is one rank (NCCL on
`cuda:LOCAL_RANK`, else gloo); with W ranks (even) the meshes are `2x(W/2)` and `1xW` (`--configs`
takes the 4-rank names); rank 0 writes `hsdp_torchrun[_quick].json`. On CUDA phases are timed until
the device finished them, and `exposed comm` and the measured FLOPs are left out: the host only
issues collectives and waits on streams, and ours orthogonalize in Triton kernels, which the
profiler's count of ATen products does not see (ours' `stats` stays).

    python benchmarks/hsdp.py            # 4 ranks (~1 min on 2 cores)
    python benchmarks/hsdp.py --quick    # tiny model, 4 ranks, a few steps (a smoke test)
    torchrun --nproc-per-node 8 benchmarks/hsdp.py --torchrun --steps 4   # 2x4 and 1x8 meshes
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks import _torchrun, _train  # noqa: E402
from benchmarks._comm import CommMeter  # noqa: E402
from benchmarks._main import parse  # noqa: E402
from benchmarks._measure import matmul_flops, slowest  # noqa: E402
from benchmarks._muon_plan import ns_flops  # noqa: E402
from benchmarks._optim import MUON, fsdp2, muon_groups, ours  # noqa: E402
from benchmarks._train import against_peers, batches, device, interleave, ms, timed_row  # noqa: E402

WORLD = 4
MESHES = {"2x2": (2, 2), "1x4": (1, 4)}
CONFIGS = [f"{who} {family}" for family in ("AdamW", "Muon") for who in ("ours 2x2", "ours 1x4", "FSDP2 2x2")]
MODEL = dict(vocab=4096, d_model=256, n_layers=6, n_heads=8, seq_len=64, batch=2, seq=64)
QUICK = dict(vocab=320, d_model=64, n_layers=2, n_heads=4, seq_len=16, batch=1, seq=16)
PRELOAD = ["benchmarks.hsdp"]  # besides benchmarks._gpt.PEERS


def meshes(world: int) -> dict[str, tuple[int, int]]:
    """The two meshes of a `world` (even): 2 replicas of world/2 ranks, and one of all."""
    return {f"2x{world // 2}": (2, world // 2), f"1x{world}": (1, world)}


def named(config: str, world: int) -> str:
    """A configuration of `CONFIGS` (named at 4 ranks) as named on the meshes of `world`."""
    who, mesh, family = config.split()
    return f"{who} {list(meshes(world))[list(MESHES).index(mesh)]} {family}"


def peer(config: str, world: int = WORLD) -> str:
    return f"FSDP2 2x{world // 2} {config.split()[-1]}"


def ns_total(model: torch.nn.Module) -> int:
    """Newton–Schulz FLOPs of one step over every Muon matrix of `model`, each once."""
    steps = MUON["ns_steps"]
    return sum(ns_flops(p.shape[0], p.shape[1], steps) for p in muon_groups(model)[0]["params"])


class Trainer(_train.Trainer):
    """One configuration of this benchmark (see the module's docstring) on its mesh."""

    def __init__(self, config: str, shape: dict, meshes: dict, meter: CommMeter):
        self.mesh = meshes[config.split()[1]]
        self.replica_of = {r: i for i, row in enumerate(self.mesh.mesh.tolist()) for r in row}
        self.stats: list[dict] = []  # ours: opt.step_stats after each recorded step
        super().__init__(config, shape, meter)

    def optimizer(self, model: torch.nn.Module):
        self.ns_total, self.ns_count = ns_total(model), len(muon_groups(model)[0]["params"])
        who, family = self.config.split()[0], self.config.split()[-1]
        if who == "ours":
            return ours(model, family, mesh=self.mesh, shard_modules=[*model.blocks, model])
        return fsdp2(model, family, mesh=self.mesh)

    def step(self, x: torch.Tensor, y: torch.Tensor, record: bool = True, flops: bool = False) -> int | None:
        """One train step; with `flops`, the FLOPs of the matrix products in `opt.step()` (else None)."""
        self.meter.replica_of = self.replica_of
        prof = profile(activities=[ProfilerActivity.CPU], with_flops=True) if flops else None
        super().step(x, y, record, {"step": prof} if prof is not None else None)
        if record:
            self.stats.append(dict(getattr(self.opt, "step_stats", {})))
        return matmul_flops(prof) if prof is not None else None

    def comm_result(self) -> dict:
        """Per recorded step: the seconds in collectives and the bytes sent by "where kind", over the
        train step and inside opt.step()."""
        sent = [dict(sum((Counter(c["sent_by"]) for c in comm.values()), Counter())) for comm in self.comm]
        exposed = [sum(c["exposed_s"] for c in comm.values()) for comm in self.comm]
        step_sent = [comm["step"]["sent_by"] for comm in self.comm]
        return dict(exposed_s=exposed, sent=sent, step_sent=step_sent, stats=self.stats)


def _run(rank: int, world: int, shape: dict, configs: list[str], warmup: int, steps: int) -> dict:
    """Every configuration in this world, interleaved step by step; then one more step each,
    profiled for its FLOPs on the CPU (see the docstring)."""
    meter = CommMeter().install()
    names = ("replicate", "shard")
    made = {k: init_device_mesh(device().type, s, mesh_dim_names=names) for k, s in meshes(world).items()}
    pool = batches(shape, rank, world)
    trainers = [Trainer(c, shape, made, meter) for c in configs]
    interleave(trainers, pool, warmup, steps)
    cpu = device().type == "cpu"
    measured = {tr.config: tr.step(*pool[0], record=False, flops=cpu) for tr in trainers}
    more = lambda tr: dict(ns_total=tr.ns_total, ns_count=tr.ns_count, ns_measured=measured[tr.config])  # noqa: E731
    return {tr.config: tr.result(*pool[0], **more(tr), **tr.comm_result()) for tr in trainers}


# ---------------------------------------------------------------- summary


def _mean_mb(per_rank: list[list[dict]], where: str = "", kind: str = "") -> float:
    """Median over steps of the mean over ranks of the bytes sent `where` (of the `kind`), in MB."""
    sent = lambda d: sum(v for k, v in d.items() if k.startswith(where) and k.endswith(kind))  # noqa: E731
    per_step = [statistics.mean(sent(d) for d in col) for col in zip(*per_rank)]
    return statistics.median(per_step) / 2**20 if per_step else 0.0


def _row(config: str, res: list[dict]) -> dict:
    """One configuration's row from every rank's results (on CUDA without exposed comm and measured
    FLOPs: the busiest rank's share then comes from ours' stats, `NS from`)."""
    sent, step_sent = [r["sent"] for r in res], [r["step_sent"] for r in res]
    stats = [r["stats"][-1] for r in res]
    total = res[0]["ns_total"] if config.endswith("Muon") else 0
    row = timed_row(config, res)
    row["exposed comm ms"] = ms(slowest([r["exposed_s"] for r in res]))
    row.update({f"MB {w}": _mean_mb(sent, w) for w in ("inside", "across", "mixed", "unknown")})
    row.update({f"step MB {w}": _mean_mb(step_sent, w) for w in ("inside", "across", "mixed")})
    row["step MB all-to-all"] = _mean_mb(step_sent, kind="all-to-all")
    kinds = {k: v / 2**20 for k, v in res[0]["sent"][-1].items()} if res[0]["sent"] else {}
    row.update({"MB by kind (rank 0, last step)": kinds, "NS total GF": total / 1e9})
    row["NS GF per rank (measured)"] = [(r["ns_measured"] or 0) / 1e9 for r in res]
    if config.startswith("ours"):
        row["stats MB"] = statistics.mean(s["bytes_sent"] for s in stats) / 2**20
        row["NS GF per rank (stats)"] = [s["ns_flops"] / 1e9 for s in stats]
        row["NS matrices per rank"] = [s["ns_matrices"] for s in stats]
    if config.endswith("Muon"):
        row["NS matrices"] = res[0]["ns_count"]
    measured = row["NS GF per rank (measured)"]
    if res[0]["device"] == "cuda":  # see the docstring
        del row["exposed comm ms"], row["NS GF per rank (measured)"]
        measured = row.get("NS GF per rank (stats)")
        if total and measured:
            row["NS from"] = "stats"
    if total and measured:
        row["NS max rank / total"] = max(measured) * 1e9 / total
        row["NS sum / total"] = sum(measured) * 1e9 / total
    return row


def summarize(timed: dict[str, list[dict]], world: int = WORLD) -> list[dict]:
    """Table rows, with ratios against the FSDP2 configuration of the same optimizer."""
    rows = {c: _row(c, res) for c, res in timed.items()}
    return against_peers(rows, lambda c: peer(c, world), ["train", "step"])


def main(argv: list[str] | None = None) -> dict:
    from benchmarks._hsdp_report import report

    args = parse(
        __doc__,
        argv,
        "tiny model, a few steps (a smoke test)",
        steps=dict(type=int, help="measured steps (default 8, --quick 2)"),
        warmup=2,
        configs=dict(nargs="+", default=CONFIGS, choices=CONFIGS),
        torchrun=(False, "a rank per torchrun process (see the docstring)"),
    )
    steps = args.steps or (2 if args.quick else 8)
    warmup = min(args.warmup, 1) if args.quick else args.warmup
    shape = QUICK if args.quick else MODEL
    t0 = time.perf_counter()
    world, ranks, where = _torchrun.ranks(args.torchrun, None, WORLD)  # under torchrun: one rank of its world
    if world % 2:
        sys.exit(f"hsdp.py --torchrun: 2 replicas need an even number of ranks, not {world}")
    configs = [named(c, world) for c in args.configs]
    timed = ranks(_run, world, shape, configs, warmup, steps, preload=PRELOAD)
    if _torchrun.quiet(args.torchrun):
        return {}
    rows = summarize({c: [rk[c] for rk in timed] for c in configs}, world)
    run = dict(world=world, meshes=meshes(world), steps=steps, warmup=warmup, shape=shape, quick=args.quick)
    run.update(threads=timed.threads, wall_s=time.perf_counter() - t0, **where)
    return report(rows, run)


if __name__ == "__main__":
    if not dist.is_available():
        sys.exit("torch.distributed is not available")
    main()
