"""`benchmarks/hsdp.py --quick` end to end (tiny model, 4 gloo ranks as 2x2 and 1x4): every
configuration trains to its FSDP2 peer's loss, bytes are placed inside or across shard groups,
and Newton–Schulz work per rank adds up to the model's total."""

import pytest
from _bench import config_row, results_in

pytestmark = pytest.mark.slow  # make test-fast leaves it out


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from benchmarks import hsdp

    with results_in(tmp_path_factory.mktemp("results")):
        yield hsdp.main(["--quick"])


@pytest.mark.timeout(240)
def test_every_config_trains_like_its_fsdp2_peer(result):
    from benchmarks._hsdp_report import BYTES, NS, TIME
    from benchmarks.hsdp import CONFIGS

    assert [r["config"] for r in result["rows"]] == CONFIGS
    assert result["loss_check_ok"]
    for r in result["rows"]:
        assert r["loss after"] < r["loss first"]
        assert r["train ms"] > 0 and r["step ms"] > 0
        assert set(TIME + BYTES) - {"train x", "step x", "stats MB"} <= set(r)
        if r["config"].endswith("Muon"):
            assert set(NS) - {"NS GF per rank (stats)", "NS matrices per rank"} <= set(r)


@pytest.mark.timeout(240)
def test_newton_schulz_work_per_rank_adds_up_to_the_total(result):
    for mesh in ("2x2", "1x4"):
        r = config_row(result, f"ours {mesh} Muon")
        total, stats = r["NS total GF"], r["NS GF per rank (stats)"]
        assert len(stats) == 4 and total > 0
        assert sum(stats) == pytest.approx(total, rel=1e-12)
        assert sum(r["NS matrices per rank"]) == r["NS matrices"]
        # the profiler's count of the products ours ran is the same work
        assert sum(r["NS GF per rank (measured)"]) == pytest.approx(total, rel=1e-6)
    # FSDP2's replicas each repeat the whole iteration, so its ranks together do more than the total
    assert config_row(result, "FSDP2 2x2 Muon")["NS sum / total"] > 1.5
    for r in result["rows"]:
        if r["config"].endswith("AdamW"):
            assert sum(r["NS GF per rank (measured)"]) == 0


@pytest.mark.timeout(240)
def test_bytes_are_placed_inside_and_across_shard_groups(result):
    for family in ("AdamW", "Muon"):
        two, one, fsdp2 = (config_row(result, f"{c} {family}") for c in ("ours 2x2", "ours 1x4", "FSDP2 2x2"))
        assert two["MB inside"] > 0 and two["MB across"] > 0  # shard group gathers, replicas all-reduce
        assert one["MB across"] == 0 and one["MB inside"] > 0  # one replica: every byte stays inside
        assert fsdp2["MB inside"] > 0 and fsdp2["MB across"] > 0
        assert two["MB unknown"] == one["MB unknown"] == fsdp2["MB unknown"] == 0
        # ours's own count of its step's moves and the meter's agree
        for r in (two, one):
            assert r["stats MB"] == pytest.approx(r["step MB all-to-all"], rel=1e-6, abs=1e-9)
