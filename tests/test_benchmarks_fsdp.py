"""`benchmarks/fsdp.py --quick` end to end (tiny model, 2 gloo ranks): every configuration trains
to its FSDP2 peer's loss, the measurements see what each configuration holds and moves."""

import pytest
from _bench import config_row, results_in


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from benchmarks import fsdp

    with results_in(tmp_path_factory.mktemp("results")):
        yield fsdp.main(["--quick"])


@pytest.mark.timeout(240)
def test_every_config_trains_like_its_fsdp2_peer(result):
    from benchmarks.fsdp import CONFIGS

    assert sorted(r["config"] for r in result["rows"]) == sorted(CONFIGS)
    assert result["loss_check_ok"]
    for r in result["rows"]:
        assert r["loss after"] < r["loss first"]
        assert r["train ms"] > 0 and r["step ms"] > 0


@pytest.mark.timeout(240)
def test_copies_are_counted_on_the_collective_path(result):
    ours, fsdp2 = config_row(result, "ours Z3 AdamW"), config_row(result, "FSDP2 AdamW")
    assert ours["copies"] == 0
    assert ours["own slice copies"] > 0  # gloo: the shard is copied into the gathered buffer
    assert fsdp2["copies"] > 0  # FSDP2's copy-in and copy-out
    assert config_row(result, "ours Z2 AdamW")["own slice copies"] == 0  # whole parameters: nothing gathered


@pytest.mark.timeout(240)
def test_communication_is_measured(result):
    ours, fsdp2 = config_row(result, "ours Z3 AdamW"), config_row(result, "FSDP2 AdamW")
    assert {"broadcast", "all-reduce"} <= set(ours["MB sent by kind"])
    assert {"all-gather", "reduce-scatter"} <= set(fsdp2["MB sent by kind"])
    for r in (ours, fsdp2):
        assert r["MB sent"] > 0 and r["exposed comm ms"] > 0
    # FSDP2's all-gathers of the same parameters send as much as ours (W broadcasts of a shard each)
    sent = ours["MB sent by kind"]["broadcast"], fsdp2["MB sent by kind"]["all-gather"]
    assert sent[0] == pytest.approx(sent[1], rel=0.05)


@pytest.mark.timeout(240)
def test_live_bytes_see_what_the_optimizer_holds(result):
    for r in result["rows"]:
        assert 0 < r["at step start MB"] < r["peak live MB"]
    ours = config_row(result, "ours Z3 AdamW")
    for m in ours["memory"]:  # between steps a rank holds its shards (+ a batch and such)
        held = sum(m["memory_stats"].values())
        assert held <= m["live_start"] <= 1.05 * held + 2**20
    fsdp2 = config_row(result, "FSDP2 AdamW")
    assert any(k.endswith("FSDP::all_gather") for m in fsdp2["memory"] for k in m["live_by"])


@pytest.mark.timeout(240)
def test_state_between_steps_scales_as_one_over_w(result):
    by = {(r["config"], r["W"]): r for r in result["scaling"]}
    assert {w for _, w in by} == {1, 2}
    assert by[("FSDP2 AdamW", 1)]["at step start B/param"] == pytest.approx(12, rel=0.05)  # grads freed
    one, two = by[("ours Z3 AdamW", 1)], by[("ours Z3 AdamW", 2)]
    # param, exp_avg, exp_avg_sq: zero_grad() freed the gradient shard, as FSDP2's gradients
    assert one["at step start B/param"] == pytest.approx(12, rel=0.05)
    assert two["at step start B/param x W"] == pytest.approx(one["at step start B/param x W"], rel=0.05)
    zero2, zero3 = config_row(result, "ours Z2 AdamW"), config_row(result, "ours Z3 AdamW")
    assert zero2["at step start MB"] > zero3["at step start MB"]  # whole parameters on every rank
