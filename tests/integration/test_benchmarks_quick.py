"""Every benchmark script's `--quick` run end to end, small (2 gloo ranks where it launches any):
its table is there, its numbers are finite measurements, the peer was measured, and its JSON
names the host. (fsdp.py, checkpoint.py and qcomm.py have test files of their own; kernels.py
runs in test_gpu_check.py.)"""

from __future__ import annotations

import json
import math

import pytest
from _bench import results_in

pytestmark = pytest.mark.slow  # make test-fast leaves it out


def _host(payload: dict, threads: int | None = None) -> None:
    host = payload["env"]["host"]
    assert host["cpu"] and host["avx512"] in ("yes", "no", "unknown") and host["native_bf16"]
    assert host["load_average"] and all(t >= 1 for t in host["threads_per_rank"])
    if threads is not None:
        assert len(host["threads_per_rank"]) == threads  # what each rank said


def _finite(rows: list[dict], columns: list[str]) -> None:
    for r in rows:
        for c in columns:
            assert isinstance(r[c], int | float) and math.isfinite(r[c]), (r.get("config"), c, r[c])


@pytest.mark.timeout(60)
def test_padding(tmp_path, capsys):
    from benchmarks import padding

    with results_in(tmp_path):
        out = padding.main(["--quick"])
    rows = out["rows"]
    granules = {(g, w) for g in ("1 row", "128 rows") for w in (8, 1024)}
    assert {(r["granule"], r["W"]) for r in rows} == granules
    _finite(rows, ["ours %", "ref %", "bound %", "FSDP2 %", "LCM %", "plan s"])
    for r in rows:
        assert r["bound %"] - 1e-9 <= r["ours %"] and r["planner misses"] == 0
    assert all(r["ours %"] <= 3 for r in rows if r["granule"] == "1 row" and r["W"] == 8)
    assert "| model" in capsys.readouterr().out
    _host(json.loads((tmp_path / "padding_quick.json").read_text()))


def test_model_shapes(tmp_path):
    from benchmarks import model_shapes

    with results_in(tmp_path):
        rows = model_shapes.main(["--quick"])
    totals = {m: model_shapes.total_params(m) for m in model_shapes.MODELS}
    assert {r["model"]: r["params"] for r in rows} == totals
    assert json.loads((tmp_path / "model_shapes.json").read_text())["rows"] == rows


@pytest.mark.timeout(120)
def test_costs_state(tmp_path):
    from benchmarks import costs

    with results_in(tmp_path):
        out = costs.main(["--quick", "--world-size", "2", "--sections", "state"])
    by = {(r["optimizer"], r["bits"]): r for r in out["state"]["rows"]}
    torch_adamw = by[("torch.optim.AdamW (every DDP rank)", 32)]
    assert torch_adamw["bytes/param (all ranks)"] == pytest.approx(8, rel=0.01)  # two fp32 moments
    full, half, low = (by[("vo.AdamW", b)]["bytes/param (all ranks)"] for b in (32, 16, 8))
    assert full == pytest.approx(8, rel=0.01) and full > half > low > 1
    assert by[("vo.AdamW", 32)]["vs torch per rank"] == pytest.approx(0.5, rel=0.05)  # a half on each of 2
    _host(out, threads=2)


@pytest.mark.timeout(120)
def test_costs_shampoo(tmp_path):
    from benchmarks import costs

    with results_in(tmp_path):
        out = costs.main(["--quick", "--world-size", "2", "--sections", "shampoo"])
    rows = out["shampoo"]["rows"]
    rep, shard = (next(r for r in rows if r["optimizer"] == k) for k in ("replicated", "sharded"))
    _finite(rows, costs.NUMBERS)
    assert rep["step s"] > 0 and shard["step s"] > 0 and shard["speedup"] > 0
    assert shard["root work / rank"] < rep["root work / rank"]  # the roots are split between the ranks
    assert shard["preconditioner MiB / rank"] < rep["preconditioner MiB / rank"]
    assert shard["max |dp|"] < 1e-3  # the same math up to the order of the gradient reduction
    _host(out, threads=2)


@pytest.mark.timeout(120)
def test_collectives(tmp_path, capsys):
    from benchmarks import collectives

    with results_in(tmp_path):
        out = collectives.main(["--quick", "--world-size", "2", "--runs", "2"])
    rows = out["rows"]
    assert {(r["path"], r["op"]) for r in rows} == {
        (p, op) for p in ("ours, 3 buckets", "FSDP2") for op in collectives.OPS
    }
    _finite(rows, ["median ms", "min ms"])
    for r in rows:
        assert r["median ms"] > 0
        if r["path"] == "FSDP2":
            assert r["copies"] > 0 and r["ours/FSDP2"] is None  # its copy-in and copy-out
        else:
            assert r["copies"] == 0 and r["ours/FSDP2"] > 0 and math.isfinite(r["ours/FSDP2"])
    assert "FSDP2 issues its collectives synchronously" in capsys.readouterr().out
    _host(out, threads=2)


@pytest.mark.timeout(60)
def test_scale(tmp_path, capsys):
    from benchmarks import scale

    with results_in(tmp_path):
        out = scale.main(["--quick"])
    rows = out["rows"]
    assert {(r["model"], r["W"], r["config"]) for r in rows} == {
        ("llama3-70b", w, c) for w in scale.QUICK_WORLDS for c in ("ours", "FSDP2 + torch Muon")
    }
    assert all(set(scale.COLUMNS) <= set(r) for r in rows)
    _finite(rows, scale.NUMBERS)
    _finite(out["plans"], [k for k in out["plans"][0] if k not in ("model",)])
    assert all(r["step s"] > 0 and 0 < r["Muon %"] < 100 for r in rows)
    assert [k for k in out["goals"] if "W=1024" in k] and all(out["goals"].values())  # W=1024's, met
    assert "| model" in capsys.readouterr().out
    saved = json.loads((tmp_path / "scale_quick.json").read_text())
    assert saved["rows"] == rows and saved["cost"]["flops"] == 989e12
    owners = out["owners"]  # the owner assignment on real shapes
    assert {r["W"] for r in owners} == {8, 64} and all(r["max/mean"] >= 1 for r in owners)
    assert {r["model"] for r in owners} == {"llama3-8b", "gpt-oss-120b"} and all(
        r["matrices"] > 0 for r in owners
    )


@pytest.mark.timeout(120)
def test_costs_clip(tmp_path):
    from benchmarks import costs

    with results_in(tmp_path):
        out = costs.main(["--quick", "--world-size", "2", "--sections", "clip"])
    rows = out["clip"]["rows"]
    counts = {(r["sharding"], r["method"]): r["collectives"] for r in rows}
    for mode in ("ZeRO-2", "ZeRO-3"):
        # torch's clip: one all-reduce for all parameters, not one per parameter
        for method in ("foreach=None", "foreach=True", "norm_type=inf"):
            assert counts[(mode, f"torch clip_grad_norm_ ({method})")] == 1
        assert counts[(mode, "torch clip_grad_value_")] == 0
        assert counts[(mode, "opt.clip_grad_norm_")] == 2  # the step's agreement, then the norm
        assert counts[(mode, "float(p.grad.norm()) per parameter")] == rows[0]["parameters"]
    _finite(rows, ["median ms"])
    _host(out, threads=2)


@pytest.mark.timeout(120)
def test_costs_sync(tmp_path):
    from benchmarks import costs

    with results_in(tmp_path):
        out = costs.main(["--quick", "--world-size", "2", "--sections", "sync"])
    rows = out["sync"]["rows"]
    assert [r["check"] for r in rows] == list(costs.MODES)
    _finite(rows, ["median ms", "x as shipped", "backward ms (no_sync)", "backward ms (reducing)"])
    _host(out, threads=2)
