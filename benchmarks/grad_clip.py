"""torch's gradient clipping on vo.AdamW's sharded gradients: collectives issued and time.

`torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` on `ReducedGrad`s computes each
parameter's norm on this rank's pieces as a partial value; torch stacks them and takes their
norm, which reduces them all together: one small all-reduce (one float64 per parameter) for
the whole model, whatever the number of parameters. Counted with the library's trace of
collectives (`vescale_optim.shard.handle.traced`), next to `opt.clip_grad_norm_` (one
all-reduce of one element) and a logging loop that reads every parameter's norm on its own
(`float(p.grad.norm())`: one all-reduce per parameter, what to avoid). ZeRO-2 (buckets) and
ZeRO-3 (a unit per block), on a local gloo world.

    python benchmarks/grad_clip.py [--world-size 4] [--layers 12] [--quick]
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
from torch import nn  # noqa: E402

import vescale_optim as vo  # noqa: E402
from benchmarks._gpt import launch  # noqa: E402
from benchmarks._main import finish, parse  # noqa: E402
from benchmarks._report import table  # noqa: E402
from vescale_optim.shard.handle import traced  # noqa: E402

PRELOAD = ["benchmarks.grad_clip"]
INF = float("inf")


def _model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)

    def block() -> nn.Module:
        wide = 4 * width
        return nn.Sequential(nn.LayerNorm(width), nn.Linear(width, wide), nn.GELU(), nn.Linear(wide, width))

    blocks = [block() for _ in range(layers)]
    return nn.Sequential(*blocks, nn.Linear(width, 8))


def _methods(opt):
    norm = torch.nn.utils.clip_grad_norm_
    return {
        "torch clip_grad_norm_ (foreach=None)": lambda ps: norm(ps, 1.0),
        "torch clip_grad_norm_ (foreach=True)": lambda ps: norm(ps, 1.0, foreach=True),
        "torch clip_grad_norm_ (norm_type=inf)": lambda ps: norm(ps, 1.0, INF),
        "torch clip_grad_value_": lambda ps: torch.nn.utils.clip_grad_value_(ps, 1.0),
        "opt.clip_grad_norm_": lambda ps: opt.clip_grad_norm_(1.0),
        "float(p.grad.norm()) per parameter": lambda ps: [float(p.grad.norm()) for p in ps],
    }


def _rank(rank: int, world: int, layers: int, width: int, runs: int) -> list[dict]:
    rows = []
    for mode in ("ZeRO-2", "ZeRO-3"):
        model = _model(layers, width)
        sharding = {"shard_modules": [*model, model]} if mode == "ZeRO-3" else {}
        opt = vo.AdamW(model.parameters(), lr=1e-3, **sharding)
        ps = list(model.parameters())
        x = torch.randn(8, width, generator=torch.Generator().manual_seed(rank))
        for name, method in _methods(opt).items():
            times, counts = [], set()
            for t in range(runs + 1):
                opt.zero_grad()
                model(x).square().mean().backward()
                dist.barrier()
                start = time.perf_counter()
                with traced() as trace:
                    method(ps)
                elapsed = time.perf_counter() - start
                if t:  # the first one warms up
                    times.append(elapsed * 1e3)
                counts.add(len(trace))
                opt.step()
            if len(counts) != 1:
                raise RuntimeError(f"{mode} {name}: the number of collectives changed between runs: {counts}")
            row = {"sharding": mode, "method": name, "parameters": len(ps), "collectives": counts.pop()}
            rows.append({**row, "median ms": statistics.median(times)})
    return rows


def main(argv: list[str] | None = None) -> dict:
    args = parse(__doc__, argv, "4 small layers, 2 runs", world_size=4, layers=12, width=256, runs=5)
    layers, width, runs = (4, 32, 2) if args.quick else (args.layers, args.width, args.runs)
    per_rank = launch(_rank, args.world_size, layers, width, runs, preload=PRELOAD)
    rows = []
    for i, row in enumerate(per_rank[0]):
        slowest = max(r[i]["median ms"] for r in per_rank)
        if any(r[i]["collectives"] != row["collectives"] for r in per_rank):
            raise RuntimeError(f"ranks issued different numbers of collectives for {row['method']}")
        rows.append({**row, "median ms": slowest})
    print(f"{layers} blocks of width {width}, {args.world_size} ranks (slowest rank's median of {runs})\n")
    print(table(rows, floatfmt=".3f"))
    payload = {"world_size": args.world_size, "layers": layers, "width": width, "rows": rows}
    return finish("grad_clip", args, payload, per_rank.threads)


if __name__ == "__main__":
    main()
