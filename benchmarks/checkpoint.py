"""Checkpoints: `vescale_optim.checkpoint.CheckpointManager` against FSDP2 + `torch.distributed.checkpoint`.

Both sides train their own copy of the same seeded GPT (~5.3 M fp32 parameters: an AdamW checkpoint
of ~64 MB) on the same per-rank batches, on gloo. Ours: ZeRO-3 `vo.AdamW` (or `vo.Muon`) saved by
`CheckpointManager(dir, model, opt, keep=None)` (`async_save=True` for the asynchronous saves).
Peer: `benchmarks._optim.fsdp2`'s model and optimizers, saved by `get_state_dict` + `dcp.save`,
loaded by `dcp.load` + `set_state_dict`, asynchronously by `dcp.async_save` over a gloo group of its
own. Both write with DCP's `FileSystemWriter` (files fsynced); ours also writes a manifest, renames
the folder and checks metadata and sizes before a load.

In one world per W, the sides taking turns (the order rotating): `save ms`, `load ms` the slowest
rank's call after a barrier, the median over `--rounds` (a load reads what was just written);
`x` ours / peer, the median of per-round ratios. `checksum save x` / `checksum load x`: ours
against ours with `verify=False` (no CRC-32 written or read), which takes its turn too. `MB/rank`:
each rank's DCP data files; `B/param`: all of them per parameter (AdamW fp32: 12); `meta KB` the
rest of the folder. Async: cycles of `--every` steps without saving or with an asynchronous save in
the first step and a wait at the end (a save every k steps in steady state), interleaved; `async %`
the median over cycles of (with / without) - 1, `stage ms` the save call itself (AdamW only by
default: FSDP2 + `torch.optim.Muon` steps slowly on CPU). Before timing, each side saves, trains a
step and loads: the loss must be back to its value at the save (`restored`).

    python benchmarks/checkpoint.py                  # W = 2 and 4, AdamW and Muon (~3 min on 2 busy cores)
    python benchmarks/checkpoint.py --quick          # tiny model, W = 2, AdamW (a smoke test)
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402

from benchmarks._gpt import launch, random_batch  # noqa: E402
from benchmarks._main import finish, parse  # noqa: E402
from benchmarks._measure import load_average, median_ratio, slowest  # noqa: E402
from benchmarks._optim import ours, peer  # noqa: E402
from benchmarks._report import FSDP2_ON_CPU, pyplot, save_png, table  # noqa: E402
from benchmarks._train import Trainer, barrier_timed  # noqa: E402
from vescale_optim.checkpoint import CheckpointManager  # noqa: E402

MODEL = dict(vocab=4096, d_model=256, n_layers=4, n_heads=4, seq_len=64, batch=2, seq=64)
QUICK = dict(vocab=256, d_model=64, n_layers=2, n_heads=4, seq_len=16, batch=2, seq=16)
PRELOAD = ["benchmarks.checkpoint"]  # besides benchmarks._gpt.PEERS
SIDES = ("ours", "peer")


class _Side(Trainer):
    """One side: its model copy and optimizer (a `Trainer`, the family `optim` its config);
    subclasses say how they checkpoint into `root`."""

    def __init__(self, shape: dict, optim: str, root: Path):
        self.root = root
        super().__init__(optim, shape)


class Ours(_Side):
    def optimizer(self, model: torch.nn.Module):
        opt = ours(model, self.config, shard_modules=[*model.blocks, model])
        sync = CheckpointManager(self.root / "sync", model, opt, keep=None)
        background = CheckpointManager(self.root / "async", model, opt, keep=None, async_save=True)
        unverified = CheckpointManager(self.root / "unverified", model, opt, keep=None, verify=False)
        self.save, self.load = sync.save, sync.load
        self.save_unverified, self.load_unverified = unverified.save, unverified.load
        self.save_async, self.wait = background.save, background.wait
        return opt


class Peer(_Side):
    def optimizer(self, model: torch.nn.Module):
        opt = peer(model, "FSDP2", self.config)[1]
        self.opts = list(getattr(opt, "opts", [opt]))  # DCP's state dict takes torch's optimizers
        self.group = dist.new_group(backend="gloo")
        self.pending = None
        return opt

    def _state(self) -> dict:
        model, optim = get_state_dict(self.model, self.opts)
        return {"model": model, "optim": optim}

    def save(self, step: int) -> Path:
        path = self.root / "sync" / f"step-{step}"
        dcp.save(self._state(), checkpoint_id=path)
        return path

    def load(self, step: int) -> None:
        state = self._state()
        dcp.load(state, checkpoint_id=self.root / "sync" / f"step-{step}")
        set_state_dict(
            self.model, self.opts, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )

    def save_async(self, step: int) -> Path:
        self.wait()
        path = self.root / "async" / f"step-{step}"
        self.pending = dcp.async_save(self._state(), checkpoint_id=path, process_group=self.group)
        return path

    def wait(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()


# ---------------------------------------------------------------- the ranks


def _remove(rank: int, path: Path) -> None:
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def _bytes(rank: int, path: Path) -> dict:
    """This rank's data files; on rank 0 also the rest of the folder (metadata, manifest)."""
    files = [f for f in path.iterdir() if f.is_file()]
    mine = sum(f.stat().st_size for f in files if f.name.startswith(f"__{rank}_") and f.suffix == ".distcp")
    other = sum(f.stat().st_size for f in files if f.suffix != ".distcp") if rank == 0 else 0
    return {"data": mine, "meta": other}


def _check(rank: int, side: _Side, x, y) -> dict:
    """Save, train a step, load: the loss on (x, y) must be back to its value at the save."""
    saved = side.eval_loss(x, y)
    path = side.save(0)
    side.step(x, y, record=False)
    moved = side.eval_loss(x, y)
    side.load(0)
    after = side.eval_loss(x, y)
    _remove(rank, path)
    return {"saved": saved, "moved": moved, "loaded": after}


def _rounds(rank: int, sides: dict, out: dict, rounds: int) -> None:
    """Save and load rounds, the sides and ours without checksums taking turns (the order rotating)."""
    turns = [*SIDES, "unverified"]  # the last: ours without checksums
    for r in range(1, rounds + 1):
        for s in turns[r % 3 :] + turns[: r % 3]:
            if s == "unverified":
                ours = sides["ours"]
                t, path = barrier_timed(ours.save_unverified, r)
                out["ours"]["save_unverified"].append(t)
                out["ours"]["load_unverified"].append(barrier_timed(ours.load_unverified, r)[0])
                _remove(rank, path)
                continue
            side, res = sides[s], out[s]
            t, path = barrier_timed(side.save, r)
            res["save"].append(t)
            dist.barrier()
            b = _bytes(rank, path)
            res["data"].append(b["data"])
            res["meta"].append(b["meta"])
            res["load"].append(barrier_timed(side.load, r)[0])
            _remove(rank, path)


def _async_cycles(rank: int, sides: dict, out: dict, batches: list, cycles: int, every: int) -> None:
    """Cycles of `every` steps of each side, without saving or with an asynchronous save, interleaved."""
    variants = [(s, a) for s in SIDES for a in (False, True)]
    for c in range(cycles):
        k = c % len(variants)
        for s, save in variants[k:] + variants[:k]:
            side, steps, path = sides[s], [], None
            for i in range(every):
                dist.barrier()
                t0 = time.perf_counter()
                if save and i == 0:
                    path = side.save_async(1000 + c)
                    out[s]["stage"].append(time.perf_counter() - t0)
                side.step(*batches[i % 2], record=False)
                steps.append(time.perf_counter() - t0)
            if save:
                steps.append(barrier_timed(side.wait)[0])
                _remove(rank, path)
            out[s]["async" if save else "plain"].append(steps)


def _rank_main(rank: int, world: int, shape: dict, optims: list[str], run: dict, root: str) -> dict:
    """Each optimizer in turn: both sides built and checked, then the rounds and the cycles."""
    out = {}
    for optim in optims:
        where = Path(root) / optim
        sides = {"ours": Ours(shape, optim, where / "ours"), "peer": Peer(shape, optim, where / "peer")}
        batches = [
            random_batch(shape["batch"], shape["seq"], shape["vocab"], seed=100 * rank + i) for i in (0, 1)
        ]
        for side in sides.values():
            for b in batches:  # optimizer state exists
                side.step(*b, record=False)
        keys = ["save", "load", "data", "meta", "plain", "async", "stage"]
        res = {
            s: {"params": side.params, "check": _check(rank, side, *batches[0])} for s, side in sides.items()
        }
        for s in SIDES:
            res[s].update({k: [] for k in keys})
        res["ours"].update(save_unverified=[], load_unverified=[])
        _rounds(rank, sides, res, run["rounds"])
        _async_cycles(rank, sides, res, batches, run["cycles"][optim], run["every"])
        out[optim] = res
    return out


# ---------------------------------------------------------------- summary


def _cycles(per_rank: list[list[list[float]]]) -> list[float]:
    """Each cycle's time: the sum over its steps of the slowest rank's."""
    return [sum(slowest(list(steps))) for steps in zip(*per_rank)]


def summarize(world: int, optim: str, per_rank: list[dict]) -> dict:
    """One row: ours against the peer at this W and optimizer."""
    side = {s: {k: [r[s][k] for r in per_rank] for k in per_rank[0][s]} for s in SIDES}
    row: dict = {"W": world, "optimizer": optim, "params": per_rank[0]["ours"]["params"]}
    raw: dict = {}
    for s in SIDES:
        d, p = side[s], "" if s == "ours" else "peer "
        save, load = slowest(d["save"]), slowest(d["load"])
        data = statistics.median(sum(col) for col in zip(*d["data"]))  # all ranks, per round
        plain, cycle = _cycles(d["plain"]), _cycles(d["async"])
        if plain:
            row[f"{p}async %"] = 100 * (median_ratio(cycle, plain) - 1)
            row[f"{p}stage ms"] = 1e3 * statistics.median(slowest(d["stage"]))
            row[f"{p}step ms"] = 1e3 * statistics.median(plain) / len(d["plain"][0][0])
        raw[s] = {"save_s": save, "load_s": load, "plain_cycle_s": plain, "async_cycle_s": cycle}
        raw[s].update(data_bytes_by_rank=[statistics.median(b) for b in d["data"]], check=d["check"])
        row.update(
            {f"{p}save ms": 1e3 * statistics.median(save), f"{p}load ms": 1e3 * statistics.median(load)}
        )
        row.update({f"{p}MB/rank": data / world / 2**20, f"{p}B/param": data / row["params"]})
        row[f"{p}meta KB"] = statistics.median(d["meta"][0]) / 1024
        row[f"{s} restored"] = all(c["loaded"] == c["saved"] != c["moved"] for c in d["check"])
    plain_save = slowest(side["ours"]["save_unverified"])
    plain_load = slowest(side["ours"]["load_unverified"])
    raw["ours"].update(unverified_save_s=plain_save, unverified_load_s=plain_load)
    row["unverified save ms"] = 1e3 * statistics.median(plain_save)
    row["unverified load ms"] = 1e3 * statistics.median(plain_load)
    row["checksum save x"] = median_ratio(raw["ours"]["save_s"], plain_save)
    row["checksum load x"] = median_ratio(raw["ours"]["load_s"], plain_load)
    row["save x"] = median_ratio(raw["ours"]["save_s"], raw["peer"]["save_s"])
    row["load x"] = median_ratio(raw["ours"]["load_s"], raw["peer"]["load_s"])
    row["bytes x"] = row["MB/rank"] / row["peer MB/rank"]
    row["restored"] = "/".join("yes" if row[f"{s} restored"] else "NO" for s in SIDES)
    row["raw"] = raw
    return row


TIMES = "W|optimizer|params|save ms|peer save ms|save x|load ms|peer load ms|load x|MB/rank|peer MB/rank"
TIMES = [*TIMES.split("|"), "bytes x", "B/param", "peer B/param", "meta KB", "peer meta KB", "restored"]
CHECKSUM = ["W", "optimizer", "MB/rank", "save ms", "unverified save ms", "checksum save x", "load ms"]
CHECKSUM += ["unverified load ms", "checksum load x"]
ASYNC = ["W", "optimizer", "step ms", "peer step ms", "async %", "peer async %", "stage ms", "peer stage ms"]


def plot(rows: list[dict]) -> Path | None:
    """Save and load time of both sides per (W, optimizer); async overhead where timed."""
    plt = pyplot()
    if plt is None:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    names = lambda rs: [f"W={r['W']} {r['optimizer']}" for r in rs]  # noqa: E731
    bars = [(f"{p}{op} ms", f"{p or 'ours '}{op}") for op in ("save", "load") for p in ("", "peer ")]
    for j, (key, label) in enumerate(bars):
        left.bar([i + 0.2 * j for i in range(len(rows))], [r[key] for r in rows], 0.2, label=label)
    left.set(xticks=[i + 0.3 for i in range(len(rows))], xticklabels=names(rows), ylabel="ms (median)")
    left.legend(fontsize=8)
    timed = [r for r in rows if "async %" in r]
    for j, (key, label) in enumerate([("async %", "ours"), ("peer async %", "peer")]):
        right.bar([i + 0.3 * j for i in range(len(timed))], [r[key] for r in timed], 0.3, label=label)
    ticks = [i + 0.15 for i in range(len(timed))]
    right.set(
        xticks=ticks,
        xticklabels=names(timed),
        ylabel="step-time overhead %",
        title="async save every k steps",
    )
    right.legend(fontsize=8)
    return save_png("checkpoint", fig)


def main(argv: list[str] | None = None) -> dict:
    families = ["AdamW", "Muon"]
    args = parse(
        __doc__,
        argv,
        "tiny model, W = 2, AdamW, few rounds",
        world_sizes=dict(type=int, nargs="+", help="default 2 4 (--quick: 2)"),
        optims=dict(nargs="+", choices=families, help="default both (--quick: AdamW)"),
        rounds=dict(type=int, help="save + load rounds per side (default 6, --quick 2)"),
        cycles=dict(type=int, help="async cycles per variant (default 5, --quick 2)"),
        async_optims=dict(nargs="*", choices=families, default=["AdamW"], help="whose async saves are timed"),
        every=dict(type=int, help="steps per async cycle: a save every k steps (default 5)"),
        dir=dict(help="where checkpoints go (in a temporary folder; default: the system's)"),
    )
    q = args.quick
    worlds = args.world_sizes or ([2] if q else [2, 4])
    optims = args.optims or (["AdamW"] if q else ["AdamW", "Muon"])
    rounds = args.rounds or (2 if q else 6)
    cycles = {o: (args.cycles or (2 if q else 5)) if o in args.async_optims else 0 for o in optims}
    every = args.every or (2 if q else 5)
    shape = QUICK if q else MODEL
    t0, log = time.perf_counter(), lambda msg: print(f"# {msg}", file=sys.stderr, flush=True)
    root = Path(tempfile.mkdtemp(prefix="vo-ckpt-bench-", dir=args.dir))
    rows, loads, threads = [], {}, []
    run = dict(rounds=rounds, cycles=cycles, every=every)
    try:
        for w in worlds:
            before = load_average()
            res = launch(_rank_main, w, shape, optims, run, str(root / f"W{w}"), preload=PRELOAD)
            loads[w] = {"before": before, "after": load_average()}
            threads += res.threads
            rows += [summarize(w, o, [r[o] for r in res]) for o in optims]
            log(f"W={w}: {time.perf_counter() - t0:.0f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\nsave / load / bytes per rank, ours (ZeRO-3 + CheckpointManager) vs FSDP2 + DCP;")
    print(f"x = ours / peer, medians of {rounds} rounds\n")
    print(table(rows, TIMES))
    print("\nthe checksum's cost: ours (a CRC-32 of every file written, checked on load) vs ours with")
    print("verify=False (sizes only); x = with / without, medians of the per-round ratios\n")
    print(table(rows, CHECKSUM))
    print(f"\n{FSDP2_ON_CPU}")
    if timed := [r for r in rows if "async %" in r]:
        print(f"\nasync saving every {every} steps: step-time overhead vs no saving, medians of")
        print(f"{max(cycles.values())} cycles\n")
        print(table(timed, ASYNC))
    loads_said = "; ".join(f"W={w}: {v['before']} -> {v['after']}" for w, v in loads.items())
    print(f"\nload average (1, 5, 15 min): {loads_said}")
    result = {"shape": shape, **run, "load_average": loads, "rows": rows, "wall_s": time.perf_counter() - t0}
    return finish("checkpoint", args, result, threads, png=plot(rows), quick_suffix=False)


if __name__ == "__main__":
    from benchmarks.checkpoint import main as _main

    _main()
