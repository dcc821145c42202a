"""Distributed Muon: `vo.Muon` against DDP, FSDP2 and ZeRO with `torch.optim.Muon`, and the
owner assignment on real model shapes.

Part (a) - optimizer step on a GPT-like model, 4 gloo ranks (`--world-size`)
----------------------------------------------------------------------------
Every configuration builds the same model (`benchmarks._gpt.build_gpt`, ~22 M parameters by
default: the 24 hidden matrices of the blocks go through Muon, embeddings / head / norms / biases
through AdamW, split by `vo.muon_param_groups`), runs ONE forward/backward on per-rank batches
(so every configuration holds the same averaged gradient), and then times `--warmup` +
`--steps` optimizer steps, all from that same gradient. All configurations live in the same
4 processes and are stepped in turn, round by round, so load from other processes on the
machine falls on all of them alike (single runs on a shared box vary by 1.5x).

* `ours`        - `vo.Muon(muon_param_groups(model))`, no wrapper. `opt.step()` = gradient
                  reduce-scatter + momentum on the local slice + bf16 gather of each matrix to
                  its owner (one all_to_all) + batched Newton-Schulz + scatter back + update +
                  parameter all-gather. Before each step the gradient buffer is restored (the
                  reduce-scatter overwrites it), outside the timed region.
* `DDP`         - `DistributedDataParallel` + `torch.optim.Muon` (hidden) + `torch.optim.AdamW`
                  (aux). Every rank orthogonalizes every matrix. The gradient all-reduce ran in
                  backward and is NOT in the timed step.
* `FSDP2`       - `fully_shard` per block and on the root + `torch.optim.Muon` / `AdamW` on the
                  DTensor shards. torch.optim.Muon runs on `Shard(0)` DTensors: sharding
                  propagation row-splits every Newton-Schulz matmul across ranks and all-gathers
                  the operands each iteration (the math is the full-matrix one); the
                  reduce-scatter ran in backward.
* `ZeRO`        - DDP + `ZeroRedundancyOptimizer(hidden, optimizer_class=torch.optim.Muon)` and
                  `ZeroRedundancyOptimizer(aux, optimizer_class=torch.optim.AdamW)`: each rank
                  steps the whole parameters of its partition (balanced by numel), then
                  broadcasts them. All-reduce in backward, not timed.

Timing: each step starts after a barrier; a step's time is the slowest rank's; the table shows
the median over the measured steps, in wall time and in process CPU time. Ours is broken down
by wrapping its internals (private API, looked up by name): RS (`reduce_gradients`), momentum,
gather/scatter all_to_all (launch + wait), NS (`_orthogonalize`), AdamW, AG (`_gather_params`)
and the rest (Muon parameter update). DDP's and ZeRO's all-reduce happens in backward; it is
timed once per round as one `all_reduce` of every gradient (`AR in bwd ms`) and shown beside.

The hidden size is small on purpose: the Newton-Schulz iteration runs in bf16 (as torch's), and
bf16 matmuls on CPUs without AVX512-BF16 run at ~2-3 GFLOP/s per core (fp32: ~25), so DDP's
replicated NS (12 GFLOP per rank per step at d=192) already takes ~10-20 s a step on 2 cores.

Correctness: the parameters after the first step (same init, same gradient) are compared with
DDP + torch.optim.Muon: max |diff| over the Muon and over the AdamW parameters, and as a
fraction of the largest single-element change DDP's step made (bf16 rounding of a slightly
differently reduced gradient moves a few elements by an ulp of the update; 5% passes). Also
checked: every matrix orthogonalized once (`opt.orthogonalized` summed over ranks), and part
(b)'s construction below reproduces the optimizer's own layouts, costs and owners.

Work and traffic per rank and step: Newton-Schulz FLOPs (`owners.ns_flops`) - ours from the
plans' costs and owners (checked against `opt.orthogonalized`), DDP all of them on every rank,
ZeRO its partition, FSDP2 1/W of every matmul. Bytes sent per rank for ours from buffer sizes
with ring collectives: reduce-scatter and all-gather `(W-1)*S` elements each (fp32) per bucket,
plus the plans' `gather.bytes_sent` / `scatter.bytes_sent` in bf16; DDP's ring all-reduce
`2*(W-1)/W*N` fp32 elements (in backward); ZeRO the same plus broadcasting its partition to the
W-1 others; FSDP2 all-gather in forward and backward plus reduce-scatter
(`3*(W-1)/W*N`), plus the step's DTensor collectives (counted with `CommDebugMode`).

Part (b) - owner assignment on real shapes (no processes)
---------------------------------------------------------
For Llama-3-8B/70B, DeepSeek-V3 (experts as separate matrices) and GPT-OSS-120B (fused 3-D
experts, each expert slice a matrix), W in {8, 64, 256}: each transformer block's hidden
matrices are one bucket planned with `plan_layout` in row units (align 16, as the optimizer),
each matrix's home is the single rank holding it (if any), owners come from
`assign_owners(costs, W, homes)` (and pure LPT: `homes=None`), exactly as `_MuonPlan` does.
Reported: the worst single bucket, the per-rank total over all buckets when each bucket is
assigned independently (what the step costs), the same with the per-rank load carried from
bucket to bucket (`assign_owners(..., load=)` if the library has it, else a local copy), one
global assignment of all buckets' matrices (homes from their own bucket layouts), and the whole
model planned and assigned as one bucket. The same per-bucket numbers are also given for
vo.Muon's default bucketing (`bucket_cap_numel` = 64 Mi elements, model order).

    python benchmarks/muon.py              # both parts (~5-6 min on 2 busy CPU cores)
    python benchmarks/muon.py --quick      # tiny model, small part (b)
    python benchmarks/muon.py --part b     # owner assignment only
"""

from __future__ import annotations

import argparse
import inspect
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks._gpt import build_gpt, launch, random_batch, threads_per_rank  # noqa: E402
from benchmarks._report import environment, save_json, table  # noqa: E402
from benchmarks.model_shapes import MODELS, is_vector  # noqa: E402

CONFIGS = ["ours", "DDP", "FSDP2", "ZeRO"]
LABEL = {
    "ours": "ours (vo.Muon)",
    "DDP": "DDP + torch Muon",
    "FSDP2": "FSDP2 + torch Muon",
    "ZeRO": "ZeRO + torch Muon",
}
STEP_CONTAINS = {
    "ours": "RS + momentum + gather + NS (own matrices) + scatter + update + AdamW + AG",
    "DDP": "momentum + NS (all matrices) + update + AdamW (AR in bwd)",
    "FSDP2": "Muon on DTensor shards: row-split NS with all-gathers + AdamW (RS in bwd)",
    "ZeRO": "NS (own partition) + AdamW (own partition) + param broadcasts (AR in bwd)",
}
# ~22 M parameters: 19.3 M in embeddings and head (AdamW), 2.7 M in 24 hidden matrices (Muon).
# bf16 matmuls run at ~3 GFLOP/s per core on CPUs without AVX512-BF16, so the hidden size is
# what keeps the replicated Newton-Schulz (12 GFLOP per rank and step here) within minutes.
FULL = dict(vocab=50304, d_model=192, n_layers=6, n_heads=6, seq_len=128, batch=2, seq=64)
QUICK = dict(vocab=2048, d_model=64, n_layers=2, n_heads=4, seq_len=32, batch=2, seq=32)
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5)
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
PRELOAD = [
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.optim",
    "torch.nn.parallel",
    "torch.distributed.tensor",
    "vescale_optim",
    "benchmarks.muon",
]
OURS_PARTS = ["RS", "momentum", "gather/scatter", "NS", "AdamW", "AG"]
MODEL_WORLDS = (8, 64, 256)


# ====================================================================== part (a)


class _Timer:
    """Adds up the wall time and this thread's CPU time spent inside wrapped callables."""

    def __init__(self):
        self.seconds = 0.0
        self.cpu = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.cpu += time.thread_time() - c0

        return timed

    def take(self) -> tuple[float, float]:
        s, self.seconds, c, self.cpu = self.seconds, 0.0, self.cpu, 0.0
        return s, c


def _split(model: torch.nn.Module):
    """The Muon (hidden) and AdamW (aux) parameters, as `vo.muon_param_groups` splits them."""
    import vescale_optim as vo

    groups = vo.muon_param_groups(model, lr=MUON["lr"])
    return list(groups[0]["params"]), list(groups[1]["params"])


def _ns_total(params) -> int:
    from vescale_optim.optim.owners import ns_flops

    return sum(ns_flops(p.shape[0], math.prod(p.shape[1:]), MUON["ns_steps"]) for p in params)


def _torch_muon(params):
    return dict(
        lr=MUON["lr"], weight_decay=MUON["weight_decay"], momentum=MUON["momentum"],
        nesterov=MUON["nesterov"], ns_steps=MUON["ns_steps"],
    )  # fmt: skip


def _setup_ours(model, rank, world):
    import vescale_optim as vo
    import vescale_optim.optim.muon as muon_mod

    groups = vo.muon_param_groups(
        model, lr=MUON["lr"], weight_decay=MUON["weight_decay"], momentum=MUON["momentum"],
        nesterov=MUON["nesterov"], ns_steps=MUON["ns_steps"], adamw_lr=ADAMW["lr"],
        adamw_betas=ADAMW["betas"], adamw_weight_decay=ADAMW["weight_decay"],
    )  # fmt: skip
    opt = vo.Muon(groups)
    timers = {k: _Timer() for k in OURS_PARTS}
    # Private hooks, looked up by name: a part whose hook moved is left out (it shows in "other").
    for part, owner, names in (
        ("RS", opt, ["reduce_gradients"]),
        ("AG", opt, ["_gather_params"]),
        ("NS", opt, ["_orthogonalize"]),
        ("momentum", opt, ["_momentum"]),
        ("AdamW", muon_mod, ["adamw_bucket_step", "adamw_update_"]),
    ):
        name = next((n for n in names if hasattr(owner, n)), None)
        if name is None:
            del timers[part]
        else:
            setattr(owner, name, timers[part].wrap(getattr(owner, name)))
    a2a = timers["gather/scatter"]
    plain_run_plan = muon_mod.run_plan

    def run_plan(*args, **kwargs):
        handle = a2a.wrap(plain_run_plan)(*args, **kwargs)
        handle.wait = a2a.wrap(handle.wait)
        return handle

    muon_mod.run_plan = run_plan

    def forward_backward(x, y):
        model.loss(x, y).backward()

    grads: list[torch.Tensor] = []

    def after_backward():
        grads.extend(p.grad.detach().clone() for g in groups for p in g["params"])

    def before_step():
        # The reduce-scatter writes the averaged gradient over this rank's slice; put the
        # unreduced one back so every step starts from the same gradient.
        for p, saved in zip((p for g in groups for p in g["params"]), grads):
            p.grad.copy_(saved)

    def stats():
        from vescale_optim.optim.owners import ns_flops  # noqa: F401  (cost model used by the plans)

        flops = [0.0] * world
        matrices = [0] * world
        sent = {"RS": 0, "AG": 0, "gather": 0, "scatter": 0}
        numel = {"padded": 0}
        for k, b in enumerate(opt._buckets):
            s = b.layout.shard_size
            el = b.pbuf.data.element_size()
            sent["RS"] += (world - 1) * s * el
            sent["AG"] += (world - 1) * s * el
            numel["padded"] += world * s
            plan = opt._plans.get(k)
            if plan is None:
                continue
            for c, o in zip(plan.costs, plan.owners):
                flops[o] += c
                matrices[o] += 1
            sent["gather"] += plan.gather.bytes_sent(rank, 2)
            sent["scatter"] += plan.scatter.bytes_sent(rank, 2)
        return {
            "ns_flops_by_rank": flops,
            "matrices_by_rank": matrices,
            "orthogonalized": opt.orthogonalized,
            "bytes_sent": sent,
            "buckets": len(opt._buckets),
            "muon_buckets": len(opt._plans),
            "owners": {k: list(p.owners) for k, p in opt._plans.items()},
            "in_place": sum(len(p.in_place) for p in opt._plans.values()),
            "matrices": sum(len(p.matrices) for p in opt._plans.values()),
            "shard_sizes": [b.layout.shard_size for k, b in enumerate(opt._buckets) if k in opt._plans],
            "part_b_construction_matches": _matches_plans(opt, world),
        }  # fmt: skip

    def step():
        opt.step()

    return dict(
        forward_backward=forward_backward, after_backward=after_backward, before_step=before_step,
        step=step, stats=stats, timers=timers, full_params=lambda: _named(model),
    )  # fmt: skip


def _matches_plans(opt, world: int) -> bool:
    """Does part (b)'s construction (`_plan_bucket` + `assign_owners`, load carried from bucket
    to bucket when the library carries it) give the optimizer's own layouts and owners?"""
    from vescale_optim.optim.owners import assign_owners

    load = [0.0] * world
    for k, plan in opt._plans.items():
        b = opt._buckets[k]
        costs, homes, layout = _plan_bucket([tuple(p.shape) for p in b.params], world, b.group["ns_steps"])
        owners = (
            assign_owners(costs, world, homes, load=load)
            if _has_load()
            else assign_owners(costs, world, homes)
        )
        if layout.offsets != b.layout.offsets or layout.shard_size != b.layout.shard_size:
            return False
        if list(owners) != list(plan.owners) or list(costs) != list(plan.costs):
            return False
    return True


def _named(model) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[n.removeprefix("module.")] = t.clone()
    return out


def _loss(module, x, y):
    logits = module(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _setup_peer(config, model, rank, world):
    hidden, aux = _split(model)
    names = {id(p): n for n, p in model.named_parameters()}
    hidden_names = [names[id(p)] for p in hidden]
    timers = {"Muon": _Timer(), "AdamW": _Timer()}
    extra: dict = {}
    if config == "FSDP2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        # fully_shard replaced the parameters by DTensors: look them up again by name.
        params = dict(model.named_parameters())
        hidden = [params[n] for n in hidden_names]
        hidden_ids = {id(p) for p in hidden}
        aux = [p for p in model.parameters() if id(p) not in hidden_ids]
        muon = torch.optim.Muon(hidden, **_torch_muon(hidden))
        adamw = torch.optim.AdamW(aux, foreach=True, **ADAMW)
        module = model
        extra["placements"] = sorted({str(p.placements) for p in hidden})
        parts = [muon, adamw]
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        module = DDP(model)
        if config == "DDP":
            muon = torch.optim.Muon(hidden, **_torch_muon(hidden))
            adamw = torch.optim.AdamW(aux, foreach=True, **ADAMW)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer as ZeRO

            muon = ZeRO(hidden, optimizer_class=torch.optim.Muon, **_torch_muon(hidden))
            adamw = ZeRO(aux, optimizer_class=torch.optim.AdamW, foreach=True, **ADAMW)
        parts = [muon, adamw]

    def forward_backward(x, y):
        _loss(module, x, y).backward()

    def step():
        timers["Muon"].wrap(muon.step)()
        timers["AdamW"].wrap(adamw.step)()

    def stats():
        total = _ns_total(hidden)
        out: dict = {"ns_flops_total": total}
        n = sum(p.numel() for p in model.parameters())
        if config == "DDP":
            out["ns_flops_by_rank"] = [float(total)] * world
            out["bytes_sent"] = {"all-reduce (bwd)": int(2 * (world - 1) / world * n * 4)}
        elif config == "ZeRO":
            flops, owned = [0.0] * world, [0] * world
            for opt, count in ((muon, True), (adamw, False)):
                for r, groups in enumerate(opt._partition_parameters()):
                    for g in groups:
                        for p in g["params"]:
                            owned[r] += p.numel()
                            if count:
                                flops[r] += _ns_total([p])
            out["ns_flops_by_rank"] = flops
            out["owned_numel_by_rank"] = owned
            out["bytes_sent"] = {
                "all-reduce (bwd)": int(2 * (world - 1) / world * n * 4),
                "broadcast": (world - 1) * owned[rank] * 4,
            }
        else:
            out["ns_flops_by_rank"] = [total / world] * world
            out["bytes_sent"] = {"AG fwd+bwd, RS bwd": int(3 * (world - 1) / world * n * 4)}
            out.update(extra)
        return out

    return dict(
        forward_backward=forward_backward, after_backward=lambda: None, before_step=lambda: None,
        step=step, stats=stats, timers=timers, full_params=lambda: _named(model), parts=parts,
    )  # fmt: skip


def _rank(rank: int, world: int, configs: list[str], shape: dict, warmup: int, steps: int) -> dict:
    """Every configuration on one rank, interleaved: round i steps each configuration once,
    so load from other processes on the machine falls on all of them alike."""
    out: dict[str, dict] = {}
    setups: dict[str, dict] = {}
    x, y = random_batch(shape["batch"], shape["seq"], shape["vocab"], seed=1000 + rank)
    for config in configs:
        model = build_gpt(
            shape["vocab"], shape["d_model"], shape["n_layers"], shape["n_heads"], shape["seq_len"], seed=0
        )
        hidden, _ = _split(model)
        o = out[config] = {
            "config": config, "rank": rank, "params": model.param_count, "threads": torch.get_num_threads(),
            "hidden_params": sum(p.numel() for p in hidden), "hidden_matrices": len(hidden), "times_s": [],
            "cpu_s": [],
        }  # fmt: skip
        try:
            if config == "ours":
                s = _setup_ours(model, rank, world)
            else:
                s = _setup_peer(config, model, rank, world)
            s["forward_backward"](x, y)
            s["after_backward"]()
            setups[config] = s
            o["parts_s"] = {k: [] for k in s["timers"]}
            o["parts_cpu_s"] = {k: [] for k in s["timers"]}
        except Exception as e:  # a peer that cannot run Muon is a result, not a crash
            o["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            o["traceback"] = traceback.format_exc()
    flat = torch.zeros(out[configs[0]]["params"])
    out.setdefault("DDP", {})["allreduce_s"] = []
    for i in range(warmup + steps):
        for config, s in list(setups.items()):
            o = out[config]
            try:
                s["before_step"]()
                for t in s["timers"].values():
                    t.take()
                comm = None
                if config == "FSDP2" and i == 0:
                    from torch.distributed.tensor.debug import CommDebugMode

                    comm = CommDebugMode()
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                if comm is not None:
                    with comm:
                        s["step"]()
                else:
                    s["step"]()
                o["times_s"].append(time.perf_counter() - t0)
                o["cpu_s"].append(time.process_time() - c0)
                for k, t in s["timers"].items():
                    wall, cpu = t.take()
                    o["parts_s"][k].append(wall)
                    o["parts_cpu_s"][k].append(cpu)
                if comm is not None:
                    o["step_collectives"] = {str(k): v for k, v in comm.get_comm_counts().items()}
                if i == 0:
                    full = s["full_params"]()
                    if rank == 0:
                        o["after_first_step"] = full
            except Exception as e:
                o["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                o["traceback"] = traceback.format_exc()
                del setups[config]
        # What DDP does in backward and its step leaves out: one all-reduce of every gradient.
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        out["DDP"]["allreduce_s"].append(time.perf_counter() - t0)
    for config, s in setups.items():
        o = out[config]
        o["times_s"] = o["times_s"][warmup:]
        o["cpu_s"] = o["cpu_s"][warmup:]
        o["parts_s"] = {k: v[warmup:] for k, v in o["parts_s"].items()}
        o["parts_cpu_s"] = {k: v[warmup:] for k, v in o["parts_cpu_s"].items()}
        o.update(s["stats"]())
    out["DDP"]["allreduce_s"] = out["DDP"]["allreduce_s"][warmup:]
    return out


def _median_of_max(per_rank: list[list[float]]) -> float:
    return statistics.median(max(col) for col in zip(*per_rank))


def _initial_params(shape: dict) -> dict[str, torch.Tensor]:
    model = build_gpt(
        shape["vocab"], shape["d_model"], shape["n_layers"], shape["n_heads"], shape["seq_len"], seed=0
    )
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def part_a(world: int, shape: dict, warmup: int, steps: int, configs: list[str]) -> dict:  # noqa: C901
    t0 = time.perf_counter()
    per_rank = launch(_rank, world, configs, shape, warmup, steps, preload=PRELOAD)
    print(f"# part (a): {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    results = {c: [r[c] for r in per_rank] for c in configs}
    allreduce = [r["DDP"]["allreduce_s"] for r in per_rank]
    first = next(iter(results.values()))[0]
    init = _initial_params(shape)
    hidden_names = {n for n, p in init.items() if p.ndim >= 2 and n.startswith("blocks.")}
    ref = results.get("DDP", [{}])[0].get("after_first_step")
    rows = []
    for config, res in results.items():
        r0 = res[0]
        row: dict = {"config": LABEL[config], "key": config, "opt.step() contains": STEP_CONTAINS[config]}
        failed = next((r for r in res if "error" in r), None)
        if failed is not None:
            row["error"] = f"rank {failed['rank']}: {failed['error']}"
            row["traceback"] = failed["traceback"]
            rows.append(row)
            continue
        row["step ms"] = 1e3 * _median_of_max([r["times_s"] for r in res])
        row["step CPU ms"] = 1e3 * _median_of_max([r["cpu_s"] for r in res])
        for k in r0["parts_cpu_s"]:
            row[f"{k} CPU ms"] = 1e3 * _median_of_max([r["parts_cpu_s"][k] for r in res])
        row["step + AR ms"] = row["step ms"]
        if config in ("DDP", "ZeRO"):
            row["AR in bwd ms"] = 1e3 * _median_of_max(allreduce)
            row["step + AR ms"] = row["step ms"] + row["AR in bwd ms"]
        # Breakdown: the slowest rank's parts in the median step (so the parts add up).
        slowest = [max(range(world), key=lambda q: res[q]["times_s"][i]) for i in range(len(r0["times_s"]))]
        order = sorted(range(len(slowest)), key=lambda i: res[slowest[i]]["times_s"][i])
        med = order[(len(order) - 1) // 2]
        who = res[slowest[med]]
        row["breakdown step ms"] = 1e3 * who["times_s"][med]
        row["breakdown rank"] = slowest[med]
        for k in r0["parts_s"]:
            row[f"{k} ms"] = 1e3 * who["parts_s"][k][med]
        row["other ms"] = row["breakdown step ms"] - sum(1e3 * v[med] for v in who["parts_s"].values())
        flops = r0["ns_flops_by_rank"]
        row["NS GFLOP max"] = max(flops) / 1e9
        row["NS GFLOP mean"] = statistics.mean(flops) / 1e9
        row["NS max/mean"] = max(flops) / statistics.mean(flops) if any(flops) else None
        sent = [sum(r["bytes_sent"].values()) for r in res]
        row["MB sent/rank max"] = max(sent) / 2**20
        row["bytes sent (rank 0)"] = {k: v / 2**20 for k, v in r0["bytes_sent"].items()}
        if config == "ours":
            row["matrices/rank"] = r0["matrices_by_rank"]
            row["orthogonalized/rank"] = [r["orthogonalized"] for r in res]
            row["matrices"] = r0["matrices"]
            row["in place (no gather)"] = r0["in_place"]
            row["part (b) construction == _MuonPlan"] = all(r["part_b_construction_matches"] for r in res)
            row["owners"] = r0["owners"]
        if "step_collectives" in r0:
            row["step collectives"] = r0["step_collectives"]
        if ref is not None:
            got = r0["after_first_step"]
            dm = max((got[n] - ref[n]).abs().max().item() for n in hidden_names)
            da = max((got[n] - ref[n]).abs().max().item() for n in ref if n not in hidden_names)
            upd = max((ref[n] - init[n]).abs().max().item() for n in hidden_names)
            row["max|Δ| Muon"] = dm
            row["max|Δ| AdamW"] = da
            row["Δ/update"] = dm / upd if upd else None
        rows.append(row)
    ddp = next((r for r in rows if r["config"] == LABEL["DDP"] and "step ms" in r), None)
    for r in rows:
        if ddp and "step ms" in r:
            r["speedup vs DDP"] = ddp["step ms"] / r["step ms"]
    ours = next((r for r in rows if r["config"] == LABEL["ours"] and "step ms" in r), None)
    for r in rows:
        if ours and "step ms" in r:
            r["ours faster x"] = r["step ms"] / ours["step ms"]
            r["ours faster x (+AR)"] = r["step + AR ms"] / ours["step ms"]
            r["ours faster x (CPU)"] = r["step CPU ms"] / ours["step CPU ms"]
            # Rounds share the ambient load, so the per-round ratio is the steadiest estimate.
            mine, theirs = (results[c] for c in ("ours", r["key"]))
            r["ours faster x (per round)"] = statistics.median(
                max(t) / max(o) for t, o in zip(zip(*(x["times_s"] for x in theirs)),
                                                zip(*(x["times_s"] for x in mine)))
            )  # fmt: skip
    for r in results.values():
        for x in r:
            x.pop("after_first_step", None)
    return {"rows": rows, "params": first["params"], "hidden_params": first["hidden_params"],
            "hidden_matrices": first["hidden_matrices"], "raw": results}  # fmt: skip


def print_a(a: dict, world: int, shape: dict, warmup: int, steps: int) -> dict:
    rows = a["rows"]
    print(
        f"\n## (a) Optimizer step, GPT-like model: {a['params'] / 1e6:.1f} M params "
        f"({a['hidden_params'] / 1e6:.2f} M in {a['hidden_matrices']} hidden matrices -> Muon, "
        "the rest -> AdamW), "
        f"world {world} (gloo), {threads_per_rank(world)} thread(s)/rank, vocab {shape['vocab']}, "
        f"d {shape['d_model']}, {shape['n_layers']} layers; {warmup} warm-up + {steps} measured steps from "
        f"the same gradient; median over steps of the slowest rank\n"
    )
    print(table(rows, ["config", "step ms", "ours faster x", "AR in bwd ms", "ours faster x (+AR)",
                       "ours faster x (per round)", "step CPU ms", "ours faster x (CPU)",
                       "NS GFLOP max", "NS GFLOP mean", "NS max/mean",
                       "MB sent/rank max", "max|Δ| Muon", "max|Δ| AdamW", "Δ/update", "error"]))  # fmt: skip
    print(
        "\n`step ms`: wall time. `AR in bwd ms`: one all-reduce of all gradients, the traffic DDP and ZeRO "
        "move in backward, outside their step. `per round`: median over rounds of the ratio "
        "within a round. `step CPU ms`: process CPU time of the step (gloo threads "
        "included), less sensitive to other load on the machine. `Δ/update`: max |Δ| over the Muon "
        "parameters after one step vs DDP + torch Muon, over the largest change that step made."
    )
    print()
    print(table(rows, ["config", "opt.step() contains"]))
    ours = next((r for r in rows if r["config"] == LABEL["ours"] and "step ms" in r), None)
    if ours:
        print(
            "\nWhere ours spends its step (ms; the slowest rank in the median step; 'other' = the Muon "
            "parameter update and Python glue):\n"
        )
        print(table([ours], ["breakdown step ms", "breakdown rank",
                             *(f"{k} ms" for k in OURS_PARTS if f"{k} ms" in ours), "other ms"]))  # fmt: skip
        print(
            "\nThe same parts in CPU time of the calling thread (ms; median over steps of the max over "
            "ranks; collectives run on gloo threads, so RS/AG/gather/scatter show little here):\n"
        )
        print(table([ours], ["step CPU ms", *(f"{k} CPU ms" for k in OURS_PARTS if f"{k} CPU ms" in ours)]))
        print(f"\nours: matrices per rank {ours['matrices/rank']}, orthogonalized per rank "
              f"{ours['orthogonalized/rank']} (of {ours['matrices']}), "
              f"{ours['in place (no gather)']} in place; "
              f"bytes sent by rank 0 (MB): "
              + ", ".join(f"{k} {v:.2f}" for k, v in ours["bytes sent (rank 0)"].items()))  # fmt: skip
    for r in rows:
        if r["config"] != LABEL["ours"] and "step ms" in r:
            sent = ", ".join(f"{k} {v:.2f}" for k, v in r["bytes sent (rank 0)"].items())
            coll = f"; collectives in one step: {r['step collectives']}" if "step collectives" in r else ""
            print(
                f"{r['config']}: Muon {r['Muon ms']:.1f} ms + AdamW {r['AdamW ms']:.1f} ms; "
                f"bytes sent by rank 0 (MB): {sent}{coll}"
            )
    goals = {}
    by = {r["config"]: r for r in rows}
    if ours:
        for peer, need in (("DDP", 2.5), ("FSDP2", 5.0)):
            r = by.get(LABEL[peer])
            if r is None:
                continue
            ok = "step ms" in r and r["step ms"] >= need * ours["step ms"]
            goals[f"step >= {need}x faster than {LABEL[peer]}"] = ok
        goals["each matrix orthogonalized once"] = sum(ours["orthogonalized/rank"]) == ours["matrices"]
        goals["part (b)'s owner construction reproduces the optimizer's plans"] = ours[
            "part (b) construction == _MuonPlan"
        ]
        if ours["matrices"] >= 4 * world:
            goals["NS max/mean <= 1.1 (>= 4 matrices per rank)"] = ours["NS max/mean"] <= 1.1
        if "max|Δ| Muon" in ours:
            goals["same parameters as DDP + torch Muon (Δ <= 5% of the update)"] = ours["Δ/update"] <= 0.05
    print("\nGoals (a):")
    for k, v in goals.items():
        print(f"  {'met    ' if v else 'NOT met'}  {k}")
    for r in rows:
        if "error" in r:
            print(f"\n{r['config']} failed:\n{r['traceback']}")
    return goals


# ====================================================================== part (b)


def _has_load() -> bool:
    from vescale_optim.optim.owners import assign_owners

    return "load" in inspect.signature(assign_owners).parameters


def _assign_carried(costs, world, homes, load, slack=0.05):
    """`assign_owners` with the per-rank load carried in from earlier buckets (a local copy of
    the library's algorithm, used only when its `assign_owners` has no `load=`)."""
    homes = list(homes) if homes is not None else [None] * len(costs)
    target = (1 + slack) * (sum(costs) + sum(load)) / world
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        home = homes[i]
        if home is not None and load[home] + costs[i] <= target:
            rank = home
        else:
            rank = min(range(world), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += costs[i]
    return owners


def _hidden(block) -> list[tuple[int, ...]]:
    """A block's hidden matrices: the `model_shapes.matrices(hidden_only=True)` filter."""
    return [
        shape for name, shape in block
        if len(shape) >= 2 and not is_vector(name, shape) and "embed_tokens" not in name
        and not name.startswith("lm_head")
    ]  # fmt: skip


def _buckets(model: str, bucketing: str) -> list[list[tuple[int, ...]]]:
    """Hidden-matrix buckets: one per transformer block, or as `vo.Muon` groups them by
    default (model order, closed at `bucket_cap_numel` = 64 Mi elements)."""
    blocks = [b for b in (_hidden(block) for block in MODELS[model]()) if b]
    if bucketing == "block":
        return blocks
    from vescale_optim.shard import bucket_indices

    shapes = [s for b in blocks for s in b]
    idx = bucket_indices([math.prod(s) for s in shapes], [None] * len(shapes), 64 * 1024 * 1024)
    return [[shapes[i] for i in b] for b in idx]


def _plan_bucket(shapes, world: int, ns_steps: int = 5):
    """(costs, homes, layout) of a bucket's matrices, built as `_MuonPlan` builds them: row
    units, align 16; a matrix's home is the one rank holding all of it, if any."""
    from vescale_optim.optim.muon import matrix_view
    from vescale_optim.optim.owners import ns_flops
    from vescale_optim.shard import plan_layout

    sizes = [math.prod(s) for s in shapes]
    layout = plan_layout(sizes, [s[-1] for s in shapes], world, 16)
    shard = layout.shard_size
    costs, homes = [], []
    for i, s in enumerate(shapes):
        count, rows, cols = matrix_view(tuple(s))
        c = ns_flops(rows, cols, ns_steps)
        for k in range(count):
            start = layout.offsets[i] + k * rows * cols
            first, last = start // shard, (start + rows * cols - 1) // shard
            costs.append(c)
            homes.append(first if first == last else None)
    return costs, homes, layout


def _imb(load) -> float:
    mean = sum(load) / len(load)
    return max(load) / mean if mean else 1.0


def _loads(costs, owners, world) -> list[float]:
    load = [0.0] * world
    for c, o in zip(costs, owners):
        load[o] += c
    return load


def _kept(homes, owners) -> float:
    return 100.0 * sum(h == o for h, o in zip(homes, owners)) / max(1, len(homes))


def assign_buckets(model: str, world: int, bucketing: str) -> dict:
    """Owners bucket by bucket - independently (as `_MuonPlan` did), with the load carried
    across buckets, and globally (all buckets' matrices in one `assign_owners` call, homes
    from the buckets' own layouts) - and the per-rank totals over the step."""
    from vescale_optim.optim.owners import assign_owners

    t0 = time.perf_counter()
    planned = [_plan_bucket(shapes, world) for shapes in _buckets(model, bucketing)]
    t_plan = time.perf_counter() - t0
    costs = [c for b in planned for c in b[0]]
    homes = [h for b in planned for h in b[1]]
    n = len(costs)
    has_load = _has_load()
    res: dict = {"model": model, "W": world, "bucketing": bucketing, "matrices": n, "buckets": len(planned),
                 "per rank": n / world, "per rank per bucket": n / len(planned) / world, "plan s": t_plan,
                 "homeless %": 100.0 * sum(h is None for h in homes) / n}  # fmt: skip
    t0 = time.perf_counter()
    for mode, use_homes in (("homes", True), ("LPT", False)):
        if bucketing != "block" and not use_homes:
            continue
        owners, worst = [], 1.0
        for c, h, _ in planned:
            o = assign_owners(c, world, h if use_homes else None)
            owners += o
            worst = max(worst, _imb(_loads(c, o, world)))
        res[f"bucket worst {mode}"] = worst
        res[f"independent {mode}"] = _imb(_loads(costs, owners, world))
        if use_homes:
            res["independent no gather %"] = _kept(homes, owners)
    res["independent s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    carried: list[float] = [0.0] * world
    owners = []
    for c, h, _ in planned:
        if has_load:
            owners += assign_owners(c, world, h, load=carried)
        else:
            owners += _assign_carried(c, world, h, carried)
    res["carried homes"] = _imb(carried)
    res["carried no gather %"] = _kept(homes, owners)
    res["carried s"] = time.perf_counter() - t0
    res["carried via"] = "assign_owners(load=)" if has_load else "local copy of assign_owners + load"
    t0 = time.perf_counter()
    owners = assign_owners(costs, world, homes)
    res["global s"] = time.perf_counter() - t0
    res["global homes"] = _imb(_loads(costs, owners, world))
    res["global no gather %"] = _kept(homes, owners)
    if bucketing == "block":
        res["global LPT"] = _imb(_loads(costs, assign_owners(costs, world, None), world))
    return res


def assign_whole(model: str, world: int) -> dict:
    """All hidden matrices of the model planned and assigned as one bucket."""
    from vescale_optim.optim.owners import assign_owners

    shapes = [s for b in _buckets(model, "block") for s in b]
    t0 = time.perf_counter()
    costs, homes, layout = _plan_bucket(shapes, world)
    t_plan = time.perf_counter() - t0
    t0 = time.perf_counter()
    owners = assign_owners(costs, world, homes)
    t_assign = time.perf_counter() - t0
    return {
        "model": model, "W": world, "matrices": len(costs), "per rank": len(costs) / world,
        "max/mean homes": _imb(_loads(costs, owners, world)),
        "max/mean LPT": _imb(_loads(costs, assign_owners(costs, world, None), world)),
        "no gather %": _kept(homes, owners), "homeless %": 100.0 * sum(h is None for h in homes) / len(homes),
        "padding %": 100.0 * layout.padding / max(1, layout.numel), "plan s": t_plan, "assign s": t_assign,
    }  # fmt: skip


def part_b(models: list[str], worlds: tuple[int, ...]) -> dict:
    per_bucket, whole = [], []
    for model in models:
        for w in worlds:
            t0 = time.perf_counter()
            for bucketing in ("block", "cap 64Mi"):
                per_bucket.append(assign_buckets(model, w, bucketing))
            whole.append(assign_whole(model, w))
            print(f"# part (b) {model} W={w}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return {"per_bucket": per_bucket, "whole": whole}


def print_b(b: dict) -> dict:
    rows, whole = b["per_bucket"], b["whole"]
    print("\n## (b) Owner assignment on real shapes: per-rank Newton-Schulz FLOPs, max/mean\n")
    print("Bucket by bucket, as `_MuonPlan` assigns: `block` = each transformer block one bucket; "
          "`cap 64Mi` = vo.Muon's default bucketing. `bucket worst` = the worst single bucket; "
          "`independent` = per-rank total over all buckets, each bucket assigned alone (the step's "
          "real work); `carried` = the per-rank load passed from bucket to bucket "
          f"({rows[0]['carried via'] if rows else ''}); `global` = all buckets' matrices in ONE "
          "assign_owners call, homes from the buckets' own layouts.\n")  # fmt: skip
    print(table(rows, ["model", "W", "bucketing", "matrices", "buckets", "per rank", "per rank per bucket",
                       "bucket worst homes", "bucket worst LPT", "independent homes", "independent LPT",
                       "carried homes", "global homes", "global LPT"]))  # fmt: skip
    print("\nNo-gather share (home == owner) and time (s):\n")
    print(table(rows, ["model", "W", "bucketing", "homeless %", "independent no gather %",
                       "carried no gather %", "global no gather %", "plan s", "independent s", "carried s",
                       "global s"]))  # fmt: skip
    print("\nWhole model as one bucket (one layout, one assignment):\n")
    print(table(whole, ["model", "W", "matrices", "per rank", "max/mean homes", "max/mean LPT", "no gather %",
                        "homeless %", "padding %", "plan s", "assign s"]))  # fmt: skip
    goals = {}
    for r in rows:
        if r["per rank"] >= 4 and r["bucketing"] == "block":
            key = f"{r['model']} W={r['W']}"
            for what, col in (("buckets assigned independently", "independent homes"),
                              ("load carried across buckets", "carried homes"),
                              ("one global assignment", "global homes")):  # fmt: skip
                goals[f"{key}: step total <= 1.10, {what}"] = r[col] <= 1.10
    for r in whole:
        if r["per rank"] >= 4:
            goals[f"{r['model']} W={r['W']}: whole model as one bucket <= 1.10"] = r["max/mean homes"] <= 1.10
    print("\nGoals (b), where matrices per rank >= 4:")
    for k, v in goals.items():
        print(f"  {'met    ' if v else 'NOT met'}  {k}")
    return goals


# ====================================================================== main


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5, help="measured steps (median over these)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="tiny model, fewer steps, small part (b)")
    ap.add_argument("--part", choices=["a", "b", "ab"], default="ab")
    ap.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = ap.parse_args(argv)
    shape = dict(QUICK if args.quick else FULL)
    if args.quick:
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
    t_start = time.perf_counter()
    payload: dict = {"env": environment(), "world_size": args.world_size, "shape": shape, "muon": MUON,
                     "adamw": ADAMW, "warmup": args.warmup, "steps": args.steps, "goals": {}}  # fmt: skip
    if args.quick:
        print("--quick: a smoke run on a tiny model; its ratios say nothing about the goals")
    if "a" in args.part:
        a = part_a(args.world_size, shape, args.warmup, args.steps, args.configs)
        payload["goals"].update(print_a(a, args.world_size, shape, args.warmup, args.steps))
        payload["a"] = a
    if "b" in args.part:
        models = ["llama3-8b", "gpt-oss-120b"] if args.quick else args.models
        worlds = (8, 64) if args.quick else MODEL_WORLDS
        b = part_b(models, worlds)
        payload["goals"].update(print_b(b))
        payload["b"] = b
    path = save_json("muon_quick" if args.quick else "muon", payload)
    print(f"total {time.perf_counter() - t_start:.0f} s; wrote {path}", file=sys.stderr)
    return payload


if __name__ == "__main__":
    main()
