"""Parameters another data-parallel layer shards: FSDP2's (`fully_shard`) DTensors.

FSDP2 keeps each parameter as a DTensor whose local tensor is this rank's shard (`Shard(0)`
rows, cut `torch.chunk`'s way; HSDP adds a `Replicate` dimension; with tensor parallelism the
placements of its 2-D mesh) and reduce-scatters the gradients itself, into `.grad` (a DTensor
of the same placements). The optimizer is then the optimizer over those shards and nothing
more: its units lay out each parameter's local tensor over this rank alone, its state lives
beside them, element-wise math runs on them, and math that needs a whole matrix brings
each matrix to one balanced owner in the world of the DTensors' mesh and sends every rank its
piece back (`WholeMoves`). FSDP2 owns the parameters' memory (its all-gathers read it), so a
unit never re-points it (`Unit(external=True)`): a large local shard gets a unit of its own whose
shard is that memory and whose gradient shard is FSDP2's local gradient (`own_unit`, `copy_in`,
`FsdpGrads.take_unit`: the update writes FSDP2's parameter in place, nothing is copied); the
other units copy their local shards in before an update and back after it, and their gradients
from `.grad` as FSDP2 left it.

The optimizer takes this part when its parameters are DTensors and it is given no `mesh=` or
`process_group=` (those say that the library itself is the data-parallel layer, over the
DTensors' tensor-parallel shards). Every rank of the world must hold its shard of every
parameter (the meshes span the world: FSDP2 over a part of it, as under pipeline stages, is
refused). The layout is FSDP2's: the zero-copy gains of the ragged layout need the unwrapped
path (`shard_modules=`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..shard.collectives import Comm, Handle, all_gather_object, all_to_all_v_
from ..shard.mesh import Groups, Topology
from .tensor_parallel import box_at, is_dtensor, local, local_shape
from .wrappers import WrappedGrads

TWO_WAYS = (
    "let FSDP2 shard the model and pass its parameters with no mesh=, process_group= or shard_modules= "
    "(the optimizer then runs over FSDP2's shards), or leave the model unwrapped and pass shard_modules= "
    "(the optimizer is then the data-parallel layer, ZeRO-3)"
)


def over_dtensors(params: Sequence[torch.Tensor], config) -> bool:
    """Whether the optimizer runs over shards another layer (FSDP2) keeps: DTensor parameters
    with neither `mesh=` nor `process_group=` given."""
    return config.mesh is None and config.process_group is None and any(is_dtensor(p) for p in params)


def shards_problem(params: Sequence[torch.Tensor], config, labels: dict[int, str]) -> str | None:
    """Why the optimizer cannot run over these DTensor shards, if it cannot (the same on every rank)."""
    if config.shard_modules is not None:
        return (
            "the parameters are DTensors (FSDP2's fully_shard, or tensor parallelism) and shard_modules= "
            f"was given: both would shard the same parameters. Either {TWO_WAYS}; with tensor parallelism "
            "under this library's data parallelism, pass mesh=world['dp'] too"
        )
    for p in params:
        name = labels[id(p)]
        if not is_dtensor(p):
            return (
                f"parameter {name} is a plain tensor next to DTensor parameters, and no mesh= was given: "
                "with tensor parallelism under this library's data parallelism, pass the data-parallel "
                "mesh as mesh= (e.g. mesh=world['dp']); over FSDP2's shards every parameter is one of "
                "FSDP2's DTensors (fully_shard the root module too)"
            )
        for pl in p.placements:
            if pl.is_partial():
                return (
                    f"parameter {name} is a DTensor with a Partial placement {tuple(p.placements)}: a "
                    "parameter must hold its values (Shard or Replicate)"
                )
        mesh = p.device_mesh
        _, sizes = box_at(tuple(p.shape), p.placements, tuple(mesh.mesh.shape), mesh.get_coordinate())
        if sizes != local_shape(p):
            return (
                f"parameter {name} has placements {tuple(p.placements)} whose local shard {local_shape(p)} "
                f"is not the {sizes} torch.chunk's cut gives; the optimizer reads Shard, Replicate "
                "and FSDP2's strided shards"
            )
    return None


@dataclass(frozen=True)
class Box:
    """Where one rank's local tensor lies in the whole: per dimension its first index and size."""

    origin: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def of(self, whole: torch.Tensor) -> torch.Tensor:
        """This box of `whole` (a view)."""
        out = whole
        for d, (o, n) in enumerate(zip(self.origin, self.sizes)):
            out = out.narrow(d, o, n)
        return out


class ShardMap:
    """Where every rank's shard of each parameter lies, over the whole world, learned in one
    exchange at construction. FSDP2's mesh of a parameter may be a slice of the world: next to
    tensor parallelism, a parameter TP leaves whole lives on each tp rank's dp mesh, identical
    copies on parallel meshes; the meshes of every rank together must cover the world (else
    `problem` says why, the same on every rank)."""

    def __init__(self, params: Sequence[torch.Tensor], world: Comm, labels: dict[int, str]):
        every = all_gather_object([p.device_mesh.mesh.tolist() for p in params], world)
        self.boxes: list[dict[int, Box]] = []  # per parameter, every rank's box
        self.senders: list[set[int]] = []  # per parameter, the ranks sending one copy of each element
        self.replication: list[int] = []  # per parameter, how many ranks hold each element
        self.problem: str | None = None
        self.meshes: list[list[torch.Tensor]] = []  # per parameter, its distinct meshes (rank grids)
        for k, p in enumerate(params):
            distinct = {str(r[k]): torch.tensor(r[k]) for r in every}.values()
            grids = sorted(distinct, key=lambda g: int(g.min()))
            self.meshes.append(grids)
            self._place(p, grids)
            covered = sorted(self.boxes[-1])
            if covered != list(range(world.world_size)) and self.problem is None:
                self.problem = (
                    f"parameter {labels[id(p)]} is a DTensor whose meshes cover ranks {covered} of a world "
                    f"of {world.world_size}: the optimizer runs over FSDP2's shards only when every rank "
                    "holds a shard of every parameter (FSDP2 over part of the world, as under pipeline "
                    "stages, is not supported yet); with tensor parallelism under this library's data "
                    "parallelism, pass the data-parallel mesh as mesh= (mesh=world['dp']) instead"
                )
        # FSDP2's mesh spans the world (its copies on parallel meshes are of parameters TP left whole);
        # tensor-parallel meshes alone (mesh= forgotten) would leave the data-parallel mean to nobody
        if self.problem is None and params and not any(len(g) == 1 for g in self.meshes):
            self.problem = (
                f"no parameter's mesh spans the world of {world.world_size} ranks, as FSDP2's does: these "
                "DTensors are tensor-parallel, and nothing averages their gradients over data parallelism; "
                "pass the data-parallel mesh as mesh= (mesh=world['dp']), or fully_shard the model first"
            )

    def _place(self, p: torch.Tensor, grids: list[torch.Tensor]) -> None:
        """Every rank's box of `p` on its mesh `grids` (copies of one another), and who sends: on the
        first mesh, the first replica along each `Replicate` dimension, with a non-empty box."""
        held, senders, shape = {}, set(), tuple(p.shape)
        for g, grid in enumerate(grids):
            for row in torch.cartesian_prod(*(torch.arange(n) for n in grid.shape)).reshape(-1, grid.ndim):
                c = tuple(int(x) for x in row)
                rank, box = int(grid[c]), Box(*box_at(shape, p.placements, tuple(grid.shape), c))
                held[rank] = box
                first = all(x == 0 for x, pl in zip(c, p.placements) if pl.is_replicate())
                if g == 0 and first and box.numel:
                    senders.add(rank)
        copies = math.prod(n for n, pl in zip(grids[0].shape, p.placements) if pl.is_replicate())
        self.boxes.append(held)
        self.senders.append(senders)
        self.replication.append(len(grids) * copies)


class WholeMoves:
    """Brings parameters' tensors (laid out like their local shards) whole to owners and back:
    `gather` sends every piece of tensor k to `owners[k]` in one all-to-all and returns the whole
    tensors this rank owns; `scatter` sends each rank its piece of them in another. The plan is
    fixed at construction (shapes and placements only), so nothing waits on the host. `traffic`:
    the bytes this rank has sent to other ranks and received from them so far."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        owners: Sequence[int],
        comm: Comm,
        boxes: Sequence[dict[int, Box]],
        senders: Sequence[set[int]],
    ):
        self.params, self.owners, self.comm = list(params), list(owners), comm
        self.boxes, self.senders = list(boxes), list(senders)
        me, world = comm.rank, comm.world_size
        self.mine = [k for k, o in enumerate(self.owners) if o == me]
        # gather: to owner o, this rank's pieces of the tensors o owns (if it sends them)
        self.gather_out = [
            [k for k, o in enumerate(self.owners) if o == r and me in self.senders[k]] for r in range(world)
        ]
        self.gather_in = [
            [k for k in self.mine if r in self.senders[k] and self.boxes[k][r].numel] for r in range(world)
        ]
        # scatter: from owner o, this rank's piece of each tensor o owns
        self.scatter_in = [
            [k for k, o in enumerate(self.owners) if o == r and self.boxes[k][me].numel] for r in range(world)
        ]
        self.scatter_out = [[k for k in self.mine if self.boxes[k][r].numel] for r in range(world)]
        self.traffic = [0, 0]  # bytes sent to and received from other ranks

    def _exchange(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], what: str
    ) -> Handle:
        """The all-to-all, issued (the caller waits for the handle); its bytes counted."""
        me, size = self.comm.rank, inp.element_size()
        self.traffic[0] += size * (sum(in_splits) - in_splits[me])
        self.traffic[1] += size * (sum(out_splits) - out_splits[me])
        return all_to_all_v_(out, inp, out_splits, in_splits, self.comm, async_op=True, what=what)

    def _count(self, plan: list[list[int]], theirs: bool) -> list[int]:
        """Elements per rank of `plan` (tensor indices per rank): of that rank's boxes (`theirs`)
        or of this rank's; none to this rank itself (its own pieces are copied, not sent)."""
        me = self.comm.rank
        return [
            0 if r == me else sum(self.boxes[k][r if theirs else me].numel for k in ks)
            for r, ks in enumerate(plan)
        ]

    def _packed(self, parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """`parts` (any strides) one after another in one flat tensor: each copied once."""
        out, at = like.new_empty(sum(t.numel() for t in parts)), 0
        for t in parts:
            out[at : at + t.numel()].view(t.shape).copy_(t)
            at += t.numel()
        return out

    def gather(
        self, pieces: Sequence[torch.Tensor], what: str, meanwhile: Callable[[], None] = lambda: None
    ) -> dict[int, torch.Tensor]:
        """`pieces[k]`: this rank's piece of tensor k (its local shape). The whole tensors this rank
        owns, by k; `meanwhile()` runs while the other ranks' pieces travel (after this rank's own
        are in place)."""
        like, me = pieces[0], self.comm.rank
        inp = self._packed([pieces[k] for r, ks in enumerate(self.gather_out) if r != me for k in ks], like)
        in_splits, out_splits = self._count(self.gather_out, False), self._count(self.gather_in, True)
        out = like.new_empty(sum(out_splits))
        handle = self._exchange(out, inp, out_splits, in_splits, what)
        wholes = {k: like.new_empty(tuple(self.params[k].shape)) for k in self.mine}
        for k in self.gather_in[me]:
            self.boxes[k][me].of(wholes[k]).copy_(pieces[k])
        meanwhile()
        handle.wait()
        at = 0
        for r, ks in enumerate(self.gather_in):
            for k in ks if r != me else ():
                box = self.boxes[k][r]
                box.of(wholes[k]).copy_(out[at : at + box.numel].view(box.sizes))
                at += box.numel
        return wholes

    def scatter(
        self,
        wholes: dict[int, torch.Tensor],
        like: torch.Tensor,
        what: str,
        meanwhile: Callable[[list], None] = lambda pieces: None,
    ) -> list:
        """Each rank's piece of the whole tensors (`wholes`, by k, on their owners) back: per
        tensor k, this rank's piece in its local shape (None where it holds none; a view of
        `wholes[k]` where this rank owns k). `meanwhile(pieces)` runs while the other owners'
        pieces travel, with this rank's own pieces only (the others still None)."""
        me = self.comm.rank
        ranks = enumerate(self.scatter_out)
        inp = self._packed([self.boxes[k][r].of(wholes[k]) for r, ks in ranks if r != me for k in ks], like)
        in_splits, out_splits = self._count(self.scatter_out, True), self._count(self.scatter_in, False)
        out = like.new_empty(sum(out_splits))
        handle = self._exchange(out, inp, out_splits, in_splits, what)
        pieces: list[torch.Tensor | None] = [None] * len(self.params)
        for k in self.scatter_in[me]:
            pieces[k] = self.boxes[k][me].of(wholes[k])
        meanwhile(list(pieces))
        handle.wait()
        at = 0
        for r, ks in enumerate(self.scatter_in):
            for k in ks if r != me else ():
                pieces[k] = out[at : at + self.boxes[k][me].numel].view(self.boxes[k][me].sizes)
                at += self.boxes[k][me].numel
        return pieces


OWN_UNIT_NUMEL = 1 << 16  # a local shard this large gets a unit of its own, the shard its memory


def own_unit(p: torch.Tensor) -> bool:
    """Whether FSDP2's parameter `p` gets a unit of its own, whose shard is then its local tensor
    wherever that can be (`copy_in`; a padded or strided one is still copied): one that needs no
    fp32 master, with local shards large enough (`OWN_UNIT_NUMEL` elements a mesh rank on
    average) that three passes over them (a copy in, a copy out, a copy of the gradient) cost
    more than a unit's own fixed work (a call per segment and step). Decided from the global
    shape and mesh, so that every rank plans the same units (FSDP2's uneven chunks differ)."""
    return (
        is_dtensor(p)
        and p.dtype not in (torch.bfloat16, torch.float16)
        and p.numel() >= OWN_UNIT_NUMEL * p.device_mesh.size()
    )


def flat_alias(t: torch.Tensor | None, dtype: torch.dtype, numel: int, device: torch.device):
    """`t` flat, where a shard of `dtype`, `numel` elements on `device` can be it (a view), else None."""
    if t is None or t.dtype != dtype or t.numel() != numel or t.device != device or not t.is_contiguous():
        return None
    return t.view(-1)


@torch.no_grad()
def copy_in(unit) -> None:
    """An external unit's shard from its parameters' local tensors (their memory is another
    layer's, which may have written them: a loaded model state dict). A unit of one parameter
    whose local tensor can be the shard borrows it (`unit.borrowed`: the update then writes
    FSDP2's memory itself, with no copy either way; taken anew each time, so memory FSDP2
    re-points is followed). Otherwise the unit keeps a shard of its own: one of the parameters'
    dtype takes them all; an fp32 master those that differ from it rounded."""
    alias = flat_alias(local(unit.params[0]), unit.shard_dtype, unit.layout.shard_size, unit.device)
    if len(unit.params) == 1 and alias is not None:
        unit.shard, unit.borrowed = alias, True
        return
    if unit.borrowed or unit.shard.numel() != unit.layout.shard_size:  # (at construction: not yet)
        unit.shard = torch.zeros(unit.layout.shard_size, dtype=unit.shard_dtype, device=unit.device)
        unit.borrowed = False
    master = unit.shard_dtype != unit.orig_dtype
    for i, p in enumerate(unit.params):
        start, stop = unit.full.local_range(i)
        value, piece = local(p).reshape(-1), unit.shard[start:stop]
        if master:
            torch.where(piece.to(value.dtype) != value, value.to(piece.dtype), piece, out=piece)
        else:
            piece.copy_(value)


@torch.no_grad()
def copy_out(unit) -> Handle:
    """The updated shard into the parameters' local tensors (FSDP2 gathers from them; nothing
    to copy where the shard is that memory)."""
    for i, p in enumerate(unit.params if not unit.borrowed else ()):
        start, stop = unit.full.local_range(i)
        local(p).view(-1).copy_(unit.shard[start:stop])
    return Handle()


def shard_groups() -> Groups:
    """The groups of a runtime over FSDP2's shards: its units lay out this rank's local tensors
    alone; agreements and the owners of whole matrices span the world (the default group)."""
    alone = Comm.alone()
    return Groups(alone, alone, Comm(None), Topology.flat(alone))


class FsdpGrads(WrappedGrads):
    """A runtime's gradients over FSDP2's shards: `.grad` is FSDP2's reduced DTensor gradient."""

    MODEL_STATE = (
        "under FSDP2 the model's parameters are FSDP2's DTensors: save and load them with "
        "torch.distributed.checkpoint.state_dict.get_model_state_dict / set_model_state_dict"
    )

    def __init__(self, units, tracker, shards: ShardMap, params: Sequence[torch.Tensor]):
        super().__init__(units, tracker)
        self.shards = shards
        self.index = {id(p): k for k, p in enumerate(params)}  # the map's parameter order

    @classmethod
    def of(cls, units, tracker, params: Sequence[torch.Tensor], world: Comm, labels: dict[int, str]):
        """Over `params`' shards in `world` (collective: the meshes' exchange); ValueError on every
        rank where they do not cover it."""
        shards = ShardMap(params, world, labels)
        if shards.problem is not None:
            raise ValueError(shards.problem)
        return cls(units, tracker, shards, params)

    def take_unit(self, u) -> list[bool]:
        """As `WrappedGrads.take_unit`; a unit of one parameter borrows its local gradient, where
        it can, as the gradient shard itself (no copy: `GradBuffers.borrow`)."""
        grad = local(u.params[0].grad) if len(u.params) == 1 else None
        alias = flat_alias(grad, u.shard_dtype, u.layout.shard_size, u.device)
        u.grads.borrow(alias)
        if alias is None:
            return super().take_unit(u)
        u.grads.has_values = True
        return [True]

    def where(self, p: torch.Tensor) -> tuple[dict[int, Box], set[int]]:
        """Every rank's box of `p` and the ranks that send it whole to an owner (`WholeMoves`)."""
        k = self.index[id(p)]
        return self.shards.boxes[k], self.shards.senders[k]

    def norm_parts(self, norm_type: float, device: torch.device) -> torch.Tensor:
        """This rank's part of the whole gradient's norm in float64: `sum |g|^p` over its shards,
        each divided by how many ranks hold the same elements (so the world's sum counts every
        element once; the max for the inf norm)."""
        inf, total = math.isinf(norm_type), torch.zeros(1, dtype=torch.float64, device=device)
        for u in self.units:
            if not u.grads.shard_bytes:
                continue
            for i, p in enumerate(u.params):
                start, stop = u.full.local_range(i)
                if stop <= start:
                    continue
                g = u.grads.shard[start:stop]
                if inf:
                    total = torch.maximum(total, g.abs().max().to(torch.float64))
                else:
                    part = torch.linalg.vector_norm(g, norm_type, dtype=torch.float64) ** norm_type
                    total += part / self.shards.replication[self.index[id(p)]]
        return total
