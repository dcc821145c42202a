"""`benchmarks/checkpoint.py --quick` end to end (tiny model, 2 gloo ranks): both sides restore what
they saved, write their state's bytes, and every timing is measured; nothing is left behind."""

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # make test-fast leaves it out

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import benchmarks._report as report
    from benchmarks import checkpoint

    saved, results = report.RESULTS_DIR, tmp_path_factory.mktemp("results")
    where = tmp_path_factory.mktemp("checkpoints")
    report.RESULTS_DIR = results
    try:
        yield checkpoint.main(["--quick", "--dir", str(where)]), results, where
    finally:
        report.RESULTS_DIR = saved


@pytest.mark.timeout(180)
def test_both_sides_restore_and_are_measured(run):
    result, _, _ = run
    (row,) = result["rows"]
    assert (row["W"], row["optimizer"]) == (2, "AdamW")
    assert row["ours restored"] and row["peer restored"] and row["restored"] == "yes/yes"
    for p in ("", "peer "):
        assert row[f"{p}save ms"] > 0 and row[f"{p}load ms"] > 0
        assert row[f"{p}step ms"] > 0 and row[f"{p}stage ms"] > 0
        assert row[f"{p}meta KB"] > 0
        assert len(row["raw"]["ours" if not p else "peer"]["async_cycle_s"]) == result["cycles"]["AdamW"]
    assert row["save x"] > 0 and row["load x"] > 0
    for op in ("save", "load"):  # the checksum's cost: ours against ours with verify=False
        assert row[f"unverified {op} ms"] > 0 and row[f"checksum {op} x"] > 0
        assert len(row["raw"]["ours"][f"unverified_{op}_s"]) == result["rounds"]


@pytest.mark.timeout(180)
def test_bytes_are_the_state_on_every_rank(run):
    result, _, _ = run
    (row,) = result["rows"]
    for side, p in (("ours", ""), ("peer", "peer ")):
        assert row[f"{p}B/param"] >= 12  # fp32 parameters and AdamW's two moments, at least
        by_rank = row["raw"][side]["data_bytes_by_rank"]
        assert len(by_rank) == 2 and min(by_rank) > 0.4 * sum(by_rank)  # each rank writes its half
    assert 0.8 < row["bytes x"] < 1.25


@pytest.mark.timeout(180)
def test_json_written_and_checkpoints_removed(run):
    result, results, where = run
    saved = json.loads((results / "checkpoint.json").read_text())
    assert saved["rows"][0]["save x"] == pytest.approx(result["rows"][0]["save x"])
    assert "load_average" in saved and saved["env"]["torch"]
    assert list(where.iterdir()) == []
