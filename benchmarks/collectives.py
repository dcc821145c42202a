"""Parameter all-gather and gradient reduce-scatter: flat ragged buckets against FSDP2, on gloo.

A local gloo world (default 4 ranks, `benchmarks._gpt.launch`) holds a GPT-like
parameter set of ~46 M fp32 elements: embedding 8192 x 512, 12 blocks of
[qkv 1536 x 512, o 512 x 512, fc 2048 x 512, proj 512 x 2048, two norms 512], a final
norm and an untied head 8192 x 512.

Paths (each its own copy of the model, all alive at once so runs can interleave):

* `ours, 13 buckets` - one flat bucket per FSDP2 group (each block; embedding + final norm
  + head), so the number and sizes of the collectives match FSDP2's. Layouts come from
  `plan_layout` (unit = one row, `shape[-1]`; align 16), parameters and gradients are views
  of two `FlatBuffer`s; parameter sync is one in-place all-gather per bucket, gradient sync
  one reduce-scatter (mean) into the local slice (the shard layer's collectives).
* `ours, 1 bucket` (`--one-bucket`) - every parameter in one bucket: one all-gather, one
  reduce-scatter of 46 M elements. Off by default because it doubles the run time: gloo
  over loopback TCP costs ~3x more per element for a 46 M-element collective than for
  3-8 M-element ones, so on gloo this path is *slower* than FSDP2 despite copying nothing.
* `FSDP2` - `fully_shard` on every block and on the root, `reshard_after_forward=False`
  (so backward never all-gathers again).

Steps: step 0 is unmeasured (FSDP2's lazy init, first touch of every buffer) and checks
the results (each rank's slice lands in place; gradients reduce to their mean, and ours
stay views of the bucket); step 1 is the warm-up and is profiled on rank 0 to count
copies; then `--warmup` more unmeasured steps (default 0) and `--runs` timed ones.

Ops timed (wall clock of the slowest rank, after a barrier; median over `--runs` runs; the
paths are interleaved inside every run):

* `param all-gather`: ours = `all_gather_` on every bucket; FSDP2 = `unshard()` on every
  FSDP module, then `reshard()` on every one (copy-in, all-gather, copy-out, free).
* `grad reduce-scatter`: read from the torch profiler (CPU activities only) on a backward of
  its own: ours = the reduce-scatter of every bucket after backward, in a `bench::` window;
  FSDP2 = its `FSDP::post_backward_reduce` windows during backward, added up (copy-in,
  reduce-scatter, views of the sharded gradients). Both sides run under the same profiler;
  a run whose profile has no such window fails (FSDP2's labels moved) rather than printing
  an empty row.
* `backward + grad RS`: `loss.backward()` (+ ours' reduce-scatter); the forward, which
  FSDP2 uses to all-gather, runs before the clock starts. The loss is a sum of one term
  per parameter whose backward hands autograd a fresh, contiguous gradient filled with a
  constant, as a real layer does, so the backward costs little besides gradient
  accumulation: FSDP2's autograd steals the fresh tensor, ours adds it into the bucket
  in place (`.grad` is a view of the gradient buffer).

`ratio` is ours / FSDP2 for the same op: the median over runs of the per-run ratio.

Copies: rank 0 runs step 1 of every path under `torch.profiler` (CPU activities, with
shapes and Python stacks) and counts the *outermost* copy ops (an `aten::copy_`
inside `aten::clone` counts once, as `aten::clone`) whose time falls in the op's window:

* `copies` - made by the framework: our shard layer, FSDP2's copy-in/copy-out, autograd;
* `c10d copies` - made inside `torch.distributed` itself: under a `c10d::` op, in a
  `distributed_c10d.py` frame (e.g. `work.wait()`), or on a gloo worker thread. The
  profiler sees these because gloo's `all_gather_into_tensor` and `reduce_scatter_tensor`
  are built from ATen ops (gloo stages the gathered output and then copies it into place;
  it runs `reduce_scatter_tensor` as a clone, a full all-reduce and a copy of the own
  chunk). Copying inside gloo's own C++ (its TCP pairs) is invisible to the profiler.
  NCCL implements both collectives natively, without these ATen staging copies (not
  measured here).

Copies of a single element (gloo converting the AVG divisor) are not counted; `M el.`
is the number of elements the counted copies write, in millions. Everything a counted
copy was and where it ran goes to the JSON (`copy_events`).

Each rank runs `max(1, cpus // world_size)` intra-op threads, the CPUs being those this
process may run on, so the ranks share the machine fairly. On CPU, FSDP2 issues its
collectives synchronously (its overlap needs CUDA streams); the ops here are timed alone.

    python benchmarks/collectives.py                 # 4 ranks, ~46 M parameters
    python benchmarks/collectives.py --one-bucket    # ... and the single-bucket path
    python benchmarks/collectives.py --quick         # tiny model, 3 runs
    python benchmarks/collectives.py --world-size 2 --runs 9
"""

from __future__ import annotations

import math
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
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


@dataclass(frozen=True)
class Config:
    vocab: int
    dim: int
    blocks: int


FULL = Config(vocab=8192, dim=512, blocks=12)
QUICK = Config(vocab=512, dim=64, blocks=2)


def _ours_paths(cfg: Config, one_bucket: bool) -> dict[str, bool]:
    """Our paths: name -> whether it has one bucket per FSDP2 group."""
    paths = {f"ours, {cfg.blocks + 1} buckets": True}
    return {"ours, 1 bucket": False, **paths} if one_bucket else paths


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
    total = _Probe.apply(params[0])
    for p in params[1:]:
        total = total + _Probe.apply(p)
    return total


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
    def __init__(self, cfg: Config):
        super().__init__()
        self.embed = _param(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg.dim) for _ in range(cfg.blocks))
        self.norm = _param(cfg.dim)
        self.head = _param(cfg.vocab, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + _probe(self.embed)
        for block in self.blocks:
            x = block(x)
        return x + _probe(self.norm, self.head)

    def groups(self) -> list[list[nn.Parameter]]:
        """FSDP2's parameter groups: one per block, then the root's own parameters."""
        return [list(b.parameters()) for b in self.blocks] + [[self.embed, self.norm, self.head]]


def _loss(model: nn.Module, scale: float) -> torch.Tensor:
    return model(torch.zeros(())) * scale


def _bind(params: list[nn.Parameter], layout, rank: int) -> tuple[FlatBuffer, FlatBuffer]:
    """Parameters as views of one flat buffer and their gradients as views of another."""
    shapes = [p.shape for p in params]
    pbuf = FlatBuffer(layout, shapes, rank, params[0].dtype)
    gbuf = FlatBuffer(layout, shapes, rank, params[0].dtype)
    with torch.no_grad():
        for i, p in enumerate(params):
            pbuf.view(i).copy_(p)
            p.data, p.grad = pbuf.view(i), gbuf.view(i)
    return pbuf, gbuf


class Ours:
    """The model's parameters bound into flat buckets (one, or one per FSDP2 group)."""

    def __init__(self, cfg: Config, per_group: bool, comm: Comm):
        self.model, self.comm = GPT(cfg), comm
        groups = self.model.groups()
        if not per_group:
            groups = [list(self.model.parameters())]
        self.buckets = []
        for params in groups:
            sizes, units = [p.numel() for p in params], [p.shape[-1] for p in params]
            layout = plan_layout(sizes, units, comm.world_size, ALIGN)
            pbuf, gbuf = _bind(params, layout, comm.rank)
            self.buckets.append((params, pbuf, gbuf))

    @property
    def padding(self) -> int:
        return sum(p.layout.padding for _, p, _ in self.buckets)

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


class FSDP2:
    def __init__(self, cfg: Config):
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


# ---------------------------------------------------------------- the ranks


def _profile_step(rank: int, steps: list[tuple[str, Callable[[], None]]]) -> dict | None:
    """Run `steps` (region, fn) once, under the profiler on rank 0."""
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


def _measure(rank: int, world: int, args) -> dict:
    # torch 2.13 deprecates the names the shard layer calls (`all_gather_into_tensor`,
    # `reduce_scatter_tensor`); one warning per rank and call site is noise here.
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use", category=FutureWarning)
    cfg = QUICK if args.quick else FULL
    comm = Comm()
    scale = float(rank + 1)
    expect = (world + 1) / 2  # mean over ranks of rank + 1
    ours = {name: Ours(cfg, per_group, comm) for name, per_group in _ours_paths(cfg, args.one_bucket).items()}
    paths = (*ours, "FSDP2")
    fsdp = FSDP2(cfg)
    numel = sum(p.numel() for p in fsdp.model.parameters())

    # Step 0, unmeasured: FSDP2's lazy init, first touch of every buffer, and checks that
    # the gathered pieces land in place and the gradients reduce to their mean.
    for o in ours.values():
        for _, pbuf, _ in o.buckets:
            pbuf.data.fill_(-1.0)
            pbuf.local.fill_(rank)
        o.all_gather()
        for _, pbuf, _ in o.buckets:
            got = pbuf.data.view(world, pbuf.shard_size)
            want = torch.arange(world, dtype=got.dtype).unsqueeze(1).expand_as(got)
            assert torch.equal(got, want), "ours: all-gather did not fill the buffer"
        o.zero_grad()
        _loss(o.model, scale).backward()
        o.reduce_scatter()
        o.check(expect)
    fsdp.all_gather()
    fsdp.zero_grad()
    _loss(fsdp.model, scale).backward()
    fsdp.check(expect)

    # Step 1, the warm-up: copies counted under the profiler on rank 0.
    copies: dict[tuple[str, str], dict] = {}
    for name, o in ours.items():
        o.zero_grad()
        loss = _loss(o.model, scale)
        got = _profile_step(rank, [("bench::all_gather", o.all_gather), ("bench::backward", loss.backward),
                                   ("bench::reduce_scatter", o.reduce_scatter)])  # fmt: skip
        if got is not None:
            copies[(name, OPS[0])] = got["bench::all_gather"]
            copies[(name, OPS[1])] = got["bench::reduce_scatter"]
            copies[(name, OPS[2])] = _merge(got["bench::backward"], got["bench::reduce_scatter"])
    got = _profile_step(rank, [("bench::all_gather", fsdp.all_gather)])
    fsdp.zero_grad()
    got_bwd = _profile_fsdp_backward(rank, _loss(fsdp.model, scale))
    if got is not None:
        copies[("FSDP2", OPS[0])] = got["bench::all_gather"]
        copies[("FSDP2", OPS[1])] = got_bwd["reduce"]
        copies[("FSDP2", OPS[2])] = got_bwd["bench::backward"]

    def one_run() -> dict[tuple[str, str], float]:
        times = {}
        for name, o in ours.items():
            times[(name, OPS[0])] = barrier_timed(o.all_gather)[0]
        times[("FSDP2", OPS[0])] = barrier_timed(fsdp.all_gather)[0]
        for name, o in ours.items():
            o.zero_grad()
            loss = _loss(o.model, scale)
            bwd = barrier_timed(loss.backward)[0]
            times[(name, OPS[2])] = bwd + barrier_timed(o.reduce_scatter)[0]
        fsdp.zero_grad()
        loss = _loss(fsdp.model, scale)  # FSDP2 all-gathers here, off the clock
        times[("FSDP2", OPS[2])] = barrier_timed(loss.backward)[0]
        for name, o in ours.items():  # the reduce-scatter alone: both sides under the profiler
            o.zero_grad()
            _loss(o.model, scale).backward()
            times[(name, OPS[1])] = _profiled(o.reduce_scatter, "bench::profiled")
        fsdp.zero_grad()
        loss = _loss(fsdp.model, scale)
        times[("FSDP2", OPS[1])] = _profiled(loss.backward, "FSDP::post_backward_reduce")
        return times

    for _ in range(args.warmup):
        one_run()
    keys = [(p, op) for op in OPS for p in paths]
    samples = torch.zeros(args.runs, len(keys), dtype=torch.float64)
    for r in range(args.runs):
        t = one_run()
        samples[r] = torch.tensor([t[k] for k in keys], dtype=torch.float64)
    # The slowest rank sets the time of a collective step.
    dist.all_reduce(samples, op=dist.ReduceOp.MAX)
    fsdp.check(expect)
    for o in ours.values():
        o.check(expect)

    if rank != 0:
        return {}
    per_group = [sum(p.numel() for p in g) for g in fsdp.model.groups()]
    return {
        "paths": paths,
        "keys": keys,
        "samples_s": samples.tolist(),
        "copies": {f"{p} | {op}": c for (p, op), c in copies.items()},
        "params": numel,
        "threads_per_rank": torch.get_num_threads(),
        "padding": {name: o.padding for name, o in ours.items()},
        "collective_numel": {
            **{name: [pbuf.layout.numel for _, pbuf, _ in o.buckets] for name, o in ours.items()},
            "FSDP2": [-(-n // world) * world for n in per_group],
        },
    }


def _merge(a: dict, b: dict) -> dict:
    out = {k: a[k] + b[k] for k in ("copies", "elements", "c10d_copies", "c10d_elements")}
    events = Counter(a["events"])
    events.update(b["events"])
    out["events"] = dict(sorted(events.items()))
    return out


def _profile_fsdp_backward(rank: int, loss: torch.Tensor) -> dict | None:
    """FSDP2's backward under the profiler; its reduce-scatter part is every
    `FSDP::post_backward_reduce` window, added up."""
    dist.barrier()
    if rank != 0:
        loss.backward()
        return None
    with (
        profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as prof,
        record_function("bench::backward"),
    ):
        loss.backward()
    regions = sorted({e.name for e in prof.events() if e.name.startswith("FSDP::post_backward_reduce")})
    got = count_copies(prof, ["bench::backward", *regions])
    reduce = {"copies": 0, "elements": 0, "c10d_copies": 0, "c10d_elements": 0, "events": {}}
    for r in regions:
        reduce = _merge(reduce, got[r])
    return {"bench::backward": got["bench::backward"], "reduce": reduce}


# ---------------------------------------------------------------- report


def _rows(result: dict) -> list[dict]:
    keys = [tuple(k) for k in result["keys"]]
    samples = torch.tensor(result["samples_s"], dtype=torch.float64)
    col = {k: samples[:, j] for j, k in enumerate(keys)}
    rows = []
    for op in OPS:
        peer = col[("FSDP2", op)]
        for path in result["paths"]:
            t = col[(path, op)]
            c = result["copies"].get(f"{path} | {op}", {})
            ratio = None if path == "FSDP2" else statistics.median((t / peer).tolist())
            median = statistics.median(t.tolist())
            rows.append({"path": path, "op": op, "median ms": median * 1e3, "min ms": min(t.tolist()) * 1e3,
                         "copies": c.get("copies"), "M el.": None if not c else c["elements"] / 1e6,
                         "c10d copies": c.get("c10d_copies"),
                         "c10d M el.": None if not c else c["c10d_elements"] / 1e6, "ours/FSDP2": ratio,
                         "copy_events": c.get("events", {})})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> dict:
    args = parse(__doc__, argv, "tiny model (vocab 512, d 64, 2 blocks)", world_size=4,
                 runs=dict(type=int, help="timed runs (default 5, --quick 3)"),
                 warmup=(0, "unmeasured runs besides the profiled one (default 0)"),
                 one_bucket=(False, "all parameters in one bucket too (twice the run time)"))  # fmt: skip
    if args.runs is None:
        args.runs = 3 if args.quick else 5
    if args.world_size < 2 or args.runs < 1 or args.warmup < 0:
        args.error("need --world-size >= 2, --runs >= 1, --warmup >= 0")

    t0 = time.perf_counter()
    ranks = launch(_measure, args.world_size, args, preload=PRELOAD)
    result, wall = ranks[0], time.perf_counter() - t0
    bad = [k for j, k in enumerate(result["keys"]) if not all(math.isfinite(r[j]) and r[j] > 0
                                                             for r in result["samples_s"])]  # fmt: skip
    if bad:
        raise RuntimeError(f"timings that are not positive finite numbers: {bad}")
    cfg = QUICK if args.quick else FULL
    rows = _rows(result)
    columns = ["path", "op", "median ms", "min ms", "copies", "M el.", "c10d copies", "c10d M el.",
               "ours/FSDP2"]  # fmt: skip
    print(f"# all-gather / reduce-scatter on gloo: W={args.world_size}, {result['params'] / 1e6:.1f} M fp32 "
          f"params ({asdict(cfg)}), {result['threads_per_rank']} thread(s)/rank, "
          f"median of {args.runs} runs after {args.warmup + 1} warm-up\n")  # fmt: skip
    print(table(rows, columns, floatfmt=".3g"))
    print(f"\n{FSDP2_ON_CPU}")
    print("\ncopies / M el.: outermost copy ops per step on rank 0 outside torch.distributed (ours: "
          "shard layer + autograd; FSDP2: its copy-in/out + autograd); c10d: inside torch.distributed "
          "(gloo staging). Ratio: median of per-run ours/FSDP2.")  # fmt: skip
    sizes = {k: f"{min(v) / 1e6:.3g}-{max(v) / 1e6:.3g}" if len(v) > 1 else f"{v[0] / 1e6:.3g}"
             for k, v in result["collective_numel"].items()}  # fmt: skip
    print(f"M elements per collective: {sizes}")
    print(f"padding of ours (elements): {result['padding']}; wall {wall:.1f} s")
    samples = {f"{p} | {op}": [s[j] for s in result["samples_s"]] for j, (p, op) in enumerate(result["keys"])}
    payload = {"world_size": args.world_size, "runs": args.runs, "warmup": args.warmup, "model": asdict(cfg),
               "params": result["params"], "threads_per_rank": result["threads_per_rank"],
               "padding": result["padding"], "collective_numel": result["collective_numel"], "rows": rows,
               "samples_s": samples, "wall_s": wall}  # fmt: skip
    return finish("collectives", args, payload, ranks.threads)


if __name__ == "__main__":
    main()
