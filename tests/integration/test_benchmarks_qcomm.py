"""benchmarks/qcomm.py --quick end to end (2 gloo ranks, tiny models): its three tables are
there, every number is a finite measurement, the bytes the ranks counted in `step_stats`
are the layout formula's (which the model-scale table uses), the goal columns hold, and
its JSON names the host."""

from __future__ import annotations

import json
import math

import pytest
from _bench import results_in

pytestmark = pytest.mark.slow  # make test-fast leaves it out


def _finite(rows: list[dict], columns: list[str]) -> None:
    for r in rows:
        for c in columns:
            assert isinstance(r[c], int | float) and math.isfinite(r[c]), (r.get("config"), c, r[c])


@pytest.mark.timeout(180)
def test_qcomm_quick(tmp_path, capsys):
    from benchmarks import qcomm

    with results_in(tmp_path):
        out = qcomm.main(["--quick"])
    printed = capsys.readouterr().out
    for title in ("## A. Bytes per step", "## B. The demo's loss", "## C. Model scale", "host: "):
        assert title in printed
    assert "| model" in printed and "<= 0.27x fp32" in printed and "within 1 %" in printed

    rows = out["rows"]
    assert {(r["model"], r["config"]) for r in rows} == {(m, c) for m in qcomm.QUICK for c in qcomm.CONFIGS}
    _finite(rows, qcomm.MEASURED)
    for r in rows:
        assert r["layout check"] == pytest.approx(1, abs=1e-12)  # step_stats = the formula of table C
        assert r["gather MiB"] > 0 and r["reduce MiB"] > 0 and r["train ms"] > 0
        assert r["loss after"] < r["loss first"]  # every configuration trained
        goal = r["config"] == qcomm.BOTH
        assert all((g in r) == goal for g in qcomm.GOALS)
        if goal:
            assert r[qcomm.GOALS[0]] is True and r[qcomm.GOALS[1]] is True, r
            assert 0.25 < r["x fp32"] <= qcomm.GOAL_FP32 and 0.5 < r["x bf16"] <= qcomm.GOAL_BF16
    by = {(r["model"], r["config"]): r for r in rows}
    for m in qcomm.QUICK:
        assert by[(m, "fp32")]["x fp32"] == 1 and by[(m, "bf16")]["x fp32"] == pytest.approx(0.5)

    demo = {(r["optimizer"], r["config"]): r for r in out["demo_rows"]}
    assert set(demo) == {(o, c) for o in qcomm.DEMO_OPTIMIZERS for c in qcomm.DEMO_CONFIGS}
    _finite(out["demo_rows"], ["train loss", "val loss", "Δ train %", "Δ val %", "train s"])
    assert all(r["same init"] and r["within 1 %"] for r in demo.values()), demo

    scale = {r["config"]: r for r in out["scale_rows"]}
    assert set(scale) == set(qcomm.SCALE_CONFIGS)
    _finite(out["scale_rows"], ["total GB", "x fp32", "x bf16", *qcomm.BANDWIDTH, "padding %"])
    assert scale["bf16"]["x fp32"] == pytest.approx(0.5)
    assert scale[qcomm.BOTH]["x fp32"] <= qcomm.GOAL_FP32 and scale[qcomm.BOTH]["x bf16"] <= qcomm.GOAL_BF16
    assert all(out["goals"].values())
    assert len(out["goals"]) == 2 * len(qcomm.QUICK) + len(qcomm.DEMO_OPTIMIZERS)

    payload = json.loads((tmp_path / "qcomm_quick.json").read_text())
    host = payload["env"]["host"]
    assert host["cpu"] and host["load_average"] and len(host["threads_per_rank"]) == 2
    assert payload["rows"] and payload["scale_rows"] and payload["demo_rows"]
