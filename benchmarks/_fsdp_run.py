"""The ranks' side of `benchmarks/fsdp.py`: a trainer per configuration, every configuration of a run
interleaved in one world with a profiled step each after them, and the memory runs (each
configuration's live tensor bytes and peak RSS; on CUDA the allocator's peak).

A configuration is `WHO [HOW ...] FAMILY`: `WHO` ours (`vo.AdamW` / `vo.Muon`) or a peer set-up of
`benchmarks._optim.peer` (FSDP2, ZeRO, DDP); `HOW` `Z3` (a unit per block and the root), `Z2` (no
units), `no-bwd-prefetch`, a mesh `RxS` (replicate x shard), `reshard=False` (FSDP2's), a Muon
variant (`polar_express`, `normuon`), `compiled` (`block.compile()` per block, the run's backend).
A run whose shape has `tp` trains `TPBlock`s under torch's TP plan instead (`_tp_optimizer`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

import vescale_optim as vo
from benchmarks import _train
from benchmarks._comm import CommMeter
from benchmarks._copies import copies_by_path
from benchmarks._gpt import shaped_gpt
from benchmarks._live import live_steps
from benchmarks._measure import live_malloc, matmul_flops, reset_peak, status_kb, window_seconds
from benchmarks._muon_plan import assignment, default_buckets
from benchmarks._optim import (
    MUON,
    FullTensorMuon,
    Steps,
    fully_shard_gpt,
    muon_groups,
    ours,
    peer,
    state_bytes,
)
from benchmarks._train import PHASES, batches, device, interleave

VARIANTS = {"polar_express": {"ns_coefficients": "polar_express"}, "normuon": {"normuon": True}}
# a profiled step's columns: the profiler windows (name prefixes) each adds up, ours' and the peers'
WINDOWS = {
    "RS": ["vescale_optim.sync_grads", "FSDP::post_backward_reduce"],
    "update": ["vescale_optim.update"],
}
WINDOWS.update(AG=["vescale_optim.gather_params", "FSDP::all_gather"], NS=["vescale_optim.newton_schulz"])
WINDOWS.update(moves=["vescale_optim.moves"], Muon=["bench::Muon"], AdamW=["bench::AdamW"])
# innermost frames of ours that are the optimizers' math, not communication (kernels/packed.py,
# the 8-bit wire format, is communication)
MATH_CODE = ("optim/", "kernels/newton_schulz.py", "kernels/quant.py")
COLLECTIVE_CODE = ("vescale::", "vescale_optim.sync_grads", "vescale_optim.gather_params", "FSDP::", "fsdp::")
COLLECTIVE_CODE += ("vescale_optim/shard/collectives.py", "vescale_optim/units/", "torch/distributed/fsdp/")
COLLECTIVE_CODE += tuple(f"torch/distributed/{m}" for m in ("tensor/_redistribute", "tensor/placement_types"))
COLLECTIVE_CODE += ("torch/distributed/tensor/_collective_utils", "torch/distributed/_functional_collectives")
TP_PLAN = {**{n: ColwiseParallel() for n in ("wq", "wk", "wv", "w1", "w3")}, "wo": RowwiseParallel()}
TP_PLAN["w2"] = RowwiseParallel()
TP_ADAMW, TP_MUON = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1), dict(lr=0.02, weight_decay=0.1)


class TPBlock(nn.Module):
    """A Llama-like block: attention wq/wk/wv/wo, RMSNorms and a SwiGLU MLP w1/w2/w3."""

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


def mesh_of(config: str) -> str | None:
    """The mesh word of a configuration (`2x2`), if any."""
    return next((w for w in config.split() if w[0].isdigit() and "x" in w), None)


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every whole parameter, copied (under FSDP2 a collective), named as in the bare model."""
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in model.named_parameters()}
    return {n.removeprefix("module."): p.detach().clone() for n, p in full.items()}


class Trainer(_train.Trainer):
    """One configuration (see the module's docstring) on its mesh, with ours' `step_stats` after each
    recorded step and, with `keep_first`, its parameters after the first step."""

    def __init__(self, config: str, shape: dict, meter=None, meshes=None, keep_first=False, backend=None):
        self.meshes, self.keep_first, self.first, self.backend = meshes or {}, keep_first, None, backend
        self.tp = "tp" in shape
        self.stats: list[dict] = []
        mesh = self.meshes.get(mesh_of(config))
        self.replica_of = (
            None if mesh is None else {r: i for i, row in enumerate(mesh.mesh.tolist()) for r in row}
        )
        super().__init__(config, shape, meter)

    def build(self, shape: dict) -> torch.nn.Module:
        """A GPT, or a TP model: `layers` `TPBlock`s under torch's TP plan on the dp x tp mesh's tp and
        a final norm (which gives the root unit parameters of its own, as a GPT's head does)."""
        if not self.tp:
            return super().build(shape)
        torch.manual_seed(0)
        self.blocks = [TPBlock(shape["dim"], shape["head"]) for _ in range(shape["layers"])]
        for block in self.blocks:
            parallelize_module(block, self.meshes["dp x tp"]["tp"], TP_PLAN)
        return nn.Sequential(*self.blocks, nn.RMSNorm(shape["dim"]))

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.model(x), y) if self.tp else super().loss(x, y)

    def optimizer(self, model: torch.nn.Module):
        opt = self._tp_optimizer(model) if self.tp else self._optimizer(model)
        if "compiled" in self.config.split():  # once ours' units or FSDP2 hold the blocks: their hooks
            for block in model.blocks:  # run eagerly between the graphs (FSDP2's are dynamo-disabled)
                block.compile(backend=self.backend)
        return opt

    def _optimizer(self, model: torch.nn.Module):
        words, family = self.config.split(), self.config.split()[-1]
        mesh = self.meshes.get(mesh_of(self.config))
        if "full_tensor" in words:  # torchtitan's Muon over FSDP2: whole matrices on every rank
            return FullTensorMuon(fully_shard_gpt(model))
        if words[:2] == ["ours", "DDP"]:  # inside torch's wrappers: DDP averages, FSDP2 holds the shards
            self.module = DDP(model)
        elif words[:2] == ["ours", "FSDP2"]:
            fully_shard_gpt(model)
        if words[0] != "ours":
            self.module, opt = peer(
                model, words[0], family, mesh=mesh, reshard_after_forward="reshard=False" not in words
            )
            return opt
        kw = {"mesh": mesh} if mesh is not None else {}
        for variant in set(words) & set(VARIANTS):
            kw.update(VARIANTS[variant])
        if not {"Z2", "DDP", "FSDP2"} & set(words):
            kw["shard_modules"] = [*model.blocks, model]
        if "no-bwd-prefetch" in words:
            kw["backward_prefetch"] = False
        return ours(model, family, **kw)

    def _tp_optimizer(self, model: nn.Module):
        units, dp = [*self.blocks, model], self.meshes["dp x tp"]["dp"]
        cut = [p for p in model.parameters() if isinstance(p, DTensor)]
        norms = [p for p in model.parameters() if not isinstance(p, DTensor)]
        if self.config == "TP alone AdamW":  # each dp rank steps its own gradient: no data parallelism;
            # torch's foreach AdamW takes DTensors and plain tensors in separate optimizers
            return Steps(*(torch.optim.AdamW(ps, foreach=True, **TP_ADAMW) for ps in (cut, norms)))
        if self.config == "ours AdamW":
            return vo.AdamW(model.parameters(), mesh=dp, shard_modules=units, **TP_ADAMW)
        if self.config == "ours Muon":
            groups = [{"params": cut}, {"params": norms, "use_muon": False, **TP_ADAMW}]
            return vo.Muon(groups, mesh=dp, shard_modules=units, **TP_MUON)
        fully_shard_gpt(model, dp, blocks=self.blocks)  # FSDP2 2-D
        if self.config == "FSDP2 AdamW":
            return torch.optim.AdamW(model.parameters(), foreach=True, **TP_ADAMW)
        cut, norms = ([p for p in model.parameters() if (p.ndim == 2) == matrix] for matrix in (True, False))
        return FullTensorMuon(hidden=cut, rest=norms, muon=TP_MUON, adamw=TP_ADAMW)

    def step(self, x, y, record: bool = True, around=None) -> None:
        if self.meter is not None:
            self.meter.replica_of = self.replica_of
        super().step(x, y, record, around)
        if record and hasattr(self.opt, "step_stats"):  # ours
            self.stats.append(dict(self.opt.step_stats))
        if self.keep_first and self.first is None:  # every rank takes part; rank 0 keeps it
            full = full_params(self.model)
            self.first = full if dist.get_rank() == 0 else {}

    def comm_result(self) -> dict:
        """Per phase the seconds exposed in each recorded step; the calls and bytes of the last by
        kind; per recorded step the bytes sent by "where kind", over the step and inside opt.step()."""
        total = {"calls": Counter(), "sent": Counter()}
        for c in (self.comm[-1] if self.comm else {}).values():
            total["calls"].update(c["calls"])
            total["sent"].update(c["sent"])
        sent = [dict(sum((Counter(c["sent_by"]) for c in comm.values()), Counter())) for comm in self.comm]
        out = {"exposed_s": {k: [c[k]["exposed_s"] for c in self.comm] for k in PHASES}, "sent": sent}
        out["step_sent"] = [comm["step"]["sent_by"] for comm in self.comm]
        return {**out, "comm": {k: dict(v) for k, v in total.items()} if self.comm else {}}


def _profiled(tr: Trainer, x, y) -> dict:
    """One step under the profiler (CPU events; FLOPs on the CPU): the seconds inside each of
    `WINDOWS`, the units' stand-in work (`vescale::stand_ins[...]`, host time) and the FLOPs of the
    matrix products inside opt.step()."""
    cpu = device().type == "cpu"
    with profile(activities=[ProfilerActivity.CPU], with_flops=cpu) as prof:
        tr.step(x, y, record=False)
    seconds = {
        k: [s for s in (window_seconds(prof, w) for w in ws) if s is not None] for k, ws in WINDOWS.items()
    }
    stand_ins = sum(e.cpu_time_total for e in prof.events() if e.name.startswith("vescale::stand_ins["))
    out = {"windows_s": {k: sum(s) for k, s in seconds.items() if s}, "stand_ins_s": stand_ins / 1e6}
    return {**out, "ns_measured": matmul_flops(prof, within="bench::step") if cpu else None}


def _classify(event, context: list[str]) -> str:
    text = " | ".join(context)
    if "vescale::unshard[" in text:
        return "own slice"
    mine = [c.split("vescale_optim/", 1)[1] for c in context if "vescale_optim/" in c and ".py(" in c]
    if mine and mine[0].startswith(MATH_CODE):  # the optimizers' math, even where the runtime calls it
        return "compute"
    if any(m in text for m in COLLECTIVE_CODE):
        return "collective path"
    return "grad accum" if "AccumulateGrad" in text else "compute"


def _count_copies(rank: int, tr: Trainer, x, y) -> dict | None:
    """One step of `tr`, under the profiler on rank 0: its copies by path (CPU only: see fsdp.py)."""
    if rank != 0 or device().type == "cuda":
        tr.step(x, y, record=False)
        return None
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True)
    with prof, record_function("bench::train"):
        tr.step(x, y, record=False)
    return copies_by_path(prof, "bench::train", _classify)


def _construction(shape: dict, world: int) -> dict[str, bool]:
    """`benchmarks._muon_plan`'s construction on the GPT's hidden matrices against a `vo.Muon` of them
    alone (collective: every rank builds one): the same units, layouts and per-rank load."""
    import vescale_optim as vo

    hidden = muon_groups(shaped_gpt(shape))[0]["params"]
    opt = vo.Muon(hidden, **MUON)
    buckets = default_buckets([tuple(p.shape) for p in hidden])
    mine = assignment(buckets, world)
    units = [[tuple(p.shape) for p in u.params] for u in opt.units]
    layouts = [(u.layout.shard_size, tuple(u.layout.offsets)) for u in opt.units]
    return {
        "units": units == buckets,
        "layouts": mine["layouts"] == layouts,
        "ns_load": mine["load"] == list(opt.ns_load),
    }


def _meshes(world: int, configs: list[str], shapes: list[dict]) -> dict:
    """The meshes the configurations name (`RxS`: replicate x shard), and a dp x tp one for a TP model."""
    names = {m for m in map(mesh_of, configs) if m}
    made = {m: tuple(map(int, m.split("x"))) for m in names}
    made = {
        m: init_device_mesh(device().type, s, mesh_dim_names=("replicate", "shard")) for m, s in made.items()
    }
    tp = next((shape["tp"] for shape in shapes if "tp" in shape), None)
    if tp:
        made["dp x tp"] = init_device_mesh(device().type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return made


def pool_of(shape: dict, rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batches of a run: a GPT's (`_train.batches`), or a TP model's, the same on a dp rank's tp ranks."""
    if "tp" not in shape:
        return batches(shape, rank, world)
    g = torch.Generator().manual_seed(1 + rank // shape["tp"])
    size = (shape["batch"], shape["seq"], shape["dim"])
    return [(torch.randn(size, generator=g), torch.randn(size, generator=g)) for _ in range(2)]


def _first(run: dict, config: str) -> bool:
    """Whether a configuration keeps its parameters after the first step and the last (to hold them
    to DDP's or torch's): any but a Muon variant, in a run that asks for it (`first`)."""
    return run["first"] and not set(config.split()) & set(VARIANTS)


def time_all(rank: int, world: int, runs: list[dict], warmup: int, steps: int) -> dict:
    """Per run (`name`, `shape`, `configs`, `copies`, `first`): every configuration in this world,
    interleaved step by step, then a profiled step each (and with `copies` one counting them)."""
    meter = CommMeter().install()
    meshes = _meshes(world, [c for run in runs for c in run["configs"]], [run["shape"] for run in runs])
    out = {}
    for run in runs:
        shape, pool, backend = run["shape"], pool_of(run["shape"], rank, world), run.get("backend")
        if backend:
            fresh_compiler(run.get("cache"))
        trainers = [Trainer(c, shape, meter, meshes, _first(run, c), backend) for c in run["configs"]]
        interleave(trainers, pool, max(warmup, 2) if backend else warmup, 0)  # the first step compiles
        with torch.compiler.set_stance("fail_on_recompile") if backend else contextlib.nullcontext():
            interleave(trainers, pool, 0, steps)
        muon = [c for c in run["configs"] if c.startswith("ours") and c.endswith("Muon")]
        built = _construction(shape, world) if muon and "tp" not in shape else None
        out[run["name"]] = {}
        for tr in trainers:
            more = _profiled(tr, *pool[0])
            more["copies"] = _count_copies(rank, tr, *pool[0]) if run["copies"] else None
            more.update(state_bytes=state_bytes(tr.opt), stats=tr.stats, first=tr.first or None)
            if tr.keep_first:
                last = full_params(tr.model)  # every rank takes part; rank 0 keeps it
                more["last"] = last if rank == 0 else None
            if tr.config in muon:
                more.update(
                    ns_load=list(tr.opt.ns_load), orthogonalized=tr.opt.orthogonalized, construction=built
                )
            out[run["name"]][tr.config] = tr.result(*pool[0], **more, **tr.comm_result())
        del trainers
        gc.collect()
    return out


def fresh_compiler(folder: str | None) -> None:
    """Nothing compiled in this process, inductor's caches in `folder` (None: left as they are);
    inductor compiles in this process (`TORCHINDUCTOR_COMPILE_THREADS=1`, fsdp.py sets it)."""
    torch.compiler.reset()
    if folder is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder


def warm_compiler(rank: int, world: int, backend: str) -> None:
    """Compile and run a small function once, in an empty cache that is then dropped: the first
    compilation on a machine also reads the compiler, its headers and inductor's modules from
    disk, which would otherwise land on whichever configuration compiles first."""
    with tempfile.TemporaryDirectory(prefix=f"fsdp_bench_warm_r{rank}_") as folder:
        fresh_compiler(folder)
        fn = torch.compile(lambda a, b: torch.nn.functional.gelu(a @ b).sum(), backend=backend)
        fn(torch.randn(16, 16, requires_grad=True), torch.randn(16, 16)).backward()
        torch.compiler.reset()


def _first_steps(rank: int, world: int, shape: dict, config: str, backend: str, steps: int, meshes) -> dict:
    """A compiled run's first `1 + steps` train steps from an empty compiler cache: its first step's
    seconds (which compiles) and the later ones'."""
    with tempfile.TemporaryDirectory(prefix=f"fsdp_bench_r{rank}_") as folder:
        fresh_compiler(folder)
        pool, tr = batches(shape, rank, world), Trainer(config, shape, meshes=meshes, backend=backend)
        for s in range(1 + steps):
            tr.step(*pool[s % 2])
        per_step = [sum(t) for t in zip(*(tr.times[k] for k in PHASES))]
        del tr
        gc.collect()
        return {"first_s": per_step[0], "later_s": per_step[1:]}


def memory(rank: int, world: int, jobs: list[tuple], steps: int, live: bool) -> list[dict]:
    """Each (run, shape, config, compiled) in turn: with `compiled` (its `backend`, `steps`)
    first `_first_steps`; then live tensor bytes over `steps` profiled steps (+1), and peak RSS over
    one more without the profiler; on CUDA the allocator's peak (`_cuda_memory`)."""
    meshes = _meshes(world, [job[2] for job in jobs], [job[1] for job in jobs])
    if device().type == "cuda":
        return [_cuda_memory(rank, world, job, steps, meshes) for job in jobs]
    tuned = live_malloc() if live else False
    results = []
    for run, shape, config, compiled in jobs:
        first = _first_steps(rank, world, shape, config, **compiled, meshes=meshes) if compiled else {}
        gc.collect()
        base_kb = status_kb("VmRSS")
        pool, backend = pool_of(shape, rank, world), (compiled or {}).get("backend")
        build = lambda: Trainer(config, shape, meshes=meshes, backend=backend)  # noqa: B023, E731
        tr, trace = live_steps(build, pool, steps)
        stats = tr.opt.memory_stats() if hasattr(tr.opt, "memory_stats") else None
        gc.collect()
        reset = reset_peak()
        tr.step(*pool[(steps + 1) % 2])
        result = {"run": run, "config": config, "params": tr.params, **trace.summary(), "memory_stats": stats}
        result.update(first)
        result.update(
            rss_base_kb=base_kb, rss_peak_kb=status_kb("VmHWM"), peak_reset=reset, live_malloc=tuned
        )
        results.append(result)
        del tr, trace
        gc.collect()
    return results


def _cuda_memory(rank: int, world: int, job: tuple, steps: int, meshes: dict) -> dict:
    """CUDA: the caching allocator's peak over `steps - 1` steps after the first (the peak reset
    after it), and what is allocated after the first, less what the rank held before building it."""
    run, shape, config, compiled = job
    gc.collect()
    torch.cuda.empty_cache()
    pool = pool_of(shape, rank, world)
    base = torch.cuda.memory_allocated()
    tr = Trainer(config, shape, meshes=meshes, backend=(compiled or {}).get("backend"))
    tr.step(*pool[0])
    start = torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    for s in range(1, steps):
        tr.step(*pool[s % 2])
    result = {"run": run, "config": config, "params": tr.params, "live_start": start}
    result["live_peak"] = torch.cuda.max_memory_allocated() - base
    result["memory_stats"] = tr.opt.memory_stats() if hasattr(tr.opt, "memory_stats") else None
    result["source"] = "torch.cuda.max_memory_allocated"
    del tr
    gc.collect()
    return result
