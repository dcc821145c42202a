"""The optimizers' one view of tensor parallelism (`units.tp_view.TensorParallel`, built by the
runtime): each parameter's cut against DTensor's own layout of it, and the dp x tp world against
the device mesh (dp2 x tp2 on 4 gloo ranks)."""

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import vescale_optim as vo
from vescale_optim.units.tp_view import MeshCut, param_cut

# (global shape, placement over tp): row and column blocks, uneven shards (DTensor's chunks of
# ceil(n / 2): 3 + 2 rows, 2 + 1 elements), a replicated matrix and an expert stack
CASES = [
    ((6, 4), Shard(0)),
    ((4, 6), Shard(1)),
    ((5, 3), Shard(0)),
    ((3,), Shard(0)),
    ((4, 4), Replicate()),
    ((4, 3, 2), Shard(0)),
]


def _view():
    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = world["tp"]
    torch.manual_seed(0)  # every rank draws the same whole tensors
    wholes = [torch.randn(shape) for shape, _ in CASES] + [torch.randn(3, 2)]
    params = [nn.Parameter(distribute_tensor(w, tp, [pl])) for w, (_, pl) in zip(wholes, CASES)]
    params.append(nn.Parameter(wholes[-1].clone()))  # a plain parameter
    locals_ = [(p.to_local() if i < len(CASES) else p).detach().clone() for i, p in enumerate(params)]
    before = [param_cut(p) for p in params]
    opt = vo.AdamW(params, mesh=world["dp"], lr=0.1)
    view = opt.runtime.tensor_parallel
    index = tp.get_local_rank()
    for p, whole, local, cut, (shape, pl) in zip(params, wholes, locals_, before, [*CASES, ((3, 2), None)]):
        assert view.cut(p) == cut == param_cut(p)  # the same before the runtime took the parameter
        assert cut.shape == shape and cut.local_shape == tuple(local.shape)
        box = whole[tuple(slice(o, o + n) for o, n in zip(cut.origin, cut.local_shape))]
        assert torch.equal(box, local), (shape, pl, cut)
        sharded = pl is not None and pl.is_shard()
        assert cut.cuts == ((MeshCut(0, pl.dim, 2, index),) if sharded else ())
        assert cut.dtensor == (pl is not None) and cut.sharded == sharded
    dp_tp = view.world()
    assert view.world() is dp_tp  # made once
    mesh = world.mesh.tolist()  # mesh[dp][tp]: the global rank (the dp x tp world is every rank)
    assert dp_tp.sharded.ranks == (tuple(mesh[s][t] for t in range(2) for s in range(2)),)
    assert dp_tp.replicated.ranks == tuple(tuple(mesh[s][t] for s in range(2)) for t in range(2))
    me = dp_tp.comm.rank
    for topo in (dp_tp.sharded, dp_tp.replicated):
        assert topo.ranks[topo.replica][topo.shard] == me
    return view.size, view.index, index


def test_tensor_parallel_view_is_dtensors_layout_and_the_meshes_world(world):
    answers = world(4).run(_view, timeout=120)
    assert [a[0] for a in answers] == [2] * 4
    assert [a[1] for a in answers] == [a[2] for a in answers] == [0, 1, 0, 1]
