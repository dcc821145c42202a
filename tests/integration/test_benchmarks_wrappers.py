"""`benchmarks/wrappers.py --quick` end to end (a tiny GPT under DDP and under FSDP2, 2 gloo ranks):
its JSON holds every field, and the goals a quick run can check hold: the optimizer state per rank
against torch's, the Newton-Schulz FLOPs of the busiest rank, each matrix once in the world, the
same parameters as torch's after the first step and the same loss after training, and over FSDP2
the peak bytes against the full_tensor() peer's (not the step time: a quick run's times say
nothing)."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
from _bench import results_in

pytestmark = pytest.mark.slow  # make test-fast leaves it out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """What `main` returned, what it wrote and what it printed."""
    from benchmarks import wrappers

    folder, printed = tmp_path_factory.mktemp("results"), io.StringIO()
    with results_in(folder), contextlib.redirect_stdout(printed):
        out = wrappers.main(["--quick"])
    return out, json.loads((folder / "wrappers_quick.json").read_text()), printed.getvalue()


def _rows(run) -> dict[str, dict]:
    return {r["optimizer"]: r for r in run[1]["ddp"]["rows"]}


@pytest.mark.timeout(120)
def test_the_json_holds_every_field(run):
    from benchmarks.wrappers import COLUMNS

    out, saved, printed = run
    assert saved["goals"] == out["goals"] and saved["world_sizes"] == [2]
    rows = _rows(run)
    assert list(rows) == ["AdamW", "Muon"] and all(r["W"] == 2 for r in rows.values())
    ns = [c for c in COLUMNS if c.startswith("NS ")]
    for name, r in rows.items():
        for c in COLUMNS[2:]:
            if name == "Muon" or c not in ns:
                assert isinstance(r[c], int | float) and math.isfinite(r[c]), (name, c, r[c])
        assert r["step ms ours"] > 0 and r["step ms torch"] > 0 and r["AG ms"] > 0
        assert set(r["profiled ours"]) == {"step ms", "take ms", "update ms", "AG ms"}
        assert len(r["state MB by rank"]) == 2 and len(r["max|Δ| by round"]) == saved["rounds"] + 1
    host = saved["env"]["host"]
    assert host["cpu"] and host["load_average"] and len(host["threads_per_rank"]) == 2
    assert "| optimizer |" in printed and "load average" in printed and "synchronous" in printed


@pytest.mark.timeout(120)
def test_state_per_rank_is_a_share_of_torchs(run):
    rows = _rows(run)
    adamw, muon = rows["AdamW"], rows["Muon"]
    assert adamw["state x"] <= adamw["state goal x"] == pytest.approx(1.05 / 2)
    # all ranks together hold what torch's holds on each: 1/W on average
    assert muon["state x mean"] == pytest.approx(0.5, rel=0.01)


# A unit's layout shares out parameter elements, not state bytes: Muon's matrices (momentum: 4 bytes
# an element) come first in the unit and the AdamW group's (two moments: 8) after, so one rank holds
# the matrices and another only AdamW elements (W=2: 0.65x torch's on the busiest rank, not 0.525x).
@pytest.mark.timeout(120)
def test_muon_state_on_the_busiest_rank_is_within_the_goal(run):
    muon = _rows(run)["Muon"]
    assert muon["state x"] <= muon["state goal x"]


@pytest.mark.timeout(120)
def test_each_matrix_once_and_the_busiest_rank_within_the_goal(run):
    muon = _rows(run)["Muon"]
    assert sum(muon["matrices by rank"]) == muon["matrices"]
    assert muon["NS sum / torch"] == pytest.approx(1, rel=1e-9)  # all ranks together: every matrix once
    assert muon["NS GFLOP torch"] / 2 <= muon["NS GFLOP ours"] <= muon["NS goal GFLOP"]


@pytest.mark.timeout(120)
def test_trained_like_torch(run):
    for r in _rows(run).values():
        assert r["max|Δ| 1st"] <= 1e-5
    assert _rows(run)["AdamW"]["max|Δ|"] <= 1e-5  # a quick run's few steps: not yet drifted apart
    goals = run[0]["goals"]
    timeless = {k: ok for k, ok in goals.items() if "Muon: state per rank" not in k and "step time" not in k}
    assert all(timeless.values()), goals


@pytest.mark.timeout(120)
def test_the_fsdp2_section_holds_every_field_and_its_goals(run):
    from benchmarks.wrappers import FSDP2_COLUMNS

    out, saved, printed = run
    (row,) = saved["fsdp2"]["rows"]
    for c in FSDP2_COLUMNS:
        assert isinstance(row[c], int | float) and math.isfinite(row[c]), (c, row[c])
    assert row["peak MB ours"] > 0 and row["peak MB torch"] > 0 and len(row["peak MB by rank"]) == 2
    assert row["step MB sent ours"] > 0  # the moves of whole matrices are counted in step_stats
    assert sum(row["matrices by rank"]) == row["matrices"] and row["peak x"] <= 1.0
    assert "## FSDP2" in printed and "synchronous" in printed.split("## FSDP2")[1]
    assert sum("over FSDP2" in k for k in out["goals"]) == 7
