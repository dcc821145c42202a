"""Checkpoints of a tensor-parallel model (issue #31, item 5), on 4 gloo ranks: saved at dp2 x tp2,
resumed at dp2 x tp2, dp4 x tp1 (a plain model) and dp1 x tp4, through DCP's sharded state dicts,
torch's full format and vo.CheckpointManager; each resumed run equals one process that never
stopped (torch.optim.AdamW on the mean gradient of each step's data-parallel ranks)."""

import pytest
import torch
from _resume import save_and_load
from _tp import ADAMW, at_layout, build, full, mean_grad, train

import vescale_optim as vo

pytestmark = pytest.mark.slow  # 4-rank TP runs, as the other tensor-parallel modules

BEFORE, AFTER = 2, 2  # steps before the save, steps after the resume
LAYOUTS = [(2, 2), (4, 1), (1, 4)]  # (dp, tp) of the resumed run


def reference(dp_after: int) -> dict:
    """One process that never stopped: BEFORE steps over 2 data-parallel batches, then AFTER
    steps over `dp_after`."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for t in range(BEFORE + AFTER):
        mean_grad(model, t, 2 if t < BEFORE else dp_after)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _setup(dp: int, tp: int, weights: dict | None = None):
    """The model at (dp, tp) (a plain one at tp=1) with vo.AdamW, and this rank's dp rank."""
    return at_layout(dp, tp, lambda params, **mesh: vo.AdamW(params, **mesh, **ADAMW), weights)


def _full(model) -> dict:
    return full(model.state_dict())


def _round_trip(path: str, kind: str, dp: int, tp: int) -> dict:
    """Train BEFORE steps at dp2 x tp2, save (`kind`: "dcp", "full" or "manager"), resume at
    (dp, tp), train AFTER steps; the final parameters, whole."""
    model, opt, dp_rank = _setup(2, 2)
    train(model, opt, dp_rank, range(BEFORE))
    model, opt, dp_rank = save_and_load(kind, path, model, opt, BEFORE, _full, lambda w: _setup(dp, tp, w))
    train(model, opt, dp_rank, range(BEFORE, BEFORE + AFTER))
    return _full(model)


@pytest.mark.parametrize("kind", ["dcp", "full", "manager"])
@pytest.mark.parametrize("dp, tp", LAYOUTS, ids=[f"dp{d}xtp{t}" for d, t in LAYOUTS])
def test_saved_at_dp2_tp2_resumes_exactly_at(world, tmp_path, kind, dp, tp):
    want = reference(dp)
    for got in world(4).run(_round_trip, str(tmp_path / "ckpt"), kind, dp, tp, timeout=120):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def _pieces_are_global():
    """The DCP pieces of a TP parameter carry its global shape and its TP shard's offsets."""
    model, opt, _ = _setup(2, 2)
    piece = opt.sharded_model_state_dict(model)["wq.weight"]
    state = opt.sharded_state_dict(model)["state.wq.weight.exp_avg"]
    rows = [tuple(c.offsets) for c in piece.__create_chunk_list__()]
    return tuple(piece.shape), tuple(state.shape), rows


def test_dcp_pieces_carry_global_shapes_and_offsets(world):
    got = world(4).run(_pieces_are_global)
    for rank, (shape, state_shape, offsets) in enumerate(got):
        assert shape == state_shape == (16, 16)
        tp_rank = rank % 2  # wq is ColwiseParallel: rows [8 * tp_rank, 8 * tp_rank + 8)
        assert all(8 * tp_rank <= o[0] < 8 * tp_rank + 8 for o in offsets), (rank, offsets)
