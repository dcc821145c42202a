"""8-bit unit collectives (`gather_bits=8`, `reduce_bits=8`, `comm_block=256`) against full
precision: bytes per step and rank, step time, the demo's loss, and the bytes at model scale.

Configurations, each ZeRO-3 `vo.AdamW(..., shard_modules=[*model.blocks, model])` with: `fp32`
(nothing more), `bf16` (`param_dtype=torch.bfloat16`: gathered and reduced in bf16), `gather 8-bit`
(int8 codes + fp32 block scales) and `gather+reduce 8-bit` (the gradients reduced by qgZ's
all-to-all of 8-bit pieces too).

A. Measured on `--world-size` gloo ranks with the models of benchmarks/fsdp.py, every
configuration in one world, interleaved (`benchmarks._train`): `step_stats["gather_bytes"]` and
`["reduce_bytes"]` (rank 0's median over steps, MiB); `x fp32` / `x bf16` the total against those
configurations'; `layout check` the measured total over C's formula for the same model (1.000: the
formula is what the library sends; every unit's shard size is checked against it too); `train ms`
and `train x fp32` as in benchmarks/fsdp.py. On few CPU cores the quantize kernels are compute on
the critical path and gloo's wire a memcpy, so 8-bit is not faster here: the bytes carry to a
network. `loss after`: every configuration must lower the loss.

B. The demo's own training loop (`vescale_optim.demo.train.train_one`) for `adamw` and `muon`, the
configuration's keywords passed as `TrainConfig(sharding=...)`: `train loss` the mean of its last 10
steps, `val loss` after training, `Δ` against `fp32` (goal: within 1 %).

C. Llama-3-70B at W = 1024 without processes, as the runtime plans it (every decoder layer a unit,
the embedding, final norm and head the outermost one; AdamW's granule 1 joined with `comm_block`
when a collective is 8-bit, or the whole tensor on one rank where that does not divide it;
`plan_layout`), shard size S per unit. A ring collective of a unit whose per-rank piece is b bytes
sends (W-1)·b (b = S·dtype bytes, or S + 4·S/256 in 8-bit); per step every layer is gathered twice
(`reshard_after_forward=True`), the outermost unit once, every unit reduced once. Time = bytes /
bandwidth (no latency, no overlap): 400 Gb/s per GPU and 900 GB/s NVLink.

    python benchmarks/qcomm.py            # 4 ranks, both models, 200-step demo runs (~16 min, 2 shared cores)
    python benchmarks/qcomm.py --quick    # tiny models, 2 ranks, a few steps (a smoke test)
"""

from __future__ import annotations

import gc
import math
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks import _train, model_shapes  # noqa: E402
from benchmarks._gpt import launch, shaped_gpt  # noqa: E402
from benchmarks._main import finish, parse  # noqa: E402
from benchmarks._measure import median_ratio  # noqa: E402
from benchmarks._optim import ours  # noqa: E402
from benchmarks._report import require_finite, table  # noqa: E402
from benchmarks._train import batches, interleave, timed_row  # noqa: E402
from benchmarks.fsdp import MODELS, QUICK  # noqa: E402
from vescale_optim.kernels.wire import codec  # noqa: E402
from vescale_optim.shard import plan_layout  # noqa: E402

BLOCK = 256
ALIGN = 16  # ShardingConfig.align's default
CONFIGS = {
    "fp32": {},
    "bf16": {"param_dtype": torch.bfloat16},
    "gather 8-bit": {"gather_bits": 8, "comm_block": BLOCK},
    "gather+reduce 8-bit": {"gather_bits": 8, "reduce_bits": 8, "comm_block": BLOCK},
}
BOTH = "gather+reduce 8-bit"
GOAL_FP32, GOAL_BF16, GOAL_LOSS = 0.27, 0.52, 0.01
DEMO_CONFIGS = ["fp32", BOTH]
DEMO_OPTIMIZERS = ["adamw", "muon"]
DEMO_CHOICES = [*DEMO_OPTIMIZERS, "shampoo"]
DEMO = dict(steps=200)  # the demo's defaults otherwise (batch 8, seq 128, d 128, 4 layers, 4 heads)
DEMO_QUICK = dict(
    steps=12, batch_size=2, seq_len=32, d_model=32, n_layers=1, n_heads=2, warmup=3, val_tokens=512
)
SCALE = [("llama3-70b", 1024)]
BANDWIDTH = {"s @ 400 Gb/s": 400e9 / 8, "s @ 900 GB/s": 900e9}
MEASURED = ["gather MiB", "reduce MiB", "total MiB", "x fp32", "x bf16", "layout check", "fwd ms", "bwd ms"]
MEASURED += ["step ms", "train ms", "train x fp32", "loss after"]
GOALS = [f"<= {GOAL_FP32}x fp32", f"<= {GOAL_BF16}x bf16"]


# ---------------------------------------------------------------- the formula (C), no processes


def whole_blocks(granule: int, block: int, numel: int) -> int:
    """The granule of a tensor of `numel` elements when a collective is 8-bit: a multiple of its
    `granule` and of `block` (no rank boundary cuts a block), or the whole tensor on one rank when
    that does not divide it (the runtime's rule; A checks the shard sizes it gives)."""
    both = math.lcm(granule, block)
    return both if numel % both == 0 else max(numel, 1)


def wire_width(config: dict, key: str, numel: int) -> int | None:
    """Bytes of `numel` elements through the wire codec `config[key]` names (None: full precision)."""
    bits = config.get(key)
    return None if bits is None else codec(bits, config.get("comm_block", BLOCK)).packed_width(numel)


def layout_bytes(units: list[list[int]], world: int, config: dict, root_gathers: int = 1) -> dict:
    """Bytes a rank sends per step for `units` (each a list of parameter sizes; the last one the
    outermost unit) under `config`, from the runtime's layout rules (see the module's docstring);
    `shards`: each unit's shard size."""
    q = bool(config.get("gather_bits") or config.get("reduce_bits"))
    block = config.get("comm_block", BLOCK) if q else 1
    elem = 2 if config.get("param_dtype") == torch.bfloat16 else 4
    reduce_elem = {None: elem, torch.bfloat16: 2, torch.float32: 4}[config.get("reduce_dtype")]
    gather = reduce = padding = 0
    shards = []
    for k, sizes in enumerate(units):
        granules = [whole_blocks(1, block, n) for n in sizes]  # AdamW declares granule 1
        aligns = [math.lcm(ALIGN, block)] * len(sizes)
        segments = [(0, "fp32")] * len(sizes)
        layout = plan_layout(sizes, granules, world, math.lcm(ALIGN, block), aligns=aligns, segments=segments)
        s = layout.shard_size
        shards.append(s)
        passes = root_gathers if k == len(units) - 1 else 2
        gather += passes * (world - 1) * (wire_width(config, "gather_bits", s) or s * elem)
        reduce += (world - 1) * (wire_width(config, "reduce_bits", s) or s * reduce_elem)
        padding += layout.padding
    padding = 100 * padding / sum(map(sum, units))
    return {
        "gather": gather,
        "reduce": reduce,
        "total": gather + reduce,
        "shards": shards,
        "padding %": padding,
    }


def gpt_units(shape: dict) -> list[list[int]]:
    """A benchmark GPT's parameter sizes by unit: each block, then the rest (the model)."""
    model = shaped_gpt(shape, device="meta")
    blocks = [[p.numel() for p in b.parameters()] for b in model.blocks]
    inner = {id(p) for b in model.blocks for p in b.parameters()}
    return [*blocks, [p.numel() for p in model.parameters() if id(p) not in inner]]


def shapes_units(name: str) -> list[list[int]]:
    """A model of benchmarks/model_shapes.py by unit: each decoder layer, then the embedding,
    final norm and head (the outermost unit)."""
    blocks, numel = model_shapes.MODELS[name](), model_shapes.numel
    return [[numel(s) for _, s in b] for b in blocks[1:-1]] + [
        [numel(s) for b in (blocks[0], blocks[-1]) for _, s in b]
    ]


SCALE_CONFIGS = {
    "fp32": {},
    "bf16": {"param_dtype": torch.bfloat16},
    "bf16, fp32 reduce": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
    "gather 8-bit": CONFIGS["gather 8-bit"],
    BOTH: CONFIGS[BOTH],
}


def scale_rows(models: list[tuple[str, int]]) -> list[dict]:
    rows = []
    for name, world in models:
        units = shapes_units(name)
        got = {c: layout_bytes(units, world, cfg) for c, cfg in SCALE_CONFIGS.items()}
        for c, b in got.items():
            row = {"model": name, "W": world, "config": c, "params": sum(map(sum, units))}
            row.update({f"{k} GB": b[k] / 1e9 for k in ("gather", "reduce", "total")})
            row.update({f"x {base}": b["total"] / got[base]["total"] for base in ("fp32", "bf16")})
            seconds = {k: b["total"] / bw for k, bw in BANDWIDTH.items()}
            rows.append({**row, **seconds, "padding %": b["padding %"]})
    return rows


# ---------------------------------------------------------------- the ranks (A, B)


class Trainer(_train.Trainer):
    """One configuration of A: its optimizer, and each recorded step's `step_stats` bytes."""

    def __init__(self, config: str, shape: dict):
        super().__init__(config, shape)
        self.sent: list[tuple[int, int]] = []

    def optimizer(self, model: torch.nn.Module):
        return ours(model, "AdamW", shard_modules=[*model.blocks, model], **CONFIGS[self.config])

    @property
    def shards(self) -> list[int]:
        """Each unit's shard size (`opt.units`), in `gpt_units`'s order: the blocks, then the model."""
        size = {id(p): unit.layout.shard_size for unit in self.opt.units for p in unit.params}
        inner = {id(p) for b in self.model.blocks for p in b.parameters()}
        outer = next(p for p in self.model.parameters() if id(p) not in inner)
        return [size[id(next(b.parameters()))] for b in self.model.blocks] + [size[id(outer)]]

    def step(self, x, y, record: bool = True, around=None) -> None:
        super().step(x, y, record, around)
        if record:
            self.sent.append((self.opt.step_stats["gather_bytes"], self.opt.step_stats["reduce_bytes"]))


def _demo(demo: dict, runs: list[tuple[str, str]]) -> dict:
    """B: the demo's `train_one` for each (optimizer, configuration), in this world."""
    from vescale_optim.demo.config import TrainConfig
    from vescale_optim.demo.data import load_corpus
    from vescale_optim.demo.train import World, train_one

    world = World()
    train_data, val_data = load_corpus()
    out = {}
    for name, config in runs:
        cfg = TrainConfig(**demo, progress=False, out="unused", sharding=dict(CONFIGS[config]))
        r = train_one(name, cfg, train_data, val_data, world)
        keys = ("final_loss", "val_loss", "train_time_s", "tokens_per_s", "init_params_sha256")
        out[(name, config)] = {k: r[k] for k in keys}
    return out


def _ranks(
    rank: int, world: int, models: dict, steps: tuple[int, int], demo: dict | None, runs: list
) -> dict:
    out = {"timed": {}}
    for name, shape in models.items():
        pool = batches(shape, rank, world)
        trainers = [Trainer(c, shape) for c in CONFIGS]
        interleave(trainers, pool, *steps)
        out["timed"][name] = {
            tr.config: tr.result(*pool[0], sent=tr.sent, shards=tr.shards) for tr in trainers
        }
        del trainers
        gc.collect()
    out["demo"] = _demo(demo, runs) if demo else {}
    return out


# ---------------------------------------------------------------- summary


def measured_rows(name: str, shape: dict, world: int, timed: list[dict]) -> list[dict]:
    """A's rows for one model from every rank's results."""
    units = gpt_units(shape)
    rows = {}
    for c, r0 in timed[0].items():
        formula = layout_bytes(units, world, CONFIGS[c])
        if r0["shards"] != formula["shards"]:
            what = f"the units' shard sizes {r0['shards']} (opt.units) are not the layout formula's"
            raise RuntimeError(f"{name}, {c}: {what} {formula['shards']}")
        gather, reduce = (statistics.median(sent[i] for sent in r0["sent"]) for i in (0, 1))
        row = timed_row(c, [t[c] for t in timed])
        del row["zero_grad ms"]
        rows[c] = {"model": name, **row, "gather MiB": gather / 2**20, "reduce MiB": reduce / 2**20}
        rows[c].update(
            {"total MiB": (gather + reduce) / 2**20, "layout check": (gather + reduce) / formula["total"]}
        )
    for row in rows.values():
        for base in ("fp32", "bf16"):
            if base in rows:
                row[f"x {base}"] = row["total MiB"] / rows[base]["total MiB"]
        if "fp32" in rows:
            row["train x fp32"] = median_ratio(row["_train"], rows["fp32"]["_train"])
    for row in rows.values():
        del row["_train"], row["_step"]
        if row["config"] == BOTH:
            row[GOALS[0]] = row.get("x fp32", math.inf) <= GOAL_FP32
            row[GOALS[1]] = row.get("x bf16", math.inf) <= GOAL_BF16
    return list(rows.values())


def demo_rows(demo: dict) -> list[dict]:
    rows = []
    for (name, config), r in demo.items():
        base = demo.get((name, "fp32"))
        row = {"optimizer": name, "config": config, "train loss": r["final_loss"], "val loss": r["val_loss"]}
        row["train s"] = r["train_time_s"]
        if base is not None:
            row["Δ train %"] = 100 * (r["final_loss"] - base["final_loss"]) / base["final_loss"]
            row["Δ val %"] = 100 * (r["val_loss"] - base["val_loss"]) / base["val_loss"]
            row["within 1 %"] = max(abs(row["Δ train %"]), abs(row["Δ val %"])) <= 100 * GOAL_LOSS
            row["same init"] = r["init_params_sha256"] == base["init_params_sha256"]
        rows.append(row)
    return rows


def _print(rows: list[dict], demo_table: list[dict], scale: list[dict], run: dict) -> None:
    kind = "quick: tiny models, " if run["quick"] else ""
    print(
        f"\n## A. Bytes per step and rank (step_stats) and step time ({kind}W={run['world']}, AdamW ZeRO-3,"
    )
    print(f"{run['steps']} rounds after {run['warmup']} warm-up)\n")
    print(table(rows, ["model", "config", "params", *MEASURED[:6], *GOALS, *MEASURED[6:]]))
    print(f"\ngoal: {BOTH} <= {GOAL_FP32}x the bytes of fp32 and <= {GOAL_BF16}x those of bf16 (param_dtype")
    print("bf16, default reduce_dtype). Time on CPU gloo: the quantize kernels are compute on few cores, the")
    print("wire a memcpy; the bytes are what carries to a network.")
    if demo_table:
        steps = run["demo"]["steps"]
        print(f"\n## B. The demo's loss after {steps} steps (W={run['world']}; train: mean of its last 10")
        print("steps; val: after training)\n")
        columns = ["optimizer", "config", "train loss", "val loss", "Δ train %", "Δ val %", "within 1 %"]
        print(table(demo_table, [*columns, "same init", "train s"]))
    print("\n## C. Model scale from the library's layout (ring collectives; no processes)\n")
    columns = ["model", "W", "config", "params", "gather GB", "reduce GB", "total GB", "x fp32", "x bf16"]
    print(table(scale, [*columns, *BANDWIDTH, "padding %"]))
    print("\nper rank and step: layers gathered twice (fwd, bwd), the outermost unit once, every unit")
    print("reduced once; a collective of b bytes per rank sends (W-1)*b; b = S*dtype bytes, or S + 4*S/256")
    print("in 8-bit; time = bytes / bandwidth (no latency, no overlap)")


def main(argv: list[str] | None = None) -> dict:
    args = parse(
        __doc__,
        argv,
        "tiny models and demo, 2 ranks, a few steps",
        world_size=dict(type=int, help="default 4 (--quick: 2)"),
        steps=dict(type=int, help="measured rounds (default 5, --quick 2)"),
        warmup=1,
        models=dict(nargs="+", choices=list(MODELS), help="default: both"),
        demo_steps=dict(type=int, help="default 200 (--quick 12); 0: no demo runs"),
        demo_optimizers=dict(nargs="+", default=DEMO_OPTIMIZERS, choices=DEMO_CHOICES),
        demo_configs=dict(nargs="+", default=DEMO_CONFIGS, choices=list(CONFIGS)),
    )
    world = args.world_size or (2 if args.quick else 4)
    steps = args.steps or (2 if args.quick else 5)
    shapes = {m: (QUICK if args.quick else MODELS)[m] for m in (args.models or list(MODELS))}
    demo = dict(DEMO_QUICK if args.quick else DEMO)
    if args.demo_steps is not None:
        demo["steps"] = args.demo_steps
    configs = list(dict.fromkeys(["fp32", *args.demo_configs]))
    runs = [(o, c) for o in args.demo_optimizers for c in configs] if demo["steps"] else []
    t0 = time.perf_counter()
    preload = ["benchmarks.qcomm", "vescale_optim.demo.train"]
    out = launch(_ranks, world, shapes, (args.warmup, steps), demo if runs else None, runs, preload=preload)
    wall = time.perf_counter() - t0
    rows = [r for m in shapes for r in measured_rows(m, shapes[m], world, [o["timed"][m] for o in out])]
    demo_table, scale = demo_rows(out[0]["demo"]), scale_rows(SCALE)
    require_finite(rows, MEASURED)
    require_finite(demo_table, ["train loss", "val loss", "Δ train %", "Δ val %"])
    require_finite(scale, ["total GB", "x fp32", "x bf16", *BANDWIDTH])
    run = dict(world=world, steps=steps, warmup=args.warmup, shapes=shapes, demo=demo if runs else None)
    run["quick"] = args.quick
    _print(rows, demo_table, scale, run)
    goals = {f"{r['model']}: {BOTH} {g}": r[g] for r in rows if r["config"] == BOTH for g in GOALS}
    for r in demo_table:
        if r["config"] != "fp32" and "within 1 %" in r:
            goals[f"demo {r['optimizer']}: {r['config']} within 1 %"] = r["within 1 %"]
    result = {**run, "rows": rows, "demo_rows": demo_table, "scale_rows": scale, "goals": goals}
    result["wall_s"] = wall
    print(f"goals: {goals}\n({wall:.0f} s in the ranks)")
    return finish("qcomm", args, result, out.threads)


if __name__ == "__main__":
    main()
