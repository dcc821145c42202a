"""The loss tolerances the training benchmarks hold a configuration to against its peer, and the check."""

from __future__ import annotations

# Relative. Muon: Newton-Schulz runs in bf16, and FSDP2's runs on DTensor shards (sums in another
# order), so the updates differ by bf16 rounding; compiled: inductor fuses and reorders fp32 arithmetic.
LOSS_TOL = {"AdamW": 1e-4, "Muon": 1e-2, "compiled": 1e-3}


def tolerance(config: str) -> float:
    """The relative `LOSS_TOL` of a configuration: its optimizer's, or a compiled one's."""
    return LOSS_TOL["compiled" if "compiled" in config.split() else config.split()[-1]]


def loss_check(rows: list[dict], tol: float | None = None) -> tuple[bool, list[str]]:
    """Whether every row lowered its loss and ended within `tol` (relative; default `LOSS_TOL` of
    its optimizer, the config's last word) of its peer's (`|Δ loss|`), and a note for each that
    did not."""
    ok, notes = True, []
    for r in rows:
        delta = r.get("|Δ loss|", 0.0)
        lowered = r["loss after"] < r["loss first"]
        close = delta <= (tol or tolerance(r["config"])) * max(1.0, abs(r["loss after"]))
        ok &= lowered and close
        if not (lowered and close):
            label = f"{r['model']} {r['config']}" if "model" in r else r["config"]
            notes.append(f"{label}: lowered {lowered}, |Δ loss| {delta:.2e}")
    return ok, notes
