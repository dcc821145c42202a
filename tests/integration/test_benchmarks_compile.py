"""`benchmarks/compile.py --quick` end to end (tiny GPT, 2 gloo ranks, the aot_eager backend): its
table is printed, every ratio is a finite measurement, both peers (FSDP2 eager and compiled) were
measured, the goals and the FSDP2 + compile status are stated, and its JSON names the host."""

import json
import math
import re

import pytest
from _bench import config_row, results_in

pytestmark = pytest.mark.slow  # make test-fast leaves it out


@pytest.mark.timeout(300)
def test_compile_quick(tmp_path, capsys):
    from benchmarks import compile as bench

    with results_in(tmp_path):
        out = bench.main(["--quick"])
    printed = capsys.readouterr().out
    assert out["world"] == 2 and out["backend"] == "aot_eager" and out["quick"]
    compiled = out["fsdp2_compiles"]
    configs = bench.CONFIGS if compiled else [c for c in bench.CONFIGS if c != "FSDP2 compiled"]
    assert sorted(r["config"] for r in out["rows"]) == sorted(configs)
    assert out["loss_check_ok"]

    # the table, the host, FSDP2's synchronous collectives on CPU, whether FSDP2 + compile runs here
    lines = printed.splitlines()
    assert any(re.match(r"\| config\s+\|", line) for line in lines)
    for config in configs:  # a row for every configuration, in both tables
        assert sum(bool(re.match(rf"\| {re.escape(config)}\s+\|", line)) for line in lines) == 2, config
    assert "host: " in printed and "FSDP2 issues its collectives synchronously" in printed
    assert ("FSDP2 + compile: runs on CPU/gloo" if compiled else "FSDP2 + compile: does NOT run") in printed
    # each goal stated on its own line, met or NOT met as the JSON says, and no other goal line
    goal_lines = [line for line in lines if re.match(r"  (met    |NOT met)  ", line)]
    assert goal_lines == [f"  {'met    ' if ok else 'NOT met'}  {k}" for k, ok in out["goals"].items()]
    peer = "FSDP2 compiled" if compiled else "FSDP2 eager"
    want = [f"ours compiled: train step <= 0.8x {peer}", "ours compiled: train step faster than ours eager"]
    assert [k.split(" (")[0] for k in out["goals"]] == want

    for r in out["rows"]:  # every configuration measured: time, memory, first step, loss
        for c in ("train ms", "fwd ms", "bwd ms", "step ms", "peak live MB", "first step s", "loss after"):
            assert isinstance(r[c], float) and math.isfinite(r[c]) and r[c] > 0, (r["config"], c, r[c])
        assert r["loss after"] < r["loss first"]
    ours, fsdp2 = config_row(out, "ours compiled"), config_row(out, peer)
    ratios = ["x FSDP2", "x eager", "peak live x"] + (["compile x"] if compiled else [])
    for c in ratios:
        assert math.isfinite(ours[c]) and ours[c] > 0, (c, ours[c])
    assert config_row(out, "ours eager")["x FSDP2"] > 0
    assert ours["compile s"] > 0 and (not compiled or fsdp2["compile s"] > 0)  # both compiled something
    assert any(k.endswith("FSDP::all_gather") for m in fsdp2["memory"] for k in m["live_by"])
    assert any("vescale::" in k for m in ours["memory"] for k in m["live_by"])
    assert len(out["goals"]) == 2

    saved = json.loads((tmp_path / "compile_quick.json").read_text())
    host = saved["env"]["host"]
    assert host["cpu"] and host["load_average"] and len(host["threads_per_rank"]) == 2
    assert saved["rows"] == json.loads(json.dumps(out["rows"], default=str))
    assert saved["goals"] == out["goals"]
