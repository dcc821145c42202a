"""`benchmarks/fsdp.py --quick` end to end (tiny models; `zero3`, `peers` and `compile` on 2 gloo
ranks, `hsdp` on 4 as 2x2 and 1x4): every configuration trains to its FSDP2 peer's loss, the measurements see
what each configuration holds and moves, the peers' profiler windows and Muon's Newton–Schulz work
per rank are measured, bytes are placed inside or across shard groups, and compiled blocks are
measured against FSDP2 in the same mode (the aot_eager backend); the `tp` section on 4 (dp2 x tp2)."""

import math

import pytest
from _bench import config_row, results_in

from benchmarks.fsdp import SECTIONS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # make test-fast leaves it out; one run, ~2 min


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from benchmarks import fsdp

    with results_in(tmp_path_factory.mktemp("results")):
        yield fsdp.main(["--quick"])


def test_every_config_trains_like_its_fsdp2_peer(result):
    assert result["loss_check_ok"]
    for name, section in SECTIONS.items():
        left = {"FSDP2 compiled AdamW"} if name == "compile" and not result["fsdp2_compiles"] else set()
        assert sorted(r["config"] for r in result[name]["rows"]) == sorted(set(section["configs"]) - left)
        for r in result[name]["rows"]:
            assert r["loss after"] < r["loss first"]
            assert r["train ms"] > 0 and r["step ms"] > 0


def test_copies_are_counted_on_the_collective_path(result):
    zero3 = result["zero3"]
    ours, fsdp2 = config_row(zero3, "ours Z3 AdamW"), config_row(zero3, "FSDP2 AdamW")
    assert ours["copies"] == 0
    assert ours["own slice copies"] > 0  # gloo: the shard is copied into the gathered buffer
    assert fsdp2["copies"] > 0  # FSDP2's copy-in and copy-out
    assert config_row(zero3, "ours Z2 AdamW")["own slice copies"] == 0  # whole parameters: nothing gathered


def test_communication_is_measured(result):
    ours, fsdp2 = config_row(result["zero3"], "ours Z3 AdamW"), config_row(result["zero3"], "FSDP2 AdamW")
    assert {"broadcast", "all-reduce"} <= set(ours["MB sent by kind"])
    assert {"all-gather", "reduce-scatter"} <= set(fsdp2["MB sent by kind"])
    for r in (ours, fsdp2):
        assert r["MB sent"] > 0 and r["exposed comm ms"] > 0
    # FSDP2's all-gathers of the same parameters send as much as ours (W broadcasts of a shard each)
    sent = ours["MB sent by kind"]["broadcast"], fsdp2["MB sent by kind"]["all-gather"]
    assert sent[0] == pytest.approx(sent[1], rel=0.05)


def test_live_bytes_see_what_the_optimizer_holds(result):
    for r in result["zero3"]["rows"] + result["peers"]["rows"]:
        assert 0 < r["at step start MB"] < r["peak live MB"] and r["peak RSS MB"] > 0
    ours = config_row(result["zero3"], "ours Z3 AdamW")
    for m in ours["memory"]:  # between steps a rank holds its shards (+ a batch and such)
        held = sum(m["memory_stats"].values())
        assert held <= m["live_start"] <= 1.05 * held + 2**20
    fsdp2 = config_row(result["zero3"], "FSDP2 AdamW")
    assert any(k.endswith("FSDP::all_gather") for m in fsdp2["memory"] for k in m["live_by"])


def test_state_between_steps_scales_as_one_over_w(result):
    by = {(r["config"], r["W"]): r for r in result["zero3"]["scaling"]}
    assert {w for _, w in by} == {1, 2}
    assert by[("FSDP2 AdamW", 1)]["at step start B/param"] == pytest.approx(12, rel=0.05)  # grads freed
    one, two = by[("ours Z3 AdamW", 1)], by[("ours Z3 AdamW", 2)]
    # param, exp_avg, exp_avg_sq: zero_grad() freed the gradient shard, as FSDP2's gradients
    assert one["at step start B/param"] == pytest.approx(12, rel=0.05)
    assert two["at step start B/param x W"] == pytest.approx(one["at step start B/param x W"], rel=0.05)
    zero2, zero3 = config_row(result["zero3"], "ours Z2 AdamW"), config_row(result["zero3"], "ours Z3 AdamW")
    assert zero2["at step start MB"] > zero3["at step start MB"]  # whole parameters on every rank


def test_the_peers_windows_and_state_are_measured(result, capsys):
    peers = result["peers"]
    ours, fsdp2 = config_row(peers, "ours Z2 AdamW"), config_row(peers, "FSDP2 AdamW")
    for r, windows in ((ours, ("RS", "update", "AG")), (fsdp2, ("RS", "AG"))):  # ours' and FSDP2's windows
        assert all(r[f"{k} win ms"] > 0 for k in windows), r
    for who in ("FSDP2", "ZeRO", "DDP"):  # the peers' two torch optimizers, each in its window
        muon = config_row(peers, f"{who} Muon")
        assert muon["Muon win ms"] > 0 and muon["AdamW win ms"] > 0
    assert ours["opt state MB"] == pytest.approx(fsdp2["opt state MB"], rel=0.01)
    assert config_row(peers, "DDP AdamW")["opt state MB"] == pytest.approx(2 * ours["opt state MB"], rel=0.01)
    for r in peers["rows"]:
        for c in ("train ms", "step ms", "fwd ms", "bwd ms", "peak RSS MB", "opt state MB"):
            assert isinstance(r[c], float) and math.isfinite(r[c]), (r["config"], c)


def test_muon_against_its_peers(result):
    peers = result["peers"]
    goals = {k: ok for k, ok in result["goals"].items() if k.startswith("Muon:")}
    assert all(ok for k, ok in goals.items() if "faster" not in k), goals  # the checks a quick run can hold
    assert any("owners planned here" in k for k in goals) and any("measured ==" in k for k in goals)
    ours, ddp = config_row(peers, "ours Z2 Muon"), config_row(peers, "DDP Muon")
    assert ddp["NS sum / total"] == pytest.approx(2, rel=1e-6)  # each of 2 ranks does it all
    assert ours["NS sum / total"] == pytest.approx(1, rel=1e-6)  # every matrix once
    assert sum(ours["orthogonalized"]) == ours["NS matrices"] and ours["Δ/update"] <= 0.05
    for variant in ("polar_express", "normuon"):
        r = config_row(peers, f"ours Z2 {variant} Muon")
        assert sum(r["NS matrices per rank"]) == ours["NS matrices"] and r["step ms"] > 0


def test_inside_torchs_wrappers_ours_trains_like_torch_on_a_share_of_its_state(result):
    """Ours under DDP (ZeRO-1) and over FSDP2 against torch's optimizer under the same wrapper: its
    parameters after a step and its loss after training, its state a 1/W share, each matrix once,
    the busiest rank within the goal, over FSDP2 the peak bytes below the full_tensor() peer's (not
    the step time: a quick run's times say nothing)."""
    peers, world = result["peers"], result["world"]
    ddp = {f: config_row(peers, f"ours DDP {f}") for f in ("AdamW", "Muon")}
    over = config_row(peers, "ours FSDP2 Muon")
    for r in ddp.values():
        assert r["max|Δ| 1st"] <= 1e-5 and r["opt state x"] <= 1.05 / world, r["config"]
    assert over["max|Δ| 1st"] <= 1e-5 and over["opt state x"] < 1  # Muon's state sharded, not whole
    assert ddp["AdamW"]["max|Δ|"] <= 1e-5  # a quick run's few steps: not yet drifted apart
    assert ddp["AdamW"]["RS win ms"] > 0 and ddp["AdamW"]["AG win ms"] > 0  # DDP's .grad taken, AG
    assert ddp["Muon"]["opt state x mean"] == pytest.approx(1 / world, rel=0.01)  # all ranks: torch's
    for r in (ddp["Muon"], over):
        assert sum(r["NS matrices per rank"]) == r["NS matrices"] and r["NS sum / total"] == pytest.approx(1)
        assert r["NS total GF"] / world <= max(r["NS GF per rank (stats)"]) <= r["NS goal GF"]
    assert over["peak live x"] <= 1.0 and over["stats MB"] > 0  # the moves of whole matrices counted
    wrapped = {k: ok for k, ok in result["goals"].items() if k.startswith(("ours DDP", "ours FSDP2"))}
    assert sum(k.startswith("ours FSDP2") for k in wrapped) == 7
    timeless = {k: ok for k, ok in wrapped.items() if "opt.step()" not in k}
    assert all(timeless.values()), wrapped


def test_hsdp_newton_schulz_work_per_rank_adds_up_to_the_total(result):
    hsdp = result["hsdp"]
    for mesh in ("2x2", "1x4"):
        r = config_row(hsdp, f"ours {mesh} Muon")
        total, stats = r["NS total GF"], r["NS GF per rank (stats)"]
        assert len(stats) == 4 and total > 0
        assert sum(stats) == pytest.approx(total, rel=1e-12)
        assert sum(r["NS matrices per rank"]) == r["NS matrices"]
        # the profiler's count of the products ours ran is the same work
        assert sum(r["NS GF per rank (measured)"]) == pytest.approx(total, rel=1e-6)
    # FSDP2's replicas each repeat the whole iteration, so its ranks together do more than the total
    assert config_row(hsdp, "FSDP2 2x2 Muon")["NS sum / total"] > 1.5


def test_hsdp_bytes_are_placed_inside_and_across_shard_groups(result):
    hsdp = result["hsdp"]
    for family in ("AdamW", "Muon"):
        two, one, fsdp2 = (config_row(hsdp, f"{c} {family}") for c in ("ours 2x2", "ours 1x4", "FSDP2 2x2"))
        assert two["MB inside"] > 0 and two["MB across"] > 0  # shard group gathers, replicas all-reduce
        assert one["MB across"] == 0 and one["MB inside"] > 0  # one replica: every byte stays inside
        assert fsdp2["MB inside"] > 0 and fsdp2["MB across"] > 0
        assert two["MB unknown"] == one["MB unknown"] == fsdp2["MB unknown"] == 0
        # ours's own count of its step's moves and the meter's agree
        for r in (two, one):
            assert r["stats MB"] == pytest.approx(r["step MB all-to-all"], rel=1e-6, abs=1e-9)


def test_compiled_blocks_are_measured_against_fsdp2_in_the_same_mode(result, capsys):
    """The compile section (aot_eager): both peers measured (FSDP2 eager and compiled), every ratio a
    finite measurement, both compiled configurations compiled something, the goals stated."""
    rows, compiled = result["compile"]["rows"], result["fsdp2_compiles"]
    configs = [c for c in SECTIONS["compile"]["configs"] if compiled or c != "FSDP2 compiled AdamW"]
    assert sorted(r["config"] for r in rows) == sorted(configs) and result["backend"] == "aot_eager"
    for r in rows:  # every configuration measured: time, memory, first step
        for c in ("train ms", "fwd ms", "bwd ms", "step ms", "peak live MB", "first step s"):
            assert isinstance(r[c], float) and math.isfinite(r[c]) and r[c] > 0, (r["config"], c, r[c])
    ours, peer = (
        config_row(result["compile"], "ours Z3 compiled AdamW"),
        "FSDP2 compiled" if compiled else "FSDP2",
    )
    for c in ("train x", "x eager", "peak live x") + (("compile x",) if compiled else ()):
        assert math.isfinite(ours[c]) and ours[c] > 0, (c, ours[c])
    assert ours["compile s"] > 0 and (
        not compiled or config_row(result["compile"], f"{peer} AdamW")["compile s"] > 0
    )
    goals = [k.split(" (")[0] for k in result["goals"] if k.startswith("ours compiled")]
    want = "FSDP2 compiled" if compiled else "FSDP2 eager"
    assert goals == [
        f"ours compiled: train step <= 0.8x {want}",
        "ours compiled: train step faster than ours eager",
    ]


def test_data_parallelism_over_tensor_parallelism(result, capsys):
    """The TP section (dp2 x tp2): each pair trains the same model to the same loss, the full_tensor
    integration orthogonalizes every matrix on every rank and ours each once in the world, the goals
    and the data-parallel part are stated."""
    tp = {r["config"]: r for r in result["tp"]["rows"]}
    for ours, peer in (("ours AdamW", "FSDP2 AdamW"), ("ours Muon", "FSDP2 full_tensor Muon")):
        for c in ("train x", "step x", "peak live x"):
            assert math.isfinite(tp[ours][c]) and tp[ours][c] > 0, (ours, c)
        assert tp[ours]["loss after"] == pytest.approx(tp[peer]["loss after"], rel=1e-4)
    assert 0 < tp["ours Muon"]["NS GF max"] < tp["FSDP2 full_tensor Muon"]["NS GF max"]
    assert tp["ours Muon"]["stats MB"] > 0 and result["worlds"]["tp"] == 4
    assert set(tp["TP alone AdamW"]["data-parallel part"]) == {"floor ms", "ours ms", "FSDP2 ms", "x"}
    assert (
        sum(
            k.startswith(("ours AdamW:", "ours Muon:", "peak live bytes <= 1.0x FSDP2 2-D"))
            for k in result["goals"]
        )
        == 3
    )


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
    allocator-peak ratios; no exposed comm, update, windows, copies, RSS nor place of the peak."""
    from benchmarks import fsdp
    from benchmarks._fsdp_report import report
    from benchmarks._fsdp_rows import NOT_ON_CUDA, summarize
    from benchmarks._train import PHASES

    def timed(seconds):
        sent = {"inside all-gather": 2**20}
        rank = {"params": 100, "times_s": {k: [seconds] * 2 for k in PHASES}, "losses": [2.0, 1.5]}
        rank.update(exposed_s={k: [0.0] * 2 for k in PHASES}, loss_after=1.0, device="cuda", copies=None)
        rank.update(comm={"calls": {"all-gather": 2}, "sent": {"all-gather": 2**20}}, sent=[sent] * 2)
        rank.update(step_sent=[{}] * 2, windows_s={"RS": 0.001}, stand_ins_s=0.0, state_bytes=800, stats=[])
        return [{**rank, "ns_measured": None}] * 2

    def memory(config, peak):
        mem = {"run": "wide", "config": config, "params": 100, "live_peak": peak, "live_start": peak // 2}
        return [{**mem, "memory_stats": None, "source": "torch.cuda.max_memory_allocated"}] * 2

    configs = {"ours Z3 AdamW": (0.01, 2**20), "FSDP2 AdamW": (0.02, 2**21)}
    timings = {c: timed(t) for c, (t, _) in configs.items()}
    rows = summarize(
        "wide", fsdp.QUICK["wide"], timings, {c: memory(c, m) for c, (_, m) in configs.items()}, 2
    )
    run = dict(
        name="fsdp_zero3", world=2, worlds={"zero3": 2}, steps=2, warmup=1, memory_steps=2, malloc=None
    )
    run.update(shapes={"wide": fsdp.QUICK["wide"]}, quick=True, threads=[1, 1], wall_s=1.0, torchrun=True)
    with results_in(tmp_path):
        out = report({"zero3": {"rows": rows, "scaling": []}}, {**run, "device": "cuda", "backend": "nccl"})
    ours = config_row(out["zero3"], "ours Z3 AdamW")
    assert ours["train x"] == pytest.approx(0.5) and ours["peak live x"] == pytest.approx(0.5)
    assert not {*NOT_ON_CUDA, "peak RSS MB", "peak at", "update x"} & set(ours)
    printed = capsys.readouterr().out
    assert "nccl under torchrun" in printed and "exposed fwd" not in printed and "peak RSS" not in printed
    assert (tmp_path / "fsdp_zero3_torchrun_quick.json").exists()
