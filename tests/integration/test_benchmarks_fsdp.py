"""`benchmarks/fsdp.py --quick` end to end (tiny model, 2 gloo ranks): every configuration trains
to its FSDP2 peer's loss, the measurements see what each configuration holds and moves."""

import pytest
from _bench import config_row, results_in

pytestmark = pytest.mark.slow  # make test-fast leaves it out


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


def _mem(ts, addr, nbytes, tid=1):
    args = {"Addr": addr, "Bytes": nbytes, "Device Type": 0}
    return {"name": "[memory]", "tid": tid, "ts": ts, "args": args}


def test_a_block_freed_unseen_counts_as_freed_when_the_next_collective_ends():
    from benchmarks._live import Trace, _attribute, _timeline

    events = [
        {"ph": "X", "cat": "user_annotation", "tid": 1, "name": "bench::steady", "ts": 0, "dur": 100},
        _mem(1, addr=10, nbytes=100),  # a collective's buffer, on the main thread
        _mem(2, addr=20, nbytes=7),
        {"ph": "X", "tid": 2, "name": "gloo:all_gather", "ts": 3, "dur": 4},  # a worker runs it, ends at 7
        _mem(20, addr=10, nbytes=100),  # its address again: it was freed where the profiler did not look
        _mem(30, addr=10, nbytes=-100),
        _mem(40, addr=20, nbytes=-7),
    ]
    blocks, unseen = _attribute(events)
    assert unseen == 1
    assert sorted((t0, t1, n) for t0, t1, n, _ in blocks) == [(1, 7, 100), (2, 40, 7), (20, 30, 100)]
    times, totals = _timeline(blocks)
    windows = [("bench::steady", 0.0, 100.0)]
    trace = Trace(times, totals, windows, blocks, unseen)
    assert trace.peak("bench::steady")["bytes"] == 107  # not 207: both buffers were never alive at once
    assert totals[-1] == 0


def test_a_call_of_a_later_step_shows_that_the_earlier_steps_block_was_freed_unseen():
    from benchmarks._live import _attribute

    def window(name, ts, dur):
        return {"ph": "X", "cat": "user_annotation", "tid": 1, "name": name, "ts": ts, "dur": dur}

    events = [
        window("bench::steady", 0, 100),
        window("FSDP::post_backward_reduce (blocks.1)", 10, 5),
        window("FSDP::post_backward_reduce (blocks.1)", 110, 5),
        window("FSDP::post_backward_reduce (blocks.2)", 120, 5),
        window("bench::steady", 100, 100),
        _mem(11, addr=10, nbytes=64),  # step 1's buffer of blocks.1: its free is never seen
        _mem(12, addr=20, nbytes=8),  # and another size of the same call, kept
        {"ph": "X", "tid": 2, "name": "gloo:reduce_scatter", "ts": 13, "dur": 2},
        _mem(111, addr=30, nbytes=64),  # the same call in step 2
        _mem(121, addr=40, nbytes=64),  # another unit's call
    ]
    blocks, unseen = _attribute(events)
    assert unseen == 1
    ends = {(t0, n): t1 for t0, t1, n, _ in blocks}
    assert ends[(11, 64)] == 15 and ends[(12, 8)] == float("inf")
    assert ends[(111, 64)] == ends[(121, 64)] == float("inf")


def test_a_cuda_run_reports_only_what_cuda_measures(tmp_path, capsys):
    """A torchrun run on CUDA (summarized from made-up per-rank results, no processes): time and
    allocator-peak ratios; no exposed comm, update, copies, RSS nor place of the peak."""
    from benchmarks import fsdp
    from benchmarks._fsdp_report import report
    from benchmarks._train import PHASES

    def timed(seconds):
        return [
            {
                "params": 100,
                "times_s": {k: [seconds] * 2 for k in PHASES},
                "exposed_s": {k: [0.0] * 2 for k in PHASES},
                "losses": [2.0, 1.5],
                "loss_after": 1.0,
                "comm": {"calls": {"all-gather": 2}, "sent": {"all-gather": 2**20}},
                "copies": None,
                "device": "cuda",
            }
        ] * 2

    def memory(config, peak):
        return [
            {
                "model": "wide",
                "config": config,
                "params": 100,
                "live_peak": peak,
                "live_start": peak // 2,
                "memory_stats": None,
                "source": "torch.cuda.max_memory_allocated",
            }
        ] * 2

    configs = {"ours Z3 AdamW": (0.01, 2**20), "FSDP2 AdamW": (0.02, 2**21)}
    rows = fsdp.summarize(
        "wide",
        {c: timed(t) for c, (t, _) in configs.items()},
        {c: memory(c, m) for c, (_, m) in configs.items()},
    )
    run = dict(
        world=2,
        steps=2,
        warmup=1,
        memory_steps=2,
        malloc=None,
        shapes={"wide": fsdp.QUICK["wide"]},
        quick=True,
        threads=[1, 1],
        wall_s=1.0,
        torchrun=True,
        device="cuda",
        backend="nccl",
    )
    with results_in(tmp_path):
        out = report(rows, [], run)
    ours = config_row(out, "ours Z3 AdamW")
    assert ours["train x"] == pytest.approx(0.5) and ours["peak live x"] == pytest.approx(0.5)
    assert not {*fsdp.NOT_ON_CUDA, "peak RSS MB", "peak at", "update x"} & set(ours)
    printed = capsys.readouterr().out
    assert "nccl under torchrun" in printed and "exposed fwd" not in printed and "peak RSS" not in printed
    assert (tmp_path / "fsdp_torchrun_quick.json").exists()
