"""torch.distributed.checkpoint through DCP's own extension protocol: a rank's ragged piece is
a set of chunks (one per box of its flat range); no deprecated types, no warnings, and no
decoded copies held by the optimizer."""

import contextlib
import math
import random
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.planner import WriteItemType
from torch.profiler import ProfilerActivity, profile

import vescale_optim as vo
from vescale_optim.shard import flat_range_boxes
from vescale_optim.shard.dcp import DcpPiece, dcp_piece

# dcp.save/load warn on their own when there is no process group (torch's message, not ours)
NO_DIST = "torch.distributed is disabled"


def _full(shape):
    n = math.prod(shape)
    return (torch.arange(n, dtype=torch.float64) * 0.5 + 1).view(shape)


def _box(t, offsets, sizes):
    return t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]


# --- the piece alone ----------------------------------------------------------------------


@given(st.lists(st.integers(1, 5), max_size=4), st.data())
def test_piece_chunks_tile_its_flat_range_exactly(shape, data):
    shape = tuple(shape)
    n = math.prod(shape)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    full, flat = _full(shape), _full(shape).reshape(-1)
    index = torch.arange(n).view(shape)
    view = dcp_piece(shape, start, stop, flat[start:stop])
    reader = dcp_piece(
        shape, start, stop, read=lambda a, b: flat[start + a : start + b].clone(), dtype=torch.float64
    )
    for piece in (view, reader):
        assert isinstance(piece, torch.Tensor) and piece.shape == shape and piece.dtype == torch.float64
        items = piece.__create_write_items__("x", piece)
        assert len(items) == len(flat_range_boxes(shape, start, stop))
        covered = torch.zeros(n, dtype=torch.int64)
        for item in items:
            chunk = item.tensor_data.chunk
            assert item.type == WriteItemType.SHARD and item.tensor_data.size == torch.Size(shape)
            assert item.index.offset == chunk.offsets
            assert torch.equal(piece.__get_tensor_shard__(item.index), _box(full, chunk.offsets, chunk.sizes))
            covered[_box(index, chunk.offsets, chunk.sizes).reshape(-1)] += 1
        assert covered.tolist() == [int(start <= i < stop) for i in range(n)]
    # planning a load gives the same chunks; a reader piece then loads into its own buffer
    for piece in (view, reader):
        chunks = piece.__create_chunk_list__()
        assert [(c.offsets, c.sizes) for c in chunks] == [
            (i.tensor_data.chunk.offsets, i.tensor_data.chunk.sizes)
            for i in piece.__create_write_items__("x", piece)
        ]
    assert view.take_loaded() is None
    if stop > start:
        assert torch.equal(reader.loaded, flat[start:stop])
        assert reader.loaded.data_ptr() != flat.data_ptr()
    assert reader.take_loaded() is not None or stop == start
    assert reader.loaded is None


def test_piece_has_metadata_but_no_values():
    piece = dcp_piece((4, 3), 2, 7, torch.zeros(5))
    assert piece.size() == (4, 3) and piece.dim() == 2 and piece.device.type == "cpu"
    assert "elements [2, 7) in 3 chunks" in repr(piece)
    with pytest.raises(TypeError, match="holds no values"):
        piece.sum()
    with pytest.raises(TypeError, match="holds no values"):
        torch.add(piece, 1)
    with pytest.raises(TypeError):
        piece + 1
    with pytest.raises(ValueError, match="exactly one of values and read"):
        dcp_piece((4, 3), 0, 2)
    with pytest.raises(ValueError, match="flat with 5 elements"):
        dcp_piece((4, 3), 2, 7, torch.zeros(6))
    with pytest.raises(ValueError, match=r"not inside a tensor of shape \(4, 3\)"):
        dcp_piece((4, 3), 2, 13, read=lambda a, b: None, dtype=torch.float32)


SHAPES = [(5, 7, 3), (13,), (4, 6), ()]


def _cuts(seed, world):
    rng = random.Random(seed)
    sizes = [math.prod(s) for s in SHAPES]
    return [[0, *sorted(rng.randint(0, n) for _ in range(world - 1)), n] for n in sizes]


def _rank():
    return dist.get_rank() if dist.is_initialized() else 0


def _save_pieces(path, cuts):
    r = _rank()
    sd = {
        f"t{k}": {"x": dcp_piece(s, c[r], c[r + 1], _full(s).reshape(-1)[c[r] : c[r + 1]])}
        for k, (s, c) in enumerate(zip(SHAPES, cuts))
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=NO_DIST)
        dcp.save(sd, checkpoint_id=path)


def _load_pieces(path, cuts, reader):
    r, pieces, dests = _rank(), {}, []
    for k, (s, c) in enumerate(zip(SHAPES, cuts)):
        a, b = c[r], c[r + 1]
        dests.append(torch.zeros(b - a, dtype=torch.float64))
        if reader:
            zeros = lambda lo, hi: torch.zeros(hi - lo, dtype=torch.float64)  # noqa: E731
            pieces[f"t{k}"] = {"x": dcp_piece(s, a, b, read=zeros, dtype=torch.float64)}
        else:
            pieces[f"t{k}"] = {"x": dcp_piece(s, a, b, dests[-1])}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=NO_DIST)
        dcp.load(pieces, checkpoint_id=path)
    for k, (s, c) in enumerate(zip(SHAPES, cuts)):
        got = pieces[f"t{k}"]["x"].take_loaded() if reader else dests[k]
        if c[r + 1] > c[r]:
            torch.testing.assert_close(got, _full(s).reshape(-1)[c[r] : c[r + 1]], rtol=0, atol=0)
    return True


@pytest.mark.parametrize("seed", [0, 1])
def test_ragged_pieces_save_at_3_load_at_2_and_1(world, tmp_path, seed):
    path = str(tmp_path / "pieces")
    cuts3 = _cuts(seed, 3)
    world(3).run(_save_pieces, path, cuts3)
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for k, (s, c) in enumerate(zip(SHAPES, cuts3)):
        boxes = sum(len(flat_range_boxes(s, c[r], c[r + 1])) for r in range(3))
        assert md[f"t{k}.x"].size == torch.Size(s) and len(md[f"t{k}.x"].chunks) == boxes
    for reader in (False, True):
        world(2).run(_load_pieces, path, _cuts(seed + 10, 2), reader)
        _load_pieces(path, _cuts(0, 1), reader)  # one process, no process group


# --- the optimizers' sharded state dict -----------------------------------------------------


def _params(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in [(48, 130), (7,), (40, 128)]]


def _opt(dtype, bits, steps):
    params = _params(dtype)
    named = [(f"p{i}", p) for i, p in enumerate(params)]  # DCP's keys name them
    opt = vo.AdamW(named, lr=1e-2, state_bits=bits)
    for t in range(steps):
        g = torch.Generator().manual_seed(100 + t + _rank())
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
        opt.step()
    return opt


def _bytes_held(root) -> int:
    """Bytes of the storages of every tensor reachable from `root` through the project's objects."""
    storages, seen, todo = {}, set(), [root]
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, DcpPiece):
            todo += list(vars(x).values())
        elif isinstance(x, torch.Tensor):
            s = x.untyped_storage()
            storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
        elif isinstance(x, dict):  # what the dict holds (reading `opt.state` would make its views)
            todo += list(dict.keys(x)) + list(dict.values(x))
        elif isinstance(x, (list, tuple, set)):
            todo += list(x)
        elif x is root or type(x).__module__.startswith("vescale_optim"):
            todo += list(vars(x).values())
    return sum(storages.values())


def _pieces(sd):
    return [v for v in sd.values() if isinstance(v, DcpPiece)]


@contextlib.contextmanager
def _no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=NO_DIST)
        yield


def _dcp_no_copies(path, mode, dtype, bits):
    """Save or load; what the optimizer holds at each point, the largest allocation of
    `sharded_state_dict()`, which pieces held a loaded buffer, and the state after."""
    opt = _opt(dtype, bits, 2 if mode == "save" else 0)
    held, loaded = [_bytes_held(opt)], []
    with _no_warnings():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            sd = opt.sharded_state_dict()
        biggest = max((e.cpu_memory_usage for e in prof.events()), default=0)
        held.append(_bytes_held(opt))
        if mode == "save":
            dcp.save(sd, checkpoint_id=path)
        else:
            dcp.load(sd, checkpoint_id=path)
            loaded = [p.loaded is not None for p in _pieces(sd)]
            opt.load_sharded_state_dict(sd)
            assert all(p.loaded is None for p in _pieces(sd))
        held.append(_bytes_held(opt))
    return held, biggest, loaded, opt.state_dict()


@pytest.mark.parametrize("dtype, bits", [(torch.bfloat16, 32), (torch.bfloat16, 16), (torch.bfloat16, 8)])
def test_sharded_state_dict_holds_no_copies_and_warns_nothing(world, tmp_path, dtype, bits):
    path = str(tmp_path / "opt")
    saved = world(2).run(_dcp_no_copies, path, "save", dtype, bits)
    loaded = [_dcp_no_copies(path, "load", dtype, bits)]  # one process, no process group
    loaded += world(3).run(_dcp_no_copies, path, "load", dtype, bits)
    for held, biggest, _, _ in saved + loaded:
        assert len(set(held)) == 1, held  # nothing new is referenced by the optimizer, ever
        assert biggest <= 64, biggest  # sharded_state_dict() decodes nothing: views and readers only
    for *_, was_loaded, _ in loaded:
        assert any(was_loaded) == (bits < 32)  # low-bit state is decoded into buffers only to load
    want = saved[0][3]
    for *_, got in loaded:
        for i, entry in want["state"].items():
            for k, v in entry.items():
                torch.testing.assert_close(got["state"][i][k], v, rtol=1e-6, atol=0)


def _shampoo_dcp(path, mode):
    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(21, 10), (6,), (9, 4)]]
    named = torch.nn.ParameterList(params).named_parameters()  # DCP's keys name them
    opt = vo.Shampoo(named, max_preconditioner_dim=4, epsilon=1e-6)
    if mode == "save":
        for t in range(2):
            gg = torch.Generator().manual_seed(10 * t)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gg)
            opt.step()
    held = _bytes_held(opt)
    with _no_warnings():
        sd = opt.sharded_state_dict()
        if mode == "save":
            dcp.save(sd, checkpoint_id=path)
        else:
            dcp.load(sd, checkpoint_id=path)
            opt.load_sharded_state_dict(sd)
    assert _bytes_held(opt) == held
    return opt.state_dict()


def test_shampoo_factors_round_trip_without_warnings(world, tmp_path):
    path = str(tmp_path / "shampoo")
    want = world(2).run(_shampoo_dcp, path, "save")[0]
    got = world(3).run(_shampoo_dcp, path, "load")[0]
    assert got["state"].keys() == want["state"].keys()
    for i, entry in want["state"].items():
        assert got["state"][i].keys() == entry.keys()
        for k, v in entry.items():
            torch.testing.assert_close(got["state"][i][k], v, rtol=0, atol=0)
