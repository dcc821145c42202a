"""`benchmarks/soap.py --quick` end to end on 2 gloo ranks: its three tables are there, its numbers are
finite measurements, ours equals the reference in one process, the sharded state is split between the
ranks, and the owners' refresh work on llama3-8b's shapes is balanced by the cost model."""

from __future__ import annotations

import json
import math

import pytest
from _bench import results_in

pytestmark = pytest.mark.slow  # make test-fast leaves it out


@pytest.mark.timeout(300)
def test_soap_quick(tmp_path, capsys):
    from benchmarks import soap

    with results_in(tmp_path):
        out = soap.main(["--quick", "--world-size", "2"])
    printed = capsys.readouterr().out
    assert (
        "A. One process" in printed and "B. 2 gloo ranks" in printed and "C. Owners' refresh work" in printed
    )
    a = {r["optimizer"]: r for r in out["a"]}
    assert a["reference"]["max |dp|"] < 1e-5 and a["reference"]["step ms"] > 0  # the same math
    reference, sharded = out["b"]
    assert (reference["config"], sharded["config"]) == ("reference", "sharded")
    for row in out["b"]:
        assert all(math.isfinite(row[c]) and row[c] > 0 for c in soap.B_NUMBERS)
    assert sharded["state MiB / rank"] < 0.75 * reference["state MiB / rank"]  # each parameter's state once
    assert sharded["refresh s / rank"] < reference["refresh s / rank"]  # each refresh once in the world
    assert [r["W"] for r in out["c"]] == [4, 8] and all(r["parameters"] == 291 for r in out["c"])
    assert all(r["cost max/mean"] <= 1.1 and math.isfinite(r["refresh max/mean"]) for r in out["c"])
    saved = json.loads((tmp_path / "soap_quick.json").read_text())
    assert saved["env"]["host"]["threads_per_rank"] and saved["scale"] == 16
