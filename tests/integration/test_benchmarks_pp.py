"""`benchmarks/pp.py --quick` end to end (a tiny GPT, pp2 x dp2 on 4 gloo ranks, 1F1B): every
configuration is measured, ours trains as its FSDP2 peer under the same schedule (AdamW to the
same loss), each Muon matrix is orthogonalized once in the world, the peer's NS FLOPs are every
matrix of a stage, and the JSON names the host."""

import json
import math

import pytest
from _bench import config_row, results_in

pytestmark = pytest.mark.slow  # make test-fast leaves it out


@pytest.mark.timeout(180)
def test_pp_benchmark_quick(tmp_path):
    from benchmarks import pp

    with results_in(tmp_path):
        out = pp.main(["--quick"])
    assert [r["config"] for r in out["rows"]] == pp.CONFIGS
    for r in out["rows"]:
        for c in ("train ms", "step ms", "MB sent", "peak live MB", "loss last"):
            assert isinstance(r[c], float) and math.isfinite(r[c]) and r[c] > 0, (r["config"], c)
        assert r["loss last"] < r["loss first"], r["config"]
    adamw, muon = config_row(out, "ours AdamW"), config_row(out, "ours Muon")
    assert adamw["|Δ loss|"] <= 1e-5 and muon["|Δ loss|"] <= 1e-2  # against torch's optimizers
    assert adamw["reduce MB"] > 0 and adamw["peak x"] > 0 and adamw["train x"] > 0
    # each stage's matrices once in the world; the peer every one of its stage's on every rank
    assert muon["NS sum/model"] == 1.0
    peer = config_row(out, "FSDP2 full_tensor Muon")
    model = pp.shaped_gpt(pp.QUICK)
    per_stage = [pp.stage_ns_flops(pp.Stage(model, s, pp.PP)) for s in range(pp.PP)]
    assert peer["NS GFLOP"] == max(per_stage) / 1e9
    assert muon["NS x"] == muon["NS GFLOP"] / peer["NS GFLOP"] and 0 < muon["NS x"] < 1
    written = json.loads((tmp_path / "pp_quick.json").read_text())
    host = written["env"]["host"]
    assert host["cpu"] and host["load_average"] and len(host["threads_per_rank"]) == 4
    assert set(written["goals"]) == set(out["goals"])
