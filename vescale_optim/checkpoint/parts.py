"""The model parts and optimizers that one checkpoint holds: a model and its optimizer, or, as
torchtitan's checkpointer takes them, a list of model parts with one optimizer each (this
rank's pipeline stages).

A part's parameters are keyed by name (`opt.sharded_model_state_dict(part)`), its optimizer's
state by parameter name (`opt.sharded_state_dict(part)`), so the parts of every rank merge
into one checkpoint with disjoint keys, and a load at another pipeline degree finds each
parameter by its name. A checkpoint is of the whole world: every rank's optimizer spans all
of it (times its tensor-parallel ranks) or, under pipeline parallelism, its stage's ranks,
while the other stages' ranks hold the rest of the model. `Parts.agree` checks that once, at
construction, and describes the whole model and every param group for the manifest.
"""

from __future__ import annotations

import hashlib
import math

from torch import nn

from ..optim.sharded_state import param_names
from ..shard.collectives import Comm, all_gather_object
from .dcp_tree import persistent_buffers
from .manifest import describe_groups


def _listed(x) -> list:
    return list(x) if isinstance(x, list | tuple) else [x]


def _span(optimizer) -> int:
    """The ranks an optimizer's state spans: its data-parallel ranks times its tensor-parallel ones."""
    runtime = optimizer.runtime
    return runtime.dp.world_size * math.prod(c.world_size for c in runtime.tensor_parallel.groups)


class Parts:
    """`model` and `optimizer` as the manager was given them: one of each, or lists of equal
    length (part k stepped by optimizer k)."""

    def __init__(self, model: nn.Module | list[nn.Module], optimizer):
        models, optimizers = _listed(model), _listed(optimizer)
        if not models or len(models) != len(optimizers):
            raise ValueError(
                f"give one optimizer per model part: got {len(models)} model parts and "
                f"{len(optimizers)} optimizers"
            )
        for opt in optimizers:
            if not hasattr(opt, "sharded_state_dict"):
                raise TypeError(f"{type(opt).__name__} is not a vescale_optim optimizer")
        self.pairs = list(zip(models, optimizers))
        self.names = [param_names(opt.param_groups, opt.runtime.root, m) for m, opt in self.pairs]
        self.params = [list(opt.sharded_model_state_dict(m)) for m, opt in self.pairs]
        owner: dict[str, int] = {}
        for k, names in enumerate(self.names):
            for name in names:
                if owner.setdefault(name, k) != k:
                    raise ValueError(f"model parts {owner[name]} and {k} both hold {name!r}")
        spans = {_span(opt) for opt in optimizers}
        if len(spans) > 1:
            raise ValueError(f"this rank's optimizers span different numbers of ranks: {sorted(spans)}")
        self.span = spans.pop()

    def state(self, by_index: bool = False) -> tuple[dict, dict]:
        """This rank's model and optimizer state for DCP (live pieces, no copies): parameters and
        persistent buffers by name, optimizer state by parameter name (by index: the layout
        of checkpoints of format 1 and 2, one optimizer only)."""
        model, optim = {}, {}
        for m, opt in self.pairs:
            model.update(opt.sharded_model_state_dict(m))
            model.update(persistent_buffers(m))
            optim.update(opt.sharded_state_dict(m, keys="index" if by_index else "fqn"))
        return model, optim

    def validate(self, optim: dict) -> None:
        """Raise unless `optim` (loaded) fits every optimizer; changes nothing."""
        for m, opt in self.pairs:
            opt.validate_sharded_state_dict(optim, m)

    def load(self, model: dict, optim: dict) -> None:
        """Finish a load into `state()`'s live pieces (collective)."""
        for (m, opt), keys in zip(self.pairs, self.params):
            opt.load_sharded_model_state_dict({k: model[k] for k in keys})
            opt.load_sharded_state_dict(optim, m)

    def describe(self) -> dict:
        """This rank's parts: their param groups (`manifest.describe_groups`) and model shapes."""
        model = {k: tuple(v.shape) for k, v in self.state()[0].items()}
        groups = [g for (_, opt), names in zip(self.pairs, self.names) for g in describe_groups(opt, names)]
        return {"groups": groups, "model": model}

    def agree(self, comm: Comm) -> dict:
        """The whole world's description (collective, two exchanges of small objects): each set
        of ranks holding the same model part must be the ranks its optimizer spans, and distinct
        parts hold distinct names; the description is one rank's of each part, in rank order."""
        mine = self.describe()
        digest = hashlib.sha256(repr(sorted(mine["model"])).encode()).hexdigest()
        everyone = all_gather_object((digest, self.span), comm)
        holders: dict[str, list[int]] = {}
        for r, (d, _) in enumerate(everyone):
            holders.setdefault(d, []).append(r)
        for ranks in holders.values():
            span = everyone[ranks[0]][1]
            if len(ranks) != span:
                raise ValueError(
                    f"the optimizer of ranks {ranks[:8]} spans {span} of the {comm.world_size} ranks, "
                    f"while {len(ranks)} ranks hold its model part; checkpoints are of the whole world: "
                    "build it over every rank, or over its pipeline stage's data-parallel (x tensor-"
                    "parallel) ranks with the other stages' ranks holding the rest of the model"
                )
        first = {ranks[0] for ranks in holders.values()}
        parts = all_gather_object(mine if comm.rank in first else None, comm)
        world: dict = {"groups": [], "model": {}}
        for r, part in enumerate(parts):
            if part is None:
                continue
            held = {n for g in world["groups"] for n in g["names"]}
            shared = sorted({n for g in part["groups"] for n in g["names"]} & held)
            shared += sorted(k for k, v in part["model"].items() if world["model"].get(k, v) != v)
            if shared:
                raise ValueError(
                    f"rank {r}'s model part shares {shared[:5]} with another stage's: a checkpoint keys "
                    "parameters by name, so each must live in one stage (a buffer in several: the same shape)"
                )
            world["groups"] += part["groups"]
            world["model"].update(part["model"])
        return world


__all__ = ["Parts"]
