"""What the FSDP and HSDP benchmarks' reports share: the columns measured on the device, the note
beside a time table, and the end: the goals met or not, the loss check against the FSDP2 peer, and
the JSON (and plot) written.

    print(table(rows, shown(TIME, rows, run)))               # on CUDA only the columns measured there
    time_note(run, "exposed comm", "fsdp.py")                 # what CUDA leaves out, or FSDP2 on CPU
    return verdict("fsdp", rows, run, goals, "W=4", "FSDP2", plot=lambda name: _plot(rows, name))
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from benchmarks._main import print_goals
from benchmarks._measure import load_average
from benchmarks._report import FSDP2_ON_CPU, environment, save_json

__all__ = ["LOSS_TOL", "loss_check", "shape_words", "shown", "time_note", "verdict"]

# Relative. Muon: Newton-Schulz runs in bf16, and FSDP2's runs on DTensor shards (sums in another
# order), so the updates differ by bf16 rounding.
LOSS_TOL = {"AdamW": 1e-4, "Muon": 1e-2}


def shape_words(shape: dict) -> str:
    """A benchmark GPT's shape and its tokens per rank and step, in words."""
    model = f"vocab {shape['vocab']}, d {shape['d_model']}, {shape['n_layers']} layers"
    return f"({model}), {shape['batch']}x{shape['seq']} tokens/rank/step"


def shown(columns: list[str], rows: list[dict], run: dict) -> list[str]:
    """The columns a table shows: on CUDA only those measured there (the scripts' docstrings say why)."""
    return [c for c in columns if any(c in r for r in rows)] if run.get("device") == "cuda" else columns


def time_note(run: dict, missing: str, script: str) -> None:
    """Print what a time table's numbers are on this device: on CUDA, that `missing` (columns) are
    not measured there; on CPU, what FSDP2's synchronous collectives mean for a ratio."""
    if run.get("device") == "cuda":
        print("\nCUDA: each phase timed until the device finished it; FSDP2 overlaps on its own streams;")
        print(f"{missing} are not measured here ({script}'s docstring says why)")
    else:
        print(f"\n{FSDP2_ON_CPU}")


def loss_check(rows: list[dict], tol: float | None = None) -> tuple[bool, list[str]]:
    """Whether every row lowered its loss and ended within `tol` (relative; default `LOSS_TOL` of
    its optimizer, the config's last word) of its peer's (`|Δ loss|`), and a note for each that
    did not."""
    ok, notes = True, []
    for r in rows:
        delta = r.get("|Δ loss|", 0.0)
        lowered = r["loss after"] < r["loss first"]
        close = delta <= (tol or LOSS_TOL[r["config"].split()[-1]]) * max(1.0, abs(r["loss after"]))
        ok &= lowered and close
        if not (lowered and close):
            label = f"{r['model']} {r['config']}" if "model" in r else r["config"]
            notes.append(f"{label}: lowered {lowered}, |Δ loss| {delta:.2e}")
    return ok, notes


def verdict(
    name: str,
    rows: list[dict],
    run: dict,
    goals: dict[str, bool],
    goals_for: str,
    peer: str,
    plot: Callable[[str], Path | None],
    **more,
) -> dict:
    """Print the goals (`goals_for` says against what) and the loss check against `peer`, plot to
    and write NAME.json (NAME_torchrun with `run["torchrun"]`, then _quick with `run["quick"]`),
    and return what was written: the environment, `run`, the goals, the check, `rows` and `more`."""
    print_goals(f"Goals ({goals_for}):", goals)
    sane, notes = loss_check(rows)
    tol = f"relative tolerance AdamW {LOSS_TOL['AdamW']:g}, Muon {LOSS_TOL['Muon']:g}"
    print(f"\nLoss check (loss after training vs {peer} with the same optimizer, {tol}; every config")
    print(f"lowered the loss): {'OK' if sane else 'MISMATCH'}" + "".join(f"\n  {n}" for n in notes))
    name = f"{name}_torchrun" if run.get("torchrun") else name
    name = f"{name}_quick" if run["quick"] else name
    png = plot(name)
    payload = {"env": environment(run.get("threads")), **run, "load_average": load_average(), "goals": goals}
    payload.update(loss_check_ok=sane, rows=rows, **more)
    path = save_json(name, payload)
    print(f"\nwrote {path}" + (f" and {png}" if png else "") + f"; {run['wall_s']:.0f} s")
    return payload
