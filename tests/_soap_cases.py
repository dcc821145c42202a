"""Shared cases of the SOAP tests: a model whose loss is linear in each parameter (so a parameter's
gradient is exactly its input), per-rank inputs whose mean is exact at any world size, `vo.SOAP` trained
on them under ZeRO-2, ZeRO-3 or HSDP, and the one-process reference fed the mean.

Rank r's gradient is `base + (r - (W - 1) / 2) * other`, both of normal values rounded to multiples of
2^-12: every partial sum is exact in fp32, so the averaged gradient is `base` exactly at every world
size, in any order of summation, and results can be compared bit for bit across world sizes."""

from __future__ import annotations

import importlib.util
import os

import torch
import torch.distributed as dist
from _soap_reference import ReferenceSOAP

import vescale_optim as vo

# 2-D, 3-D, 4-D and 1-D parameters; a dimension longer than max_precond_dim (21 > 12); a 1 x 6 one
SHAPES = [(10, 7), (8, 3, 2), (13,), (5, 12), (1, 6), (6,), (4, 3, 2, 5), (21, 16)]
# (parameter indices, hyperparameters) per group: refreshes every 2 and 3 Adam steps, merged
# dimensions from channels-last, 1-D preconditioning, normalized updates without bias correction
MIXED = [
    ([0, 1, 2, 7], dict(max_precond_dim=12, precondition_frequency=2, weight_decay=0.1)),
    ([3, 4, 5], dict(precondition_frequency=3, precondition_1d=True, shampoo_beta=0.9, betas=(0.9, 0.99))),
    (
        [6],
        dict(
            merge_dims=True,
            max_precond_dim=12,
            data_format="channels_last",
            normalize_grads=True,
            correct_bias=False,
            precondition_frequency=1,
        ),
    ),
]
COMMON = dict(lr=0.01)
STEPS = 5
# Against the reference (a different order of floating-point operations: moments carried every
# refresh the same way, rotations by other contractions), 12 steps of MIXED's groups measured at most
# 4.8e-7 absolute on parameters of size about 1: a tenfold margin.
TOL = dict(rtol=1e-5, atol=5e-6)


def dyadic(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.round(torch.randn(shape, generator=g) * 4096) / 4096


def base_grad(step: int, i: int, shape) -> torch.Tensor:
    return dyadic(shape, 1000 * step + i)


def rank_grad(step: int, i: int, shape, rank: int, world: int) -> torch.Tensor:
    return base_grad(step, i, shape) + (rank - (world - 1) / 2) * dyadic(shape, 7 + 1000 * step + i)


def initial(shapes=SHAPES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in shapes]


class Block(torch.nn.Module):
    """One parameter, and a loss linear in it: its gradient is the input."""

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.w = torch.nn.Parameter(value.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


class Linear(torch.nn.Module):
    def __init__(self, shapes=SHAPES):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(v) for v in initial(shapes))

    def forward(self, xs) -> torch.Tensor:
        return sum(b(x) for b, x in zip(self.blocks, xs))


def groups(params, spec=MIXED, **extra) -> list[dict]:
    return [{"params": [params[i] for i in idx], **COMMON, **hyper, **extra} for idx, hyper in spec]


def build(spec=MIXED, shapes=SHAPES, layout: str = "zero2", **options):
    """The model and `vo.SOAP` over it: `layout` "zero2", "zero3" (each block a unit) or "hsdp" (a
    replicate x shard mesh, 2 x W/2 or W x 1, each block a unit)."""
    model = Linear(shapes)
    sharding = {}
    if layout in ("zero3", "hsdp"):
        sharding["shard_modules"] = list(model.blocks)
    if layout == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        replicas = 2 if world % 2 == 0 else world  # 2 x W/2, or W replicas of one rank
        shape = (replicas, world // replicas)
        sharding["mesh"] = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    params = [b.w for b in model.blocks]
    return model, vo.SOAP(groups(params, spec), **options, **sharding)


def train(model, opt, steps, shapes=SHAPES) -> None:
    """Steps `steps` (a range) on this rank's inputs."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    for t in steps:
        opt.zero_grad()
        model([rank_grad(t, i, s, rank, world) for i, s in enumerate(shapes)]).backward()
        opt.step()


def run(spec=MIXED, steps=STEPS, layout="zero2", shapes=SHAPES, **options) -> dict:
    """On every rank: train, then the parameters, the torch-format state dict and the plan's numbers."""
    model, opt = build(spec, shapes, layout, **options)
    train(model, opt, range(steps), shapes)
    return {
        "params": [v.clone() for v in model.state_dict().values()],
        "state": opt.state_dict(),
        "moved": opt.moved_params,
        "work": opt.refresh_work,
        "native": opt.native_refresh_work,
    }


def reference(spec=MIXED, steps=STEPS, shapes=SHAPES):
    """The reference fed the mean gradient: its parameters and the optimizer."""
    params = [torch.nn.Parameter(v) for v in initial(shapes)]
    opt = ReferenceSOAP(groups(params, spec))
    for t in range(steps):
        for i, p in enumerate(params):
            p.grad = base_grad(t, i, p.shape)
        opt.step()
    return params, opt


def order(spec=MIXED) -> list[int]:
    """Parameter indices in state-dict order (by group)."""
    return [i for idx, _ in spec for i in idx]


def check_state(state: dict, ref, params, spec=MIXED, tol=TOL) -> None:
    """Our torch-format state dict against the reference's state (both in the reference's layout)."""
    for pos, i in enumerate(order(spec)):
        want, got = ref.state[params[i]], state["state"][pos]
        assert float(got["step"]) == want["step"], (i, got["step"], want["step"])
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got[name], want[name], **tol, msg=f"param {i} {name}")
        for name in ("GG", "Q"):
            assert [len(x) for x in got[name]] == [len(x) for x in want[name]], (i, name)
            for a, b in zip(got[name], want[name]):
                if len(b):
                    torch.testing.assert_close(a, b, **tol, msg=f"param {i} {name}")


def assert_same_state(a: dict, b: dict) -> None:
    assert a["state"].keys() == b["state"].keys()
    for i, st in a["state"].items():
        assert st.keys() == b["state"][i].keys(), i
        for k, v in st.items():
            other = b["state"][i][k]
            pairs = zip(v, other) if isinstance(v, list) else [(v, other)]
            for x, y in pairs:
                assert (x == [] and y == []) or torch.equal(torch.as_tensor(x), torch.as_tensor(y)), (i, k)


def authors_soap():
    """The authors' `SOAP` class (github.com/nikhilvyas/SOAP, `soap.py`) from the file named by
    `SOAP_REFERENCE_PY`, else None. It is not part of this repository."""
    path = os.environ.get("SOAP_REFERENCE_PY")
    if not path or not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location("authors_soap", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SOAP
