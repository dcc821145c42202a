"""Parameter all-gather and gradient reduce-scatter: flat ragged buckets against FSDP2, on gloo.

A GPT-like parameter set on W ranks (~46 M fp32 elements: embedding 8192 x 512, 12 blocks of
qkv, o, fc, proj and two norms, a final norm and an untied head). Its forward computes nothing:
each parameter's loss term hands autograd a fresh gradient filled with a constant, as a real
layer does, so a backward costs little besides gradient accumulation. Paths, all alive at once:

* `ours, 13 buckets` - one flat bucket per FSDP2 group (`plan_layout`: a granule of one row,
  align 16), parameters and gradients views of two `FlatBuffer`s, the shard layer's in-place
  all-gather and reduce-scatter (mean) into the local slice;
* `ours, 1 bucket` (`--one-bucket`) - every parameter in one bucket (on gloo a 46 M-element
  collective costs ~3x more per element than 3-8 M-element ones: slower, despite no copy);
* `FSDP2` - `fully_shard` on every block and the root, `reshard_after_forward=False`.

A first step checks the results (each rank's slice lands in place, gradients reduce to their
mean); the next is profiled on rank 0 to count copies; then `--warmup` and `--runs` timed runs,
the paths interleaved in each. Ops, the slowest rank's wall clock after a barrier, median over
runs: `param all-gather` (ours `all_gather_` per bucket; FSDP2 `unshard()` then `reshard()` of
every module), `grad reduce-scatter` (the profiler's windows on a backward of its own: ours a
`bench::` window, FSDP2 its `FSDP::post_backward_reduce` ones) and `backward + grad RS` (the
forward, where FSDP2 all-gathers, off the clock). `ours/FSDP2`: median of the per-run ratios.
`copies`, `M el.`: outermost copy ops and the elements they write (`benchmarks._copies`) outside
torch.distributed (ours: shard layer + autograd; FSDP2: its copy-in/out + autograd); `c10d`: inside
it (gloo builds some collectives from ATen copies; NCCL does not). Each copy goes to the JSON.

    python benchmarks/collectives.py                 # 4 ranks, ~46 M parameters
    python benchmarks/collectives.py --one-bucket    # ... and the single-bucket path
    python benchmarks/collectives.py --quick         # tiny model, 3 runs
"""

from __future__ import annotations

import math
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from benchmarks._copies import count_copies  # noqa: E402
from benchmarks._gpt import launch  # noqa: E402
from benchmarks._main import finish, parse  # noqa: E402
from benchmarks._measure import window_seconds  # noqa: E402
from benchmarks._optim import fully_shard_gpt  # noqa: E402
from benchmarks._report import FSDP2_ON_CPU, table  # noqa: E402
from benchmarks._train import barrier_timed  # noqa: E402
from vescale_optim.shard import FlatBuffer, plan_layout  # noqa: E402

# The shard layer's collectives, the subject of this benchmark (not exported by vescale_optim.shard):
# imported here only, so a move is a one-line fix.
from vescale_optim.shard.collectives import Comm, all_gather_into_, reduce_scatter_into_  # noqa: E402, I001

ALIGN = 16
PRELOAD = ["benchmarks.collectives"]  # besides benchmarks._gpt.PEERS
OPS = ("param all-gather", "grad reduce-scatter", "backward + grad RS")
FULL = dict(vocab=8192, dim=512, blocks=12)
QUICK = dict(vocab=512, dim=64, blocks=2)
COLUMNS = ["path", "op", "median ms", "min ms", "copies", "M el.", "c10d copies", "c10d M el.", "ours/FSDP2"]
COPY_KEYS = ("copies", "elements", "c10d_copies", "c10d_elements")


class _Probe(torch.autograd.Function):
    """A zero loss term for `p` whose backward returns a fresh gradient filled with the
    incoming scalar: what autograd gets from a real layer, at the cost of one fill."""

    @staticmethod
    def forward(ctx, p):
        ctx.shape = p.shape
        return p.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        return torch.full(ctx.shape, grad.item(), dtype=grad.dtype, device=grad.device)


def _probe(*params: torch.Tensor) -> torch.Tensor:
    return sum((_Probe.apply(p) for p in params[1:]), _Probe.apply(params[0]))


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape))


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.qkv, self.o = _param(3 * d, d), _param(d, d)
        self.fc, self.proj = _param(4 * d, d), _param(d, 4 * d)
        self.norm1, self.norm2 = _param(d), _param(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + _probe(*self.parameters())


class GPT(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.embed = _param(cfg["vocab"], cfg["dim"])
        self.blocks = nn.ModuleList(Block(cfg["dim"]) for _ in range(cfg["blocks"]))
        self.norm = _param(cfg["dim"])
        self.head = _param(cfg["vocab"], cfg["dim"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + _probe(self.embed)
        for block in self.blocks:
            x = block(x)
        return x + _probe(self.norm, self.head)

    def groups(self) -> list[list[nn.Parameter]]:
        """FSDP2's parameter groups: one per block, then the root's own parameters."""
        return [list(b.parameters()) for b in self.blocks] + [[self.embed, self.norm, self.head]]

    def loss(self, scale: float) -> torch.Tensor:
        return self(torch.zeros(())) * scale


class Ours:
    """The model's parameters bound into flat buckets (one, or one per FSDP2 group): parameters as
    views of one flat buffer per bucket and their gradients as views of another."""

    def __init__(self, cfg: dict, per_group: bool, comm: Comm):
        self.model, self.comm, self.buckets = GPT(cfg), comm, []
        for params in self.model.groups() if per_group else [list(self.model.parameters())]:
            shapes = [p.shape for p in params]
            layout = plan_layout([p.numel() for p in params], [s[-1] for s in shapes], comm.world_size, ALIGN)
            pbuf, gbuf = (FlatBuffer(layout, shapes, comm.rank, params[0].dtype) for _ in range(2))
            with torch.no_grad():
                for i, p in enumerate(params):
                    pbuf.view(i).copy_(p)
                    p.data, p.grad = pbuf.view(i), gbuf.view(i)
            self.buckets.append((params, pbuf, gbuf))

    def all_gather(self) -> None:
        for _, pbuf, _ in self.buckets:
            all_gather_into_(pbuf.data, pbuf.local, self.comm)

    def reduce_scatter(self) -> None:
        for _, _, gbuf in self.buckets:
            reduce_scatter_into_(gbuf.data, gbuf.local, self.comm, op="mean")

    def zero_grad(self) -> None:
        for _, _, gbuf in self.buckets:
            gbuf.data.zero_()

    def check(self, expect: float) -> None:
        """Reduced gradients equal `expect` on every local piece; the gradients are still
        views of the buckets."""
        for params, _, gbuf in self.buckets:
            for i, p in enumerate(params):
                assert p.grad is not None and p.grad.data_ptr() == gbuf.view(i).data_ptr()
                piece = gbuf.local_piece(i)
                assert torch.all(piece == expect), f"ours: reduced gradient {piece[:4]} != {expect}"

    def check_gather(self, rank: int, world: int) -> None:
        """Each rank's slice lands in place."""
        for _, pbuf, _ in self.buckets:
            pbuf.data.fill_(-1.0)
            pbuf.local.fill_(rank)
        self.all_gather()
        for _, pbuf, _ in self.buckets:
            got = pbuf.data.view(world, pbuf.shard_size)
            want = torch.arange(world, dtype=got.dtype).unsqueeze(1).expand_as(got)
            assert torch.equal(got, want), "ours: all-gather did not fill the buffer"


class FSDP2:
    def __init__(self, cfg: dict):
        self.model = fully_shard_gpt(GPT(cfg), reshard_after_forward=False)
        self.modules = [*self.model.blocks, self.model]

    def all_gather(self) -> None:
        for m in self.modules:
            m.unshard()
        for m in self.modules:
            m.reshard()

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def check(self, expect: float) -> None:
        for p in self.model.parameters():
            local = p.grad.to_local()
            assert torch.all(local == expect), f"FSDP2: reduced gradient {local.view(-1)[:4]} != {expect}"


def _profiled(fn: Callable[[], object], label: str) -> float:
    """Seconds inside the profiler windows named `label...` during `fn()`, after a barrier; `fn`
    itself runs in a `bench::profiled` window."""
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof, record_function("bench::profiled"):
        fn()
    seconds = window_seconds(prof, label)
    if seconds is None:
        raise RuntimeError(f"no profiler window named {label}... in this step: did the label move?")
    return seconds


def _profile_step(rank: int, steps: list[tuple[str, Callable[[], None]]]) -> dict | None:
    """Run `steps` (region, fn) once, under the profiler on rank 0: its copies by region."""
    if rank != 0:
        for _, fn in steps:
            dist.barrier()
            fn()
        return None
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as prof:
        for region, fn in steps:
            dist.barrier()
            with record_function(region):
                fn()
    return count_copies(prof, [r for r, _ in steps])


def _merge(a: dict, b: dict) -> dict:
    events = Counter(a["events"])
    events.update(b["events"])
    return {**{k: a[k] + b[k] for k in COPY_KEYS}, "events": dict(sorted(events.items()))}


def _profile_fsdp_backward(rank: int, loss: torch.Tensor) -> dict | None:
    """FSDP2's backward under the profiler; its reduce-scatter part is every
    `FSDP::post_backward_reduce` window, added up."""
    dist.barrier()
    if rank != 0:
        loss.backward()
        return None
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True)
    with prof, record_function("bench::backward"):
        loss.backward()
    regions = sorted({e.name for e in prof.events() if e.name.startswith("FSDP::post_backward_reduce")})
    got = count_copies(prof, ["bench::backward", *regions])
    reduce = {**dict.fromkeys(COPY_KEYS, 0), "events": {}}
    for r in regions:
        reduce = _merge(reduce, got[r])
    return {"bench::backward": got["bench::backward"], "reduce": reduce}


def _copies(rank: int, ours: dict[str, Ours], fsdp: FSDP2, scale: float) -> dict[tuple[str, str], dict]:
    """The warm-up step, copies counted under the profiler on rank 0."""
    copies = {}
    for name, o in ours.items():
        o.zero_grad()
        loss = o.model.loss(scale)
        regions = [("bench::all_gather", o.all_gather), ("bench::backward", loss.backward)]
        got = _profile_step(rank, [*regions, ("bench::reduce_scatter", o.reduce_scatter)])
        if got is not None:
            copies[(name, OPS[0])] = got["bench::all_gather"]
            copies[(name, OPS[1])] = got["bench::reduce_scatter"]
            copies[(name, OPS[2])] = _merge(got["bench::backward"], got["bench::reduce_scatter"])
    got = _profile_step(rank, [("bench::all_gather", fsdp.all_gather)])
    fsdp.zero_grad()
    got_bwd = _profile_fsdp_backward(rank, fsdp.model.loss(scale))
    if got is not None:
        copies[("FSDP2", OPS[0])] = got["bench::all_gather"]
        copies[("FSDP2", OPS[1])] = got_bwd["reduce"]
        copies[("FSDP2", OPS[2])] = got_bwd["bench::backward"]
    return copies


def _one_run(ours: dict[str, Ours], fsdp: FSDP2, scale: float) -> dict[tuple[str, str], float]:
    times = {(name, OPS[0]): barrier_timed(o.all_gather)[0] for name, o in ours.items()}
    times[("FSDP2", OPS[0])] = barrier_timed(fsdp.all_gather)[0]
    for name, o in ours.items():
        o.zero_grad()
        bwd = barrier_timed(o.model.loss(scale).backward)[0]
        times[(name, OPS[2])] = bwd + barrier_timed(o.reduce_scatter)[0]
    fsdp.zero_grad()
    loss = fsdp.model.loss(scale)  # FSDP2 all-gathers here, off the clock
    times[("FSDP2", OPS[2])] = barrier_timed(loss.backward)[0]
    for name, o in ours.items():  # the reduce-scatter alone: both sides under the profiler
        o.zero_grad()
        o.model.loss(scale).backward()
        times[(name, OPS[1])] = _profiled(o.reduce_scatter, "bench::profiled")
    fsdp.zero_grad()
    loss = fsdp.model.loss(scale)
    times[("FSDP2", OPS[1])] = _profiled(loss.backward, "FSDP::post_backward_reduce")
    return times


def _measure(rank: int, world: int, args) -> dict:
    # torch 2.13 deprecates the names the shard layer calls (`all_gather_into_tensor`,
    # `reduce_scatter_tensor`); one warning per rank and call site is noise here.
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use", category=FutureWarning)
    cfg, comm = QUICK if args.quick else FULL, Comm()
    scale, expect = float(rank + 1), (world + 1) / 2  # the mean over ranks of rank + 1
    names = [f"ours, {cfg['blocks'] + 1} buckets", *(["ours, 1 bucket"] if args.one_bucket else [])]
    ours = {name: Ours(cfg, name != "ours, 1 bucket", comm) for name in names}
    fsdp = FSDP2(cfg)
    for o in ours.values():  # unmeasured: FSDP2's lazy init, first touch of every buffer, the checks
        o.check_gather(rank, world)
        o.zero_grad()
        o.model.loss(scale).backward()
        o.reduce_scatter()
        o.check(expect)
    fsdp.all_gather()
    fsdp.zero_grad()
    fsdp.model.loss(scale).backward()
    fsdp.check(expect)
    copies = _copies(rank, ours, fsdp, scale)
    for _ in range(args.warmup):
        _one_run(ours, fsdp, scale)
    paths = (*ours, "FSDP2")
    keys = [(p, op) for op in OPS for p in paths]
    runs = [_one_run(ours, fsdp, scale) for _ in range(args.runs)]
    samples = torch.tensor([[t[k] for k in keys] for t in runs], dtype=torch.float64)
    dist.all_reduce(samples, op=dist.ReduceOp.MAX)  # the slowest rank sets the time of a collective step
    fsdp.check(expect)
    for o in ours.values():
        o.check(expect)
    if rank != 0:
        return {}
    numel = {name: [pbuf.layout.numel for _, pbuf, _ in o.buckets] for name, o in ours.items()}
    numel["FSDP2"] = [-(-sum(p.numel() for p in g) // world) * world for g in fsdp.model.groups()]
    padding = {name: sum(p.layout.padding for _, p, _ in o.buckets) for name, o in ours.items()}
    copies = {f"{p} | {op}": c for (p, op), c in copies.items()}
    params = sum(p.numel() for p in fsdp.model.parameters())
    out = dict(
        paths=paths, keys=keys, samples_s=samples.tolist(), copies=copies, params=params, padding=padding
    )
    return {**out, "threads_per_rank": torch.get_num_threads(), "collective_numel": numel}


def _rows(result: dict) -> list[dict]:
    col = {tuple(k): [s[j] for s in result["samples_s"]] for j, k in enumerate(result["keys"])}
    rows = []
    for op in OPS:
        peer = col[("FSDP2", op)]
        for path in result["paths"]:
            t, c = col[(path, op)], result["copies"].get(f"{path} | {op}", {})
            ratio = None if path == "FSDP2" else statistics.median(a / b for a, b in zip(t, peer))
            row = {"path": path, "op": op, "median ms": statistics.median(t) * 1e3, "min ms": min(t) * 1e3}
            row.update({"copies": c.get("copies"), "M el.": c["elements"] / 1e6 if c else None})
            row.update({"c10d copies": c.get("c10d_copies")})
            row["c10d M el."] = c["c10d_elements"] / 1e6 if c else None
            rows.append({**row, "ours/FSDP2": ratio, "copy_events": c.get("events", {})})
    return rows


def main(argv: list[str] | None = None) -> dict:
    args = parse(
        __doc__,
        argv,
        "tiny model (vocab 512, d 64, 2 blocks)",
        world_size=4,
        runs=dict(type=int, help="timed runs (default 5, --quick 3)"),
        warmup=(0, "unmeasured runs besides the profiled one (default 0)"),
        one_bucket=(False, "all parameters in one bucket too (twice the run time)"),
    )
    if args.runs is None:
        args.runs = 3 if args.quick else 5
    if args.world_size < 2 or args.runs < 1 or args.warmup < 0:
        args.error("need --world-size >= 2, --runs >= 1, --warmup >= 0")
    t0 = time.perf_counter()
    ranks = launch(_measure, args.world_size, args, preload=PRELOAD)
    result, wall = ranks[0], time.perf_counter() - t0
    ok = lambda j: all(math.isfinite(r[j]) and r[j] > 0 for r in result["samples_s"])  # noqa: E731
    if bad := [k for j, k in enumerate(result["keys"]) if not ok(j)]:
        raise RuntimeError(f"timings that are not positive finite numbers: {bad}")
    cfg, rows = QUICK if args.quick else FULL, _rows(result)
    what = f"W={args.world_size}, {result['params'] / 1e6:.1f} M fp32 params ({cfg})"
    print(f"# all-gather / reduce-scatter on gloo: {what}, {result['threads_per_rank']} thread(s)/rank,")
    print(f"median of {args.runs} runs after {args.warmup + 1} warm-up\n")
    print(table(rows, COLUMNS, floatfmt=".3g"))
    print(f"\n{FSDP2_ON_CPU}")
    print("\ncopies / M el.: outermost copy ops per step on rank 0 outside torch.distributed (ours: shard")
    print("layer + autograd; FSDP2: its copy-in/out + autograd); c10d: inside torch.distributed (gloo")
    print("staging). Ratio: median of per-run ours/FSDP2.")
    span = lambda v: f"{min(v) / 1e6:.3g}-{max(v) / 1e6:.3g}" if len(v) > 1 else f"{v[0] / 1e6:.3g}"  # noqa: E731
    print(f"M elements per collective: { {k: span(v) for k, v in result['collective_numel'].items()} }")
    print(f"padding of ours (elements): {result['padding']}; wall {wall:.1f} s")
    samples = {f"{p} | {op}": [s[j] for s in result["samples_s"]] for j, (p, op) in enumerate(result["keys"])}
    payload = dict(world_size=args.world_size, runs=args.runs, warmup=args.warmup, model=cfg, rows=rows)
    payload.update({k: result[k] for k in ("params", "threads_per_rank", "padding", "collective_numel")})
    payload.update(samples_s=samples, wall_s=wall)
    return finish("collectives", args, payload, ranks.threads)


if __name__ == "__main__":
    main()
