"""Pipeline-parallel scaffolding for tests: a torchtitan-style model, its stages, the schedule,
each dp rank's micro-batched batches and the one-process reference.

- `Model`: an embedding, an `nn.ModuleDict` of `Layer`s, a norm and a head. A stage is the model
  with the modules other stages own deleted (`stage_of`), torchtitan's way, so its parameter
  names stay the whole model's; `forward` skips what is deleted.
- `Layout(pp, dp, microbatches)`: the world as a `(pp, dp)` mesh, a rank's stage and dp rank.
  `build(kind, layout, zero)` makes this rank's `Rank`: its stage, its optimizer over the stage
  with `mesh=world["dp"]` (ZeRO-3: `shard_modules=[*layers, stage]`; ZeRO-2: none) and its
  schedule (torch's `PipelineStage` + `ScheduleGPipe`; with `pp == 1` no pipelining at all: the
  plain model runs each micro-batch's forward and backward). `Rank.train(steps)` steps it.
- `batch(step, dp_rank, dp)`: each step's global batch of `BATCH` sequences, dp rank `d`'s share;
  a schedule splits it into micro-batches.
- `Reference`: one process, the whole model and torch's optimizers (`torch.optim.AdamW`; for
  Muon, `torch.optim.Muon` on the matrices `vo.muon_param_groups` picks and AdamW on the rest).
  Each step's gradient is the mean over the dp ranks of the mean-over-micro-batches loss
  gradient (`_reference.mean_grad_reference`: each rank's, summed in rank order, divided).
- `full_state(rank)`: a rank's parameters and optimizer state keyed by name, whole, for
  comparing a run with itself across layouts (collective over the rank's stage).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from _reference import mean_grad_reference
from _shampoo_reference import ReferenceShampoo
from torch import nn

import vescale_optim as vo

DIM, LAYERS, VOCAB, SEQ, BATCH = 8, 4, 13, 4, 8
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MUON = dict(lr=0.02, weight_decay=0.1)
AUX = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)  # Muon's AdamW group
SHAMPOO = dict(lr=1e-2, max_preconditioner_dim=8, precondition_frequency=2, root_dtype=torch.float64)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(DIM, 2 * DIM)
        self.b = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Layer() for i in range(LAYERS)})
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers.values():
            h = layer(h)
        return self.head(self.norm(h)) if self.head is not None else h


def model(seed: int = 0) -> Model:
    torch.manual_seed(seed)
    return Model()


def stage_of(whole: Model, pp: int, stage: int) -> Model:
    """`whole` (changed in place) as stage `stage` of `pp`: the modules others own deleted."""
    per = LAYERS // pp
    for name in list(whole.layers.keys()):
        if not stage * per <= int(name) < (stage + 1) * per:
            del whole.layers[name]
    if stage != 0:
        whole.embed = None
    if stage != pp - 1:
        whole.norm = whole.head = None
    return whole


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def batch(step: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    return tokens[rows, :-1], tokens[rows, 1:]


def muon_groups(part: nn.Module) -> list[dict]:
    exclude = ["head"] if getattr(part, "head", None) is not None else []
    aux = dict(adamw_lr=AUX["lr"], adamw_betas=AUX["betas"], adamw_weight_decay=AUX["weight_decay"])
    with warnings.catch_warnings():  # a stage's last layer is its last Linear, not an output layer
        warnings.filterwarnings("ignore", message=r".*the model's last Linear\) looks like an output layer")
        return vo.muon_param_groups(part, exclude=exclude, **aux)


def optimizer(kind: str, part: nn.Module, mesh, zero: int, **sharding) -> vo.ShardedOptimizer:
    sharding.update(mesh=mesh, shard_modules=[*part.layers.values(), part] if zero == 3 else None)
    if kind == "adamw":
        return vo.AdamW(part.parameters(), **ADAMW, **sharding)
    if kind == "shampoo":
        return vo.Shampoo(part.parameters(), **SHAMPOO, **sharding)
    return vo.Muon(muon_groups(part), **MUON, **sharding)


@dataclass(frozen=True)
class Layout:
    pp: int
    dp: int
    microbatches: int

    def __str__(self) -> str:
        return f"pp{self.pp}xdp{self.dp}"


@dataclass
class Rank:
    """One rank's stage of a pipeline run: its model part, optimizer and schedule."""

    layout: Layout
    pp_rank: int
    dp_rank: int
    part: Model
    opt: vo.ShardedOptimizer
    schedule: object | None
    world: object = None  # the (pp, dp) DeviceMesh

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.schedule is None:  # no pipelining: the plain model, micro-batch by micro-batch
            m = self.layout.microbatches
            for xm, ym in zip(x.chunk(m), y.chunk(m)):
                (loss_fn(self.part(xm), ym) / m).backward()
        elif self.pp_rank == 0:
            self.schedule.step(x)
        elif self.pp_rank == self.layout.pp - 1:
            self.schedule.step(target=y)
        else:
            self.schedule.step()

    def train(self, steps) -> None:
        for step in steps:
            self.forward_backward(*batch(step, self.dp_rank, self.layout.dp))
            self.opt.step()
            self.opt.zero_grad()


def build(kind: str, layout: Layout, zero: int, seed: int = 0, schedule: str = "gpipe", **sharding) -> Rank:
    """This rank's part of a `layout` run (collective: the mesh, the optimizer, built with
    `sharding`); `schedule`: torch's `ScheduleGPipe` or `Schedule1F1B`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    world = init_device_mesh("cpu", (layout.pp, layout.dp), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = world["pp"].get_local_rank(), world["dp"].get_local_rank()
    part = stage_of(model(seed), layout.pp, pp_rank)
    opt = optimizer(kind, part, world["dp"], zero, **sharding)
    runner = None
    if layout.pp > 1:
        stage = PipelineStage(part, pp_rank, layout.pp, torch.device("cpu"), group=world["pp"].get_group())
        kind_of = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        runner = kind_of(stage, layout.microbatches, loss_fn=loss_fn)
    return Rank(layout, pp_rank, dp_rank, part, opt, runner, world)


def full_state(rank: Rank) -> dict:
    """The stage's whole parameters and buffers (`model`) and optimizer state with its group's
    hyperparameters (`optim`), by name (collective over the stage's dp ranks)."""
    params = {k: v.clone() for k, v in rank.opt.full_model_state_dict(rank.part).items()}
    names = {id(p): n for n, p in rank.part.named_parameters()}
    sd = rank.opt.state_dict()
    order = [names[id(p)] for g in rank.opt.param_groups for p in g["params"]]
    optim = {}
    for saved in sd["param_groups"]:
        hyper = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
        for i in saved["params"]:
            optim[order[i]] = {**hyper, **sd["state"].get(i, {})}
    return {"model": params, "optim": optim}


class Reference:
    """One process, the whole model, torch's optimizers (see the module's docstring)."""

    def __init__(self, kind: str, seed: int = 0):
        self.model = model(seed)
        if kind == "adamw":
            self.opts = [torch.optim.AdamW(self.model.parameters(), **ADAMW)]
        elif kind == "shampoo":
            self.opts = [ReferenceShampoo(list(self.model.parameters()), **SHAMPOO)]
        else:
            mats, rest = muon_groups(self.model)
            self.opts = [torch.optim.Muon(mats["params"], **MUON), torch.optim.AdamW(rest["params"], **AUX)]

    def train(self, steps, layout: Layout) -> None:
        for step in steps:
            self.backward_mean(step, layout)
            for opt in self.opts:
                opt.step()

    def backward_mean(self, step: int, layout: Layout) -> None:
        """`.grad`: `step`'s gradient, the mean over the dp ranks of each rank's."""
        mean_grad_reference(self.model.parameters(), layout.dp, lambda r: self._backward(step, r, layout))

    def _backward(self, step: int, dp_rank: int, layout: Layout) -> None:
        """Dp rank `dp_rank`'s gradient of `step`, as that rank makes it."""
        m = layout.microbatches
        x, y = batch(step, dp_rank, layout.dp)
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            (loss_fn(self.model(xm), ym) / m).backward()

    def params(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.named_parameters()}


def merged(states: list[dict]) -> dict:
    """Every stage's `full_state` as one: each stage's dp rank 0's, names disjoint."""
    out: dict = {"model": {}, "optim": {}}
    for state in states:
        for key in out:
            assert not set(out[key]) & set(state[key]) or all(
                _equal(out[key][k], state[key][k]) for k in set(out[key]) & set(state[key])
            ), "two stages hold different values under one name"
            out[key].update(state[key])
    return out


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def assert_same(got: dict, want: dict) -> None:
    """Bitwise equal, by name (`merged` or `full_state` dicts)."""
    for key in ("model", "optim"):
        assert got[key].keys() == want[key].keys(), (key, sorted(got[key].keys() ^ want[key].keys()))
        for name in want[key]:
            assert _equal(got[key][name], want[key][name]), (key, name)


__all__ = ["Layout", "Rank", "Reference", "assert_same", "batch", "build", "full_state", "merged", "model"]
