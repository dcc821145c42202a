"""8-bit unit collectives (`gather_bits=8`, `reduce_bits=8`, `comm_block=256`) against full
precision: bytes per step and rank, step time, the demo's loss, and the bytes at model scale.

Configurations, each `vo.AdamW(model.parameters(), **ADAMW, shard_modules=[*model.blocks, model])`
(ZeRO-3: every block a unit, the model the outermost one) with:

* `fp32`                - nothing more: parameters gathered and gradients reduced in fp32
* `bf16`                - `param_dtype=torch.bfloat16` (and the default `reduce_dtype`, the same):
                          parameters gathered and gradients reduced in bf16
* `gather 8-bit`        - `gather_bits=8`: each unit all-gathered as int8 codes + fp32 block scales
* `gather+reduce 8-bit` - `gather_bits=8, reduce_bits=8`: the gradients reduced by qgZ's
                          all-to-all of 8-bit pieces too

A. Measured, on `--world-size` gloo ranks (default 4), the models of benchmarks/fsdp.py
(`gpt`, the benchmark GPT; `wide`, the parameter-heavy one), every configuration in one world,
one step each in turn with the order rotating (`benchmarks._train.interleave`). Bytes are
`opt.step_stats["gather_bytes"]` and `["reduce_bytes"]` (what a rank sent in the units'
all-gathers and gradient reductions since the previous step; the median over the recorded
steps of rank 0's), in MiB; `x fp32` / `x bf16` are the total against that configuration's.
`layout check` is the measured total over the one computed without processes by the formula
of C from the same models' parameter sizes (1.000: the formula is what the library sends).
Times: each phase timed after a barrier (`benchmarks._train.train_step`); `train ms` is the
median over the rounds of the slowest rank's fwd + bwd + step + zero_grad, `train x fp32` the
median of the per-round ratios to `fp32`. On few CPU cores the quantize/dequantize kernels are
compute on the critical path while gloo's memcpy-speed "wire" costs little, so 8-bit is not
expected to be faster here: the bytes are the number that carries to a real network.
`loss after`: the loss on rank 0's first batch after training (every configuration must lower it).

B. The demo (`python -m vescale_optim.demo`, which has no flag for the bits): its own training
loop (`vescale_optim.demo.train.train_one`: its model, data, batches, LR schedule, clipping and
reported losses) for `adamw` and `muon`, with the demo's optimizer factories, the configuration's
keywords passed as `TrainConfig(sharding=...)` (the demo's own way to add sharding keywords).
`train loss` is the demo's: the mean over its last 10 steps, `val loss` after training; `Δ` is
against `fp32`; goal: within 1 %.

C. Model scale, no processes: Llama-3-70B (benchmarks/model_shapes.py) at W = 1024 as the
runtime plans it (vescale_optim/units/runtime.py: every decoder layer a unit, the embedding,
final norm and head the outermost one; AdamW's granule 1, joined with `comm_block` when a
collective is 8-bit: a multiple of both, or the whole tensor on one rank when that does not divide
it, and the block alignment; `plan_layout`), and the shard size S of each unit. A checks this
formula against the ranks: every unit's shard size (`opt.units`, `unit.layout.shard_size`) must be
the formula's, and the bytes counted in `step_stats` the formula's bytes. Ring collectives: a
rank sends (W-1)·b bytes per all-gather or reduce-scatter (or qgZ all-to-all) of a unit whose
per-rank piece is b bytes: b = S·size of the dtype, or `packed_numel(S, 256)` = S + 4·S/256 for
8-bit. Per step every decoder layer is gathered twice (forward, and again for backward:
`reshard_after_forward=True`), the outermost unit once, and every unit's gradients reduced once.
Time = bytes / bandwidth (bandwidth term only: no latency, no overlap with compute; links full
duplex, so what a rank receives rides beside what it sends): 400 Gb/s (50 GB/s) per GPU, and 900
GB/s NVLink. 8-bit bytes do not depend on `param_dtype` (the shards are fp32 masters, the codes
8-bit either way).

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
from benchmarks._measure import median_ratio, slowest  # noqa: E402
from benchmarks._optim import ours  # noqa: E402
from benchmarks._report import require_finite, table  # noqa: E402
from benchmarks._train import PHASES, batches, interleave, ms  # noqa: E402
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
DEMO_QUICK = dict(steps=12, batch_size=2, seq_len=32, d_model=32, n_layers=1, n_heads=2, warmup=3,
                  val_tokens=512)  # fmt: skip
SCALE = [("llama3-70b", 1024)]
BANDWIDTH = {"s @ 400 Gb/s": 400e9 / 8, "s @ 900 GB/s": 900e9}
MEASURED = ["gather MiB", "reduce MiB", "total MiB", "x fp32", "x bf16", "layout check",
            "fwd ms", "bwd ms", "step ms", "train ms", "train x fp32", "loss after"]  # fmt: skip
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
        layout = plan_layout(sizes, granules, world, math.lcm(ALIGN, block), aligns=aligns,
                             segments=[(0, "fp32")] * len(sizes))  # fmt: skip
        s = layout.shard_size
        shards.append(s)
        passes = root_gathers if k == len(units) - 1 else 2
        gather += passes * (world - 1) * (wire_width(config, "gather_bits", s) or s * elem)
        reduce += (world - 1) * (wire_width(config, "reduce_bits", s) or s * reduce_elem)
        padding += layout.padding
    return {"gather": gather, "reduce": reduce, "total": gather + reduce, "shards": shards,
            "padding %": 100 * padding / sum(map(sum, units))}  # fmt: skip


def gpt_units(shape: dict) -> list[list[int]]:
    """A benchmark GPT's parameter sizes by unit: each block, then the rest (the model)."""
    model = shaped_gpt(shape, device="meta")
    blocks = [[p.numel() for p in b.parameters()] for b in model.blocks]
    inner = {id(p) for b in model.blocks for p in b.parameters()}
    return [*blocks, [p.numel() for p in model.parameters() if id(p) not in inner]]


def shapes_units(name: str) -> list[list[int]]:
    """A model of benchmarks/model_shapes.py by unit: each decoder layer, then the embedding,
    final norm and head (the outermost unit)."""
    blocks = model_shapes.MODELS[name]()
    return [[model_shapes.numel(s) for _, s in b] for b in blocks[1:-1]] + [
        [model_shapes.numel(s) for b in (blocks[0], blocks[-1]) for _, s in b]
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
            seconds = {k: b["total"] / bw for k, bw in BANDWIDTH.items()}
            row = {"model": name, "W": world, "config": c, "params": sum(map(sum, units)),
                   "gather GB": b["gather"] / 1e9, "reduce GB": b["reduce"] / 1e9,
                   "total GB": b["total"] / 1e9, "x fp32": b["total"] / got["fp32"]["total"],
                   "x bf16": b["total"] / got["bf16"]["total"], **seconds,
                   "padding %": b["padding %"]}  # fmt: skip
            rows.append(row)
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
        out[(name, config)] = {k: r[k] for k in ("final_loss", "val_loss", "train_time_s", "tokens_per_s",
                                                 "init_params_sha256")}  # fmt: skip
    return out


def _ranks(rank: int, world: int, models: dict, configs: list[str], warmup: int, steps: int,
           demo: dict | None, runs: list[tuple[str, str]]) -> dict:  # fmt: skip
    out = {"timed": {}}
    for name, shape in models.items():
        pool = batches(shape, rank, world)
        trainers = [Trainer(c, shape) for c in configs]
        interleave(trainers, pool, warmup, steps)
        out["timed"][name] = {tr.config: {"params": tr.params, "times_s": tr.times, "sent": tr.sent,
                                          "shards": tr.shards,
                                          "loss_first": tr.losses[0], "loss_after": tr.eval_loss(*pool[0])}
                              for tr in trainers}  # fmt: skip
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
        res = [t[c] for t in timed]
        gather = statistics.median(g for g, _ in r0["sent"])
        reduce = statistics.median(r for _, r in r0["sent"])
        phases = {k: slowest([r["times_s"][k] for r in res]) for k in PHASES}
        formula = layout_bytes(units, world, CONFIGS[c])
        if r0["shards"] != formula["shards"]:
            raise RuntimeError(f"{name}, {c}: the units' shard sizes {r0['shards']} (opt.units) are not the "
                               f"layout formula's {formula['shards']}")  # fmt: skip
        rows[c] = {"model": name, "config": c, "params": r0["params"],
                   "gather MiB": gather / 2**20, "reduce MiB": reduce / 2**20,
                   "total MiB": (gather + reduce) / 2**20,
                   "layout check": (gather + reduce) / formula["total"],
                   **{f"{k} ms": ms(v) for k, v in phases.items() if k != "zero_grad"},
                   "_train": [sum(t) for t in zip(*phases.values())],
                   "loss first": statistics.mean(r["loss_first"] for r in res),
                   "loss after": statistics.mean(r["loss_after"] for r in res)}  # fmt: skip
    for row in rows.values():
        row["train ms"] = ms(row["_train"])
        for base in ("fp32", "bf16"):
            if base in rows:
                row[f"x {base}"] = row["total MiB"] / rows[base]["total MiB"]
        if "fp32" in rows:
            row["train x fp32"] = median_ratio(row["_train"], rows["fp32"]["_train"])
    for row in rows.values():
        del row["_train"]
        if row["config"] == BOTH:
            row[GOALS[0]] = row.get("x fp32", math.inf) <= GOAL_FP32
            row[GOALS[1]] = row.get("x bf16", math.inf) <= GOAL_BF16
    return list(rows.values())


def demo_rows(demo: dict) -> list[dict]:
    rows = []
    for (name, config), r in demo.items():
        base = demo.get((name, "fp32"))
        row = {"optimizer": name, "config": config, "train loss": r["final_loss"], "val loss": r["val_loss"],
               "train s": r["train_time_s"]}  # fmt: skip
        if base is not None:
            row["Δ train %"] = 100 * (r["final_loss"] - base["final_loss"]) / base["final_loss"]
            row["Δ val %"] = 100 * (r["val_loss"] - base["val_loss"]) / base["val_loss"]
            row["within 1 %"] = max(abs(row["Δ train %"]), abs(row["Δ val %"])) <= 100 * GOAL_LOSS
            row["same init"] = r["init_params_sha256"] == base["init_params_sha256"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    args = parse(__doc__, argv, "tiny models and demo, 2 ranks, a few steps",
                 world_size=dict(type=int, help="default 4 (--quick: 2)"),
                 steps=dict(type=int, help="measured rounds (default 5, --quick 2)"), warmup=1,
                 models=dict(nargs="+", choices=list(MODELS), help="default: both"),
                 demo_steps=dict(type=int, help="default 200 (--quick 12); 0: no demo runs"),
                 demo_optimizers=dict(nargs="+", default=DEMO_OPTIMIZERS, choices=DEMO_CHOICES),
                 demo_configs=dict(nargs="+", default=DEMO_CONFIGS, choices=list(CONFIGS)))  # fmt: skip
    world = args.world_size or (2 if args.quick else 4)
    steps = args.steps or (2 if args.quick else 5)
    shapes = {m: (QUICK if args.quick else MODELS)[m] for m in (args.models or list(MODELS))}
    demo = dict(DEMO_QUICK if args.quick else DEMO)
    if args.demo_steps is not None:
        demo["steps"] = args.demo_steps
    configs = list(dict.fromkeys(["fp32", *args.demo_configs]))
    runs = [(o, c) for o in args.demo_optimizers for c in configs] if demo["steps"] else []
    t0 = time.perf_counter()
    out = launch(_ranks, world, shapes, list(CONFIGS), args.warmup, steps, demo if runs else None, runs,
                 preload=["benchmarks.qcomm", "vescale_optim.demo.train"])  # fmt: skip
    wall = time.perf_counter() - t0
    rows = [r for m in shapes for r in measured_rows(m, shapes[m], world, [o["timed"][m] for o in out])]
    demo_table = demo_rows(out[0]["demo"])
    scale = scale_rows(SCALE)
    require_finite(rows, MEASURED)
    require_finite(demo_table, ["train loss", "val loss", "Δ train %", "Δ val %"])
    require_finite(scale, ["total GB", "x fp32", "x bf16", *BANDWIDTH])

    kind = "quick: tiny models, " if args.quick else ""
    print(f"\n## A. Bytes per step and rank (step_stats) and step time ({kind}W={world}, AdamW ZeRO-3, "
          f"{steps} rounds after {args.warmup} warm-up)\n")  # fmt: skip
    print(table(rows, ["model", "config", "params", *MEASURED[:6], *GOALS, *MEASURED[6:]]))
    print(f"\ngoal: {BOTH} <= {GOAL_FP32}x the bytes of fp32 and <= {GOAL_BF16}x those of bf16 (param_dtype "
          "bf16, default reduce_dtype). Time on CPU gloo: the quantize kernels are compute on few cores, the "
          "wire a memcpy; the bytes are what carries to a network.")  # fmt: skip
    if demo_table:
        print(f"\n## B. The demo's loss after {demo['steps']} steps (W={world}; train: mean of its last 10 "
              "steps; val: after training)\n")  # fmt: skip
        print(table(demo_table, ["optimizer", "config", "train loss", "val loss", "Δ train %", "Δ val %",
                                 "within 1 %", "same init", "train s"]))  # fmt: skip
    print("\n## C. Model scale from the library's layout (ring collectives; no processes)\n")
    print(table(scale, ["model", "W", "config", "params", "gather GB", "reduce GB", "total GB", "x fp32",
                        "x bf16", *BANDWIDTH, "padding %"]))  # fmt: skip
    print("\nper rank and step: layers gathered twice (fwd, bwd), the outermost unit once, every unit "
          "reduced once; a collective of b bytes per rank sends (W-1)*b; b = S*dtype bytes, or S + 4*S/256 "
          "in 8-bit; time = bytes / bandwidth (no latency, no overlap)")  # fmt: skip
    goals = {f"{m}: {BOTH} {g}": r[g] for m in shapes for r in rows if r["model"] == m and r["config"] == BOTH
             for g in GOALS}  # fmt: skip
    goals.update({f"demo {r['optimizer']}: {r['config']} within 1 %": r["within 1 %"]
                  for r in demo_table if r["config"] != "fp32" and "within 1 %" in r})  # fmt: skip
    result = {"world": world, "steps": steps, "warmup": args.warmup, "shapes": shapes,
              "demo": demo if runs else None, "rows": rows, "demo_rows": demo_table, "scale_rows": scale,
              "goals": goals, "quick": args.quick, "wall_s": wall}  # fmt: skip
    print(f"goals: {goals}\n({wall:.0f} s in the ranks)")
    return finish("qcomm", args, result, out.threads)


if __name__ == "__main__":
    main()
