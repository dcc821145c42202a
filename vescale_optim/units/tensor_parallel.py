"""Parameters that are DTensors of a tensor-parallel plan, as the units see them.

A model tensor-parallelised with torch's `parallelize_module` holds DTensor parameters: each
rank keeps its TP-local shard (`p.to_local()`) and the placements say how the shards make
the whole. The optimizer shards over the *data-parallel* mesh only, so a unit lays out each
parameter's local tensor (its shape, its elements), exactly as it lays out a plain parameter.
The parameter stays a DTensor (the same object) whose local tensor is a view of the unit's buffer
(`set_data`), so the DTensor reads and writes the unit's memory with no copy. Gradients are
DTensors of the same placements whose local tensors are views of the unit's gradient buffer:
autograd accumulates into them in place (redistributing an incoming gradient of other
placements first, as DTensor does for any in-place op).

DTensors are recognised by their public attributes (`device_mesh`, `placements`,
`to_local`, `from_local`), so this module names nothing of `torch.distributed` itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def is_dtensor(t: object) -> bool:
    """Whether `t` is a DTensor (a parameter of a tensor-parallel plan, or its gradient)."""
    return isinstance(t, torch.Tensor) and hasattr(t, "device_mesh") and hasattr(t, "placements")


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor the units work on: a DTensor's local tensor (a view of the memory it holds),
    any other tensor itself."""
    if t is None or not is_dtensor(t):
        return t
    with torch.no_grad():
        return t.to_local()


def local_shape(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(local(p).shape)


def local_numel(p: torch.Tensor) -> int:
    return local(p).numel()


def like(p: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` (a tensor of `p`'s local shape) as what `p` holds: for a DTensor parameter a DTensor
    over `t` with `p`'s mesh, placements, global shape and stride (no communication)."""
    if t is None or not is_dtensor(p):
        return t
    return type(p).from_local(
        t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def set_grad(p: torch.Tensor, g: torch.Tensor | None) -> None:
    """`p.grad = g`, `g` of `p`'s local shape (wrapped as a DTensor for a DTensor parameter)."""
    p.grad = like(p, g)


def set_data(p: torch.Tensor, data: torch.Tensor) -> None:
    """Point `p`'s values (a DTensor's local tensor) at `data` (of its local shape).

    A DTensor parameter hands out views of the local tensor it holds (`to_local()`), so its
    memory cannot be re-pointed through them: the parameter takes the contents of a new
    DTensor parameter over `data` (`torch.utils.swap_tensors`: the same Python object, which
    the model and the optimizer keep), with its attributes. Tensor hooks registered on it
    before would stay with the old contents, so the units do this once, at construction, before
    their own hooks."""
    if not is_dtensor(p):
        p.data = data
        return
    if local(p).data_ptr() == data.data_ptr():
        return
    new = torch.nn.Parameter(like(p, data), requires_grad=p.requires_grad)
    for key, value in vars(p).items():
        if key not in vars(new):
            setattr(new, key, value)
    torch.utils.swap_tensors(p, new)


def is_tp_sharded(p: torch.Tensor) -> bool:
    """Whether `p`'s elements differ over its tensor-parallel ranks (a `Shard` placement):
    norms of its gradient sum over them; a replicated parameter counts once."""
    return is_dtensor(p) and any(pl.is_shard() for pl in p.placements)


def _ranks(mesh) -> set[int]:
    return {int(r) for r in mesh.mesh.reshape(-1).tolist()}


def dtensor_problem(params: Sequence[torch.Tensor], config, labels: dict[int, str]) -> str | None:
    """Why the DTensor parameters among `params` cannot be sharded over the data-parallel
    `config.mesh`, if they cannot (the same answer on every rank of a shared plan): a DTensor needs
    `mesh=`, and its own mesh must be orthogonal to `mesh` in one root mesh (the two meet in
    this rank alone, as `world["tp"]` and `world["dp"]` do); placements must be `Shard` or
    `Replicate` (a `Partial` parameter has no values of its own; strided shards are FSDP2's, read
    only over FSDP2's shards: `fsdp_shards`)."""
    mesh = config.mesh
    for p in params:
        if not is_dtensor(p):
            continue
        name = labels[id(p)]
        for pl in p.placements:
            if pl.is_partial():
                return (
                    f"parameter {name} is a DTensor with a Partial placement {tuple(p.placements)}: "
                    "a parameter must hold its values (Shard or Replicate); redistribute it before "
                    "building the optimizer"
                )
            if not (pl.is_replicate() or (pl.is_shard() and type(pl).__name__ == "Shard")):
                return (
                    f"parameter {name} has placement {pl!r}, which the optimizer does not read yet; "
                    "use Shard(dim) or Replicate() placements"
                )
        if mesh is None:
            return (
                f"parameter {name} is a DTensor (mesh {tuple(p.device_mesh.mesh_dim_names or ())}) and "
                "process_group= was given; with tensor parallelism pass the data-parallel mesh as mesh= "
                "instead (e.g. mesh=world['dp'] for world = init_device_mesh(..., mesh_dim_names=('dp', "
                "'tp'))), as to fully_shard; under FSDP2 pass neither (the optimizer runs over its shards)"
            )
        if p.device_mesh.device_type != mesh.device_type:
            return (
                f"parameter {name} is a DTensor on a {p.device_mesh.device_type} mesh, but mesh= is a "
                f"{mesh.device_type} mesh"
            )
        common = _ranks(p.device_mesh) & _ranks(mesh)
        if len(common) != 1:
            return (
                f"parameter {name} is a DTensor on mesh {p.device_mesh} "
                f"(ranks {sorted(_ranks(p.device_mesh))}), "
                f"which is not orthogonal to the data-parallel mesh= {mesh} (ranks {sorted(_ranks(mesh))}): "
                "both must be dimensions of one root mesh, e.g. world['tp'] and world['dp'] of "
                "init_device_mesh(..., mesh_dim_names=('dp', 'tp')). If FSDP2 (fully_shard) made these "
                "DTensors, pass no mesh=: the two supported ways are to let FSDP2 shard the model and pass "
                "its parameters with no mesh= (the optimizer runs over FSDP2's shards), or to leave the "
                "model unwrapped and pass shard_modules="
            )
    return None


def tp_groups(params: Sequence[torch.Tensor]) -> list:
    """The process groups over which some parameter of `params` is sharded (one per distinct
    mesh dimension holding a `Shard` placement), for norms summed over tensor parallelism."""
    seen, groups = set(), []
    for p in params:
        if not is_dtensor(p):
            continue
        for dim, pl in enumerate(p.placements):
            if pl.is_shard():
                group = p.device_mesh.get_group(dim)
                if id(group) not in seen:
                    seen.add(id(group))
                    groups.append(group)
    if len(groups) > 1:
        raise NotImplementedError(
            f"parameters are sharded over {len(groups)} tensor-parallel groups (mesh dimensions); one "
            "tensor-parallel dimension is supported yet"
        )
    return groups


def tp_norm_parts(units: Sequence, norm_type: float, device: torch.device, split: bool) -> torch.Tensor:
    """This rank's part of the gradient norm of `units` in float64: the sum of `|g|^norm_type`
    over its gradient shards (the max of `|g|` for the inf norm), as `[all]`, or with `split`
    as `[replicated, TP-sharded]` (the elements of parameters with a `Shard` placement apart,
    which differ over the TP ranks, so that their part can be summed over TP and the rest
    counted once)."""
    inf, f64 = math.isinf(norm_type), torch.float64

    def part(g: torch.Tensor) -> torch.Tensor:
        if g.numel() == 0:
            return torch.zeros((), dtype=f64, device=device)
        return (
            g.abs().max().to(f64) if inf else torch.linalg.vector_norm(g, norm_type, dtype=f64) ** norm_type
        )

    parts: list[list[torch.Tensor]] = [[], []]
    for u in units:
        if not u.grads.shard_bytes:
            continue
        shard = u.grads.shard
        if not split:
            parts[0].append(part(shard))
            continue
        for i, p in enumerate(u.params):
            start, stop = u.full.local_range(i)
            if stop > start:
                parts[int(is_tp_sharded(p))].append(part(shard[start:stop]))
    total = torch.zeros(2 if split else 1, dtype=f64, device=device)
    for k, found in enumerate(parts[: len(total)]):
        if found:
            total[k] = torch.stack(found).max() if inf else torch.stack(found).sum()
    return total


# --- where a TP rank's local shard sits in the whole (checkpoints) ---------------------------


def box_at(shape: tuple[int, ...], placements, mesh_shape: Sequence[int], coordinate: Sequence[int]):
    """`(origin, sizes)` of the shard at mesh `coordinate` of a DTensor of global `shape`: each
    `Shard(d)` cuts dimension `d` as DTensor does, `torch.chunk`'s way (pieces of `ceil(n / size)`,
    the last ones shorter or empty), nested in mesh-dimension order, except that FSDP2's strided
    shard of a dimension (`_StridedShard`: TP cut that dimension first) applies after the others."""
    origin, sizes = [0] * len(shape), list(shape)
    strided = [type(pl).__name__ == "_StridedShard" for pl in placements]
    for k in sorted(range(len(placements)), key=lambda k: strided[k]):
        pl = placements[k]
        if not (pl.is_shard() or strided[k]):  # (torch's strided shard is no `Shard`)
            continue
        d, n = pl.dim % len(shape), mesh_shape[k]
        chunk = -(-sizes[d] // n)
        start = min(coordinate[k] * chunk, sizes[d])
        origin[d] += start
        sizes[d] = min(start + chunk, sizes[d]) - start
    return tuple(origin), tuple(sizes)


def tp_box(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`(global shape, origin)` of `p`'s local tensor: the whole tensor's shape and the offsets of
    this rank's shard inside it (zeros for a plain parameter; see `box_at`); the result must give
    the local shape."""
    whole = tuple(p.shape)
    if not is_dtensor(p):
        return whole, (0,) * len(whole)
    mesh = p.device_mesh
    origin, sizes = box_at(whole, p.placements, tuple(mesh.mesh.shape), mesh.get_coordinate())
    if tuple(sizes) != local_shape(p):
        raise ValueError(
            f"a DTensor of shape {whole} and placements {tuple(p.placements)} holds a local tensor of "
            f"shape {local_shape(p)}, not the {tuple(sizes)} its placements give: an uneven layout "
            "the checkpoint cannot place"
        )
    return whole, tuple(origin)


def tp_slice(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's local shard of `full`, a tensor of `p`'s global shape (a view)."""
    whole, origin = tp_box(p)
    out = full.view(whole)
    for d, (o, n) in enumerate(zip(origin, local_shape(p))):
        out = out.narrow(d, o, n)
    return out


def tp_full(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of which `t` (of `p`'s local shape) is this rank's shard: gathered over
    `p`'s tensor-parallel ranks by DTensor itself (collective over them); `t` for a plain one."""
    if not is_dtensor(p):
        return t
    return like(p, t.contiguous()).full_tensor()


def check_same_shard(p: torch.Tensor, value: object, what: str) -> None:
    """A DTensor `value` in a state dict (torch.optim's over a TP model) loads only into a
    parameter of its mesh and placements, whose local tensor is its own shard; refused by name
    otherwise. Any other value passes (a whole tensor, sliced on load)."""
    if not is_dtensor(value):
        return
    same = is_dtensor(p) and value.device_mesh == p.device_mesh
    if not same or tuple(value.placements) != tuple(p.placements):
        raise ValueError(
            f"{what} is a DTensor of placements {tuple(value.placements)} on mesh {value.device_mesh}, but "
            "the parameter is not a DTensor of the same mesh and placements; pass whole tensors "
            "(this library's opt.state_dict()) or call .full_tensor() on them first"
        )


def tp_description(p: torch.Tensor) -> tuple | None:
    """What every rank of one data-parallel group must agree on about `p`'s tensor parallelism
    (None for a plain parameter): the global shape, the placements and the TP mesh's shape."""
    if not is_dtensor(p):
        return None
    mesh = p.device_mesh
    return tuple(p.shape), tuple(repr(pl) for pl in p.placements), tuple(mesh.mesh.shape)
