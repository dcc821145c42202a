"""What the library's features cost, each section against what it replaces, on a local gloo world.

- `state`: optimizer-state bytes per parameter and per rank, from the tensors held: `vo.AdamW` at
  32/16/8 bits, `vo.Muon` (32/8) and `vo.Shampoo` on a GPT, next to `torch.optim.AdamW` on one
  process (what every DDP rank holds). Every state tensor of the optimizer on that rank counts,
  fp32 masters (and Shampoo's factors and roots) included; parameters and gradients do not.
- `shampoo`: tiles owned by one rank each against every rank computing every root, on a GPT of 65
  tiles of at most 256 x 256 (`max_preconditioner_dim=256`, roots every step, adam grafting), each
  in a fresh world: `sharded` (`vo.Shampoo(model.parameters())`) and `replicated` (`process_group=`
  a group of this rank alone: every rank computes every root, its backward on the whole global
  batch, the step paying one all-reduce of every gradient element, what averaging costs). `step s`:
  `opt.step()` (plus that all-reduce), the slowest rank's after a barrier, the median over
  `--steps`; `root work`: the sum of `h^3 + w^3` over the tiles whose roots a rank computes (in
  256^3), the busiest rank's, max/mean over ranks (`before balance`: each tile at the rank that
  holds its rows); `preconditioner MiB`: the factors and roots a rank holds; `max |dp|`: both runs'
  parameters after the last step, the same math up to the order of the gradient reduction (hence
  `--epsilon` 1e-6: a smaller one amplifies either run's rounding in `(lam + epsilon)^(-1/4)`).
- `clip`: `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` on `ReducedGrad`s computes each
  parameter's norm on this rank's pieces as a partial value, and torch's norm of them all reduces
  them together: one small all-reduce for the whole model. Counted with the library's trace of
  collectives (`vescale_optim.shard.handle.traced`), next to `opt.clip_grad_norm_` and a logging
  loop that reads each parameter's norm on its own (`float(p.grad.norm())`: one all-reduce per
  parameter, what to avoid); ZeRO-2 and ZeRO-3 (a unit per block). `median ms`: the slowest rank's.
- `sync`: each backward agrees on `no_sync()` (one small all-reduce, issued at its first event and
  read back before its first reduce-scatter: the one host sync in backward), so that `no_sync()`
  entered on some ranks only fails on every rank. Per backward and per train step of `--micro`
  micro-batches (all but the last under `no_sync()`), ZeRO-3: `without the agreement` (patched out
  on every rank, here only), `as shipped` and `TORCH_DISTRIBUTED_DEBUG=DETAIL` (torch's check of
  every collective); the slowest rank's medians. On CPU gloo's collectives are synchronous, so the
  agreement's latency is added whole; docs/benchmarks.md says what a GPU pays.

    python benchmarks/costs.py                        # every section, 4 ranks
    python benchmarks/costs.py --quick --world-size 2  # small models, a few runs
    python benchmarks/costs.py --sections sync --world-size 2 --layers 2 --width 64 --runs 15
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import vescale_optim as vo  # noqa: E402
from benchmarks._gpt import build_gpt, launch, random_batch, shaped_gpt  # noqa: E402
from benchmarks._main import finish, parse  # noqa: E402
from benchmarks._optim import ours, peer, state_bytes  # noqa: E402
from benchmarks._report import require_finite, table  # noqa: E402
from vescale_optim.shard.handle import traced  # noqa: E402

PRELOAD = ["benchmarks.costs"]  # besides benchmarks._gpt.PEERS
STATE = [("AdamW", {"state_bits": b}) for b in (32, 16, 8)] + [("Muon", {"state_bits": b}) for b in (32, 8)]
STATE.append(("Shampoo", {"max_preconditioner_dim": 1024}))
SHAMPOO = dict(vocab=2048, d_model=256, n_layers=4, n_heads=4, seq_len=64, dim=256, batch=4)
SHAMPOO_QUICK = dict(vocab=256, d_model=64, n_layers=2, n_heads=2, seq_len=32, dim=64, batch=2)
UNIT = 256**3
NUMBERS = ["step s", "speedup", "root work / rank", "root max/mean", "before balance", "max |dp|"]
NUMBERS.insert(-1, "preconditioner MiB / rank")
MODES = ("without the agreement", "as shipped", "TORCH_DISTRIBUTED_DEBUG=DETAIL")
# (layers, width, micro-batches, runs) by section: full, --quick
SIZES = {"clip": ((12, 256, 1, 5), (4, 32, 1, 2)), "sync": ((8, 256, 4, 5), (2, 32, 2, 2))}


# ---------------------------------------------------------------- state


def _state(rank: int, world: int, model_kwargs: dict) -> list[dict]:
    rows = []
    for name, kwargs in STATE:
        model = build_gpt(**model_kwargs)
        opt = vo.Shampoo(model.parameters(), **kwargs) if name == "Shampoo" else ours(model, name, **kwargs)
        rows.append({"optimizer": name, **kwargs, "bytes": state_bytes(opt)})  # checked: memory_stats()
    return rows


def state(args) -> dict:
    model_kwargs = dict(vocab=2048, d_model=128, n_layers=2) if args.quick else {}
    model = build_gpt(**model_kwargs)
    n = sum(p.numel() for p in model.parameters())
    opt = peer(model, "torch")[1]  # torch.optim.AdamW after one step: exp_avg, exp_avg_sq, step
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    reference = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    per_rank = launch(_state, args.world_size, model_kwargs, preload=PRELOAD)
    sizes = [("torch.optim.AdamW (every DDP rank)", 32, [reference])]
    sizes += [
        (f"vo.{name}", kw.get("state_bits", 32), [r[i]["bytes"] for r in per_rank])
        for i, (name, kw) in enumerate(STATE)
    ]
    rows = []
    for name, bits, held in sizes:
        row = {"optimizer": name, "bits": bits, "bytes/param (all ranks)": sum(held) / n}
        rows.append(
            {**row, "MiB per rank (max)": max(held) / 2**20, "vs torch per rank": max(held) / reference}
        )
    print(f"\n## state: GPT-like model, {n / 1e6:.1f} M parameters, {args.world_size} ranks\n")
    print(table(rows, floatfmt=".3f"))
    return {"params": n, "rows": rows, "per_rank": per_rank, "threads": per_rank.threads}


# ---------------------------------------------------------------- shampoo


def _shampoo(rank: int, world: int, config: str, cfg: dict, warmup: int, steps: int) -> dict:
    model = shaped_gpt(cfg)
    solo = [dist.new_group([r]) for r in range(world)][rank]
    group = None if config == "sharded" else solo
    hyper = dict(lr=1e-3, epsilon=cfg["epsilon"], max_preconditioner_dim=cfg["dim"], process_group=group)
    opt = vo.Shampoo(model.parameters(), root_dtype=getattr(torch, cfg["root_dtype"]), **hyper)
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))  # replicated: the bytes averaging moves
    times = []
    for t in range(warmup + steps):
        xs, ys = zip(
            *(
                random_batch(cfg["batch"], cfg["seq_len"], cfg["vocab"], seed=1000 * t + r)
                for r in range(world)
            )
        )
        x, y = (xs[rank], ys[rank]) if config == "sharded" else (torch.cat(xs), torch.cat(ys))
        opt.zero_grad()
        model.loss(x, y).backward()
        dist.barrier()
        start = time.perf_counter()
        if config == "replicated":
            dist.all_reduce(flat, op=dist.ReduceOp.AVG)
        opt.step()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if t >= warmup:
            times.append(elapsed.item())
    work = opt.root_work if config == "sharded" else (sum(opt.root_work),) * world
    native = opt.native_root_work if config == "sharded" else work
    out = dict(times=times, work=work, native=native, moved=opt.moved_tiles, tiles=opt.num_tiles)
    out["precond_bytes"] = opt.local_preconditioner_numel() * 4
    out["params"] = [p.detach().clone() for p in params] if rank == 0 else None
    return {**out, "numel": sum(p.numel() for p in params)}


def ratio(loads) -> float:
    """max/mean of per-rank loads (1 when none)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0


def shampoo(args) -> dict:
    cfg = {
        **(SHAMPOO_QUICK if args.quick else SHAMPOO),
        "epsilon": args.epsilon,
        "root_dtype": args.root_dtype,
    }
    steps = 2 if args.quick else args.steps
    raw = {
        c: launch(_shampoo, args.world_size, c, cfg, args.warmup, steps, preload=PRELOAD)
        for c in ("replicated", "sharded")
    }
    base, rows = statistics.median(raw["replicated"][0]["times"]), []
    for config, results in raw.items():
        r0, step = results[0], statistics.median(results[0]["times"])
        row = {
            "optimizer": config,
            "step s": step,
            "speedup": base / step,
            "root work / rank": max(r0["work"]) / UNIT,
        }
        row.update(
            {
                "root max/mean": ratio(r0["work"]),
                "before balance": ratio(r0["native"]),
                "tiles moved": r0["moved"],
            }
        )
        row["preconditioner MiB / rank"] = max(r["precond_bytes"] for r in results) / 2**20
        row["max |dp|"] = max(
            (a - b).abs().max().item() for a, b in zip(r0["params"], raw["replicated"][0]["params"])
        )
        rows.append(row)
    r0 = raw["sharded"][0]
    model = f"{r0['numel']:,} parameters, {r0['tiles']} tiles of at most {cfg['dim']}"
    print(f"\n## shampoo: a GPT-like model ({model}), {args.world_size} gloo ranks\n")
    print(table(rows))
    require_finite(rows, NUMBERS)
    out = {"config": cfg, "rows": rows, "threads": raw["sharded"].threads}
    return {
        **out,
        "times": {c: r[0]["times"] for c, r in raw.items()},
        "root_work": {c: r[0]["work"] for c, r in raw.items()},
    }


# ---------------------------------------------------------------- clip


def _blocks(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    block = lambda: nn.Sequential(
        nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
    )  # noqa: E731
    return nn.Sequential(*(block() for _ in range(layers)), nn.Linear(width, 8))


def _methods(opt) -> dict:
    norm = torch.nn.utils.clip_grad_norm_
    return {
        "torch clip_grad_norm_ (foreach=None)": lambda ps: norm(ps, 1.0),
        "torch clip_grad_norm_ (foreach=True)": lambda ps: norm(ps, 1.0, foreach=True),
        "torch clip_grad_norm_ (norm_type=inf)": lambda ps: norm(ps, 1.0, float("inf")),
        "torch clip_grad_value_": lambda ps: torch.nn.utils.clip_grad_value_(ps, 1.0),
        "opt.clip_grad_norm_": lambda ps: opt.clip_grad_norm_(1.0),
        "float(p.grad.norm()) per parameter": lambda ps: [float(p.grad.norm()) for p in ps],
    }


def _clip(rank: int, world: int, layers: int, width: int, micro: int, runs: int) -> list[dict]:
    rows = []
    for mode in ("ZeRO-2", "ZeRO-3"):
        model = _blocks(layers, width)
        opt = vo.AdamW(
            model.parameters(), lr=1e-3, **({"shard_modules": [*model, model]} if mode == "ZeRO-3" else {})
        )
        ps, x = list(model.parameters()), torch.randn(8, width, generator=torch.Generator().manual_seed(rank))
        for name, method in _methods(opt).items():
            times, counts = [], set()
            for t in range(runs + 1):
                opt.zero_grad()
                model(x).square().mean().backward()
                dist.barrier()
                start = time.perf_counter()
                with traced() as trace:
                    method(ps)
                if t:  # the first one warms up
                    times.append((time.perf_counter() - start) * 1e3)
                counts.add(len(trace))
                opt.step()
            if len(counts) != 1:
                raise RuntimeError(f"{mode} {name}: the number of collectives changed between runs: {counts}")
            row = {"sharding": mode, "method": name, "parameters": len(ps), "collectives": counts.pop()}
            rows.append({**row, "median ms": statistics.median(times)})
    return rows


# ---------------------------------------------------------------- sync


@contextlib.contextmanager
def _mode(mode: str):
    """A process group for `mode` (DETAIL debug level for the last), and the agreement on no_sync()
    taken out for the first, on this rank: every rank runs the same mode, so collectives pair up."""
    from vescale_optim.units.reduction import ReductionPipeline

    before, shipped = dist.get_debug_level(), ReductionPipeline.issue_agreement
    if mode == MODES[2]:
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        group = dist.new_group(list(range(dist.get_world_size())))
    finally:
        dist.set_debug_level(before)
    if mode == MODES[0]:
        ReductionPipeline.issue_agreement = lambda self, world: None
    try:
        yield group
    finally:
        ReductionPipeline.issue_agreement = shipped
        dist.destroy_process_group(group)


def _sync(rank: int, world: int, layers: int, width: int, micro: int, runs: int) -> list[dict]:
    rows = []
    for mode in MODES:
        with _mode(mode) as group:
            model = build_gpt(n_layers=layers, d_model=width, vocab=512, seq_len=32)
            opt = vo.AdamW(
                model.parameters(), lr=1e-3, shard_modules=[*model.blocks, model], process_group=group
            )
            steps, quiet, reducing = [], [], []
            for t in range(runs + 1):
                dist.barrier()
                start = time.perf_counter()
                for m in range(micro):
                    loss = model.loss(*random_batch(2, 32, 512, seed=rank * 1000 + t * micro + m))
                    begin = time.perf_counter()
                    with opt.no_sync() if m < micro - 1 else contextlib.nullcontext():
                        loss.backward()
                    if t:  # the first one warms up
                        (quiet if m < micro - 1 else reducing).append((time.perf_counter() - begin) * 1e3)
                opt.step()
                opt.zero_grad()
                if t:
                    steps.append((time.perf_counter() - start) * 1e3)
        row = {"check": mode, "median ms": statistics.median(steps)}
        row["backward ms (no_sync)"] = statistics.median(quiet) if quiet else None
        rows.append({**row, "backward ms (reducing)": statistics.median(reducing)})
    return rows


def collectives(args, section: str) -> dict:
    """`clip` or `sync`: every rank's rows, each number the slowest rank's."""
    sizes = SIZES[section][1] if args.quick else (args.layers, args.width, args.micro, args.runs)
    sizes = [given or default for given, default in zip(sizes, SIZES[section][0])]
    layers, width, micro, runs = sizes
    per_rank = launch(_clip if section == "clip" else _sync, args.world_size, *sizes, preload=PRELOAD)
    rows = []
    for i, row in enumerate(per_rank[0]):
        if section == "clip" and any(r[i]["collectives"] != row["collectives"] for r in per_rank):
            raise RuntimeError(f"ranks issued different numbers of collectives for {row['method']}")
        slowest = {k: max(r[i][k] for r in per_rank) for k, v in row.items() if "ms" in k and v}
        rows.append({**row, **slowest})
    if section == "sync":
        for r in rows:
            r["x as shipped"] = r["median ms"] / rows[1]["median ms"]
    per_step = f"{micro} micro-batches per step, " if section == "sync" else ""
    print(f"\n## {section}: {layers} blocks of width {width}, {per_step}{args.world_size} ranks")
    print(f"(slowest rank's median of {runs}; gloo is synchronous on CPU)\n")
    print(table(rows, floatfmt=".3f"))
    return {"layers": layers, "width": width, "micro": micro, "rows": rows, "threads": per_rank.threads}


SECTIONS = {
    "state": state,
    "shampoo": shampoo,
    "clip": lambda a: collectives(a, "clip"),
    "sync": lambda a: collectives(a, "sync"),
}


def main(argv: list[str] | None = None) -> dict:
    args = parse(
        __doc__,
        argv,
        "small models, a few runs",
        world_size=4,
        sections=dict(nargs="+", choices=list(SECTIONS), default=list(SECTIONS)),
        warmup=(1, "shampoo: steps before the timed ones"),
        steps=(3, "shampoo: timed steps"),
        epsilon=(1e-6, "shampoo's"),
        root_dtype=dict(choices=["float32", "float64"], default="float32"),
        layers=dict(type=int, help="clip, sync: blocks (default 12, 8)"),
        width=dict(type=int, help="clip, sync: block width (default 256)"),
        micro=dict(type=int, help="sync: micro-batches per step (default 4)"),
        runs=dict(type=int, help="clip, sync: timed runs (default 5)"),
    )
    payload = {"world_size": args.world_size, **{name: SECTIONS[name](args) for name in args.sections}}
    return finish("costs", args, payload, payload[args.sections[-1]]["threads"])


if __name__ == "__main__":
    main()
