"""Optimizer-state bytes per parameter and per rank, measured from the tensors held.

AdamW at 32/16/8 bits, Muon (32/8 bits) and Shampoo on a GPT-like model, on a local gloo world,
next to `torch.optim.AdamW` on one process (what every DDP rank holds). Counted: every
state tensor of the optimizer on that rank, fp32 masters (and Shampoo's factors and
roots) included; parameters and gradients are not optimizer state.

    python benchmarks/memory.py [--world-size 4] [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import vescale_optim as vo  # noqa: E402
from benchmarks._gpt import build_gpt, launch  # noqa: E402
from benchmarks._main import finish, parse  # noqa: E402
from benchmarks._optim import ours, peer, state_bytes  # noqa: E402
from benchmarks._report import table  # noqa: E402

PRELOAD = ["benchmarks.memory"]  # besides benchmarks._gpt.PEERS

CONFIGS = [("AdamW", {"state_bits": b}) for b in (32, 16, 8)] + [("Muon", {"state_bits": b}) for b in (32, 8)]
CONFIGS.append(("Shampoo", {"max_preconditioner_dim": 1024}))


def make(name: str, model: torch.nn.Module, kwargs: dict):
    return vo.Shampoo(model.parameters(), **kwargs) if name == "Shampoo" else ours(model, name, **kwargs)


def torch_adamw_bytes(model: torch.nn.Module) -> int:
    """State of `torch.optim.AdamW` (the peer factory's, no wrapper) after one step (exp_avg,
    exp_avg_sq, step)."""
    opt = peer(model, "torch")[1]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())


def _rank(rank: int, world: int, model_kwargs: dict) -> list[dict]:
    rows = []
    for name, kwargs in CONFIGS:
        model = build_gpt(**model_kwargs)
        opt = make(name, model, kwargs)
        rows.append({"optimizer": name, **kwargs, "bytes": state_bytes(opt)})  # checked: memory_stats()
    return rows


def main(argv: list[str] | None = None) -> dict:
    args = parse(__doc__, argv, "a small model", world_size=4)
    model_kwargs = dict(vocab=2048, d_model=128, n_layers=2) if args.quick else {}
    model = build_gpt(**model_kwargs)
    n = sum(p.numel() for p in model.parameters())
    reference = torch_adamw_bytes(model)
    per_rank = launch(_rank, args.world_size, model_kwargs, preload=PRELOAD)
    rows = []
    sizes = [("torch.optim.AdamW (every DDP rank)", 32, [reference])]
    sizes += [
        (f"vo.{name}", kwargs.get("state_bits", 32), [r[i]["bytes"] for r in per_rank])
        for i, (name, kwargs) in enumerate(CONFIGS)
    ]
    for name, bits, held in sizes:
        row = {"optimizer": name, "bits": bits, "bytes/param (all ranks)": sum(held) / n}
        rows.append(
            {**row, "MiB per rank (max)": max(held) / 2**20, "vs torch per rank": max(held) / reference}
        )
    print(f"GPT-like model, {n / 1e6:.1f} M parameters, {args.world_size} ranks\n")
    print(table(rows, floatfmt=".3f"))
    payload = {"params": n, "world_size": args.world_size, "rows": rows, "per_rank": per_rank}
    return finish("memory", args, payload, per_rank.threads)


if __name__ == "__main__":
    main()
