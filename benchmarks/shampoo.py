"""Shampoo steps on a GPT-like model: tiles owned by one rank each against every rank
computing every root, on gloo.

Both configurations train the same GPT (vocab 2048, d 256, 4 layers: 4.2 M fp32 parameters, 65
tiles of at most 256 x 256; `max_preconditioner_dim=256`, roots every step, adam grafting) on the
same per-rank batches, each in a fresh world: `sharded` (`vo.Shampoo(model.parameters())`: each
rank computes the roots of the tiles it owns) and `replicated` (`process_group=` a group of this
rank alone: every rank computes every root, its backward on the whole global batch, the step
paying one all-reduce of every gradient element, what averaging costs).

`step` is `opt.step()` (plus that all-reduce), the slowest rank's after a barrier, the median over
`--steps` after `--warmup`. `root work`: the sum of `h^3 + w^3` over the tiles whose roots a rank
computes (in 256^3), the busiest rank's and max/mean over ranks (`before balance`: each tile at
the rank that holds its rows). `preconditioner MiB`: the factors and roots a rank holds (the most
on any). `max |dp|`: both runs' parameters after the last step, the same math up to the order of
the gradient reduction (hence `--epsilon` 1e-6: embedding tiles have many unused rows, and a
smaller epsilon amplifies either run's rounding in `(lam + epsilon)^(-1/4)`).

    python benchmarks/shampoo.py                 # 4 ranks, ~4.2 M parameters
    python benchmarks/shampoo.py --quick         # a tiny model, 2 measured steps
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import vescale_optim as vo  # noqa: E402
from benchmarks._gpt import launch, random_batch, shaped_gpt  # noqa: E402
from benchmarks._main import finish, parse  # noqa: E402
from benchmarks._report import require_finite, table  # noqa: E402

FULL = dict(vocab=2048, d_model=256, n_layers=4, n_heads=4, seq_len=64, dim=256, batch=4)
QUICK = dict(vocab=256, d_model=64, n_layers=2, n_heads=2, seq_len=32, dim=64, batch=2)
UNIT = 256**3
PRELOAD = ["benchmarks.shampoo"]  # besides benchmarks._gpt.PEERS
NUMBERS = ["step s", "speedup", "root work / rank", "root max/mean", "before balance", "max |dp|"]
NUMBERS.insert(-1, "preconditioner MiB / rank")


def _run(rank: int, world: int, config: str, cfg: dict, warmup: int, steps: int) -> dict:
    model = shaped_gpt(cfg)
    solo = [dist.new_group([r]) for r in range(world)][rank]
    group = None if config == "sharded" else solo
    hyper = dict(lr=1e-3, epsilon=cfg["epsilon"], max_preconditioner_dim=cfg["dim"], process_group=group)
    opt = vo.Shampoo(model.parameters(), root_dtype=getattr(torch, cfg["root_dtype"]), **hyper)
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))  # replicated: the bytes averaging moves
    times = []
    for t in range(warmup + steps):
        batch = [
            random_batch(cfg["batch"], cfg["seq_len"], cfg["vocab"], seed=1000 * t + r) for r in range(world)
        ]
        xs, ys = zip(*batch)
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


def _ratio(loads) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0


def main(argv: list[str] | None = None) -> dict:
    root_dtype = dict(choices=["float32", "float64"], default="float32")
    args = parse(
        __doc__,
        argv,
        "a tiny model, 2 steps",
        world_size=4,
        warmup=1,
        steps=3,
        epsilon=1e-6,
        root_dtype=root_dtype,
    )
    cfg = {**(QUICK if args.quick else FULL), "epsilon": args.epsilon, "root_dtype": args.root_dtype}
    steps = 2 if args.quick else args.steps
    raw, rows = {}, []
    for config in ("replicated", "sharded"):
        raw[config] = launch(_run, args.world_size, config, cfg, args.warmup, steps, preload=PRELOAD)
    threads = raw["sharded"].threads
    base = statistics.median(raw["replicated"][0]["times"])
    for config, results in raw.items():
        r0 = results[0]
        step = statistics.median(r0["times"])
        diff = max((a - b).abs().max().item() for a, b in zip(r0["params"], raw["replicated"][0]["params"]))
        row = {"optimizer": config, "step s": step, "speedup": base / step}
        row["root work / rank"] = max(r0["work"]) / UNIT
        row.update({"root max/mean": _ratio(r0["work"]), "before balance": _ratio(r0["native"])})
        row["tiles moved"] = r0["moved"]
        row["preconditioner MiB / rank"] = max(r["precond_bytes"] for r in results) / 2**20
        row["max |dp|"] = diff
        rows.append(row)
    r0 = raw["sharded"][0]
    model = f"{r0['numel']:,} parameters, {r0['tiles']} tiles of at most {cfg['dim']}"
    print(f"Shampoo on a GPT-like model ({model}), {args.world_size} gloo ranks\n")
    print(table(rows))
    require_finite(rows, NUMBERS)
    payload = {"config": cfg, "world_size": args.world_size, "rows": rows}
    for k, key in (("times", "times"), ("root_work", "work")):
        payload[k] = {c: r[0][key] for c, r in raw.items()}
    return finish("shampoo", args, payload, threads)


if __name__ == "__main__":
    main()
