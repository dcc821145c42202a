"""Expert parallelism (dp2 x ep2 on 4 gloo ranks): a tiny MoE layer whose experts are one
`[E, out, in]` parameter placed `distribute_tensor(w, world["ep"], [Shard(0)])`, each EP rank
holding whole expert matrices; vo.Muon / vo.AdamW on world["dp"]. Each expert matrix is
orthogonalized on its own EP rank (no traffic over EP), the plain projection once in the world,
the same numbers as one process running torch.optim.Muon (+ AdamW) on the unparallelised layer
with the mean gradient. The tp2 x ep2 case (dp2 x tp2) puts the experts on the tp dimension next
to a dense MLP cut by ColwiseParallel / RowwiseParallel (`TPMoE`)."""

import pytest
import torch
from _reference import mean_grad_reference
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import vescale_optim as vo

pytestmark = pytest.mark.slow

E, TOKENS, IN, OUT, STEPS, EP, HID = 4, 3, 6, 8, 3, 2, 6
MUON = dict(lr=0.02, weight_decay=0.1)
ADAMW = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)


def _weights():
    g = torch.Generator().manual_seed(3)
    return torch.randn(E, OUT, IN, generator=g) / IN**0.5, torch.randn(OUT, OUT, generator=g) / OUT**0.5


def _batch(step, dp_rank):
    """Tokens already routed: `TOKENS` per expert, `[E, TOKENS, IN]`, and their targets."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randn(E, TOKENS, IN, generator=g), torch.randn(E, TOKENS, OUT, generator=g)


class MoE(nn.Module):
    """Experts (one `[E, out, in]` stack, or E matrices in the reference) on their tokens, then a
    shared projection; under EP each rank runs its own experts and their outputs are gathered
    over EP, so every EP rank computes the same loss."""

    def __init__(self, ep=None):
        super().__init__()
        experts, proj = _weights()
        self.ep = ep
        if ep is None:
            self.experts = nn.ParameterList(nn.Parameter(w.clone()) for w in experts)
        else:
            self.experts = nn.Parameter(distribute_tensor(experts, ep, [Shard(0)]))
        self.proj = nn.Linear(OUT, OUT)
        with torch.no_grad():
            self.proj.weight.copy_(proj)
            self.proj.bias.uniform_(-0.1, 0.1, generator=torch.Generator().manual_seed(4))

    def forward(self, x):
        if self.ep is None:
            h = torch.bmm(x, torch.stack(list(self.experts)).transpose(1, 2))
        else:
            w = self.experts.to_local()
            at = self.ep.get_local_rank() * w.shape[0]
            h = torch.bmm(x[at : at + w.shape[0]], w.transpose(1, 2))
            h = DTensor.from_local(h, self.ep, [Shard(0)]).redistribute(self.ep, [Replicate()]).to_local()
        return self.proj(h)


def _loss(model, step, dp_rank):
    x, y = _batch(step, dp_rank)
    return torch.nn.functional.mse_loss(model(x), y)


def _steps(model, opt, dp_rank) -> list[int]:
    """STEPS steps on this dp rank's batches; each step's Newton–Schulz matrices on this rank."""
    counts = []
    for t in range(STEPS):
        _loss(model, t, dp_rank).backward()
        opt.step()
        opt.zero_grad()
        counts.append(opt.step_stats["ns_matrices"])
    return counts


def reference(muon):
    model = MoE()
    mats = [*model.experts, model.proj.weight]
    if muon:
        opts = [torch.optim.Muon(mats, **MUON), torch.optim.AdamW([model.proj.bias], **ADAMW)]
    else:
        opts = [torch.optim.AdamW(model.parameters(), **ADAMW)]
    for t in range(STEPS):
        mean_grad_reference(model.parameters(), 2, lambda r, t=t: _loss(model, t, r).backward())
        for opt in opts:
            opt.step()
    state = {"experts": torch.stack(list(model.experts)), "proj": model.proj.weight, "bias": model.proj.bias}
    return {k: v.detach().clone() for k, v in state.items()}


def _train(muon, zero3=False):
    world = init_device_mesh("cpu", (2, EP), mesh_dim_names=("dp", "ep"))
    model = MoE(world["ep"])
    units = dict(shard_modules=[model]) if zero3 else {}
    if muon:
        groups = [
            {"params": [model.experts, model.proj.weight]},
            {"params": [model.proj.bias], "use_muon": False, **ADAMW},
        ]
        opt = vo.Muon(groups, mesh=world["dp"], **units, **MUON)
    else:
        opt = vo.AdamW(model.parameters(), mesh=world["dp"], **units, **ADAMW)
    dp = world["dp"].get_local_rank()
    counts = []
    for t in range(STEPS):
        _loss(model, t, dp).backward()
        opt.step()
        opt.zero_grad()
        counts.append(opt.step_stats.get("ns_matrices", 0))
    assert isinstance(model.experts, DTensor) and tuple(model.experts.placements) == (Shard(0),)
    with opt.gathered():  # ZeRO-3 parameters are shards between uses
        state = {"experts": model.experts.full_tensor(), "proj": model.proj.weight, "bias": model.proj.bias}
        state = {k: v.detach().clone() for k, v in state.items()}
    return state, counts


@pytest.mark.parametrize(
    "muon, zero3", [(True, False), (True, True), (False, False)], ids=["muon", "muon-zero3", "adamw"]
)
def test_expert_stack_under_ep_equals_one_process(world, muon, zero3):
    want = reference(muon)
    results = world(4).run(_train, muon, zero3)
    for t in range(STEPS) if muon else ():
        # each expert matrix once in the world (on its EP rank's dp group), and the plain proj
        # matrix, replicated over EP, once in the world too
        assert sum(counts[t] for _, counts in results) == E + 1
    for got, _ in results:
        for k in want:
            atol = 2e-4 if muon else 1e-6
            torch.testing.assert_close(got[k], want[k], rtol=0 if muon else 1e-5, atol=atol, msg=k)


class TPMoE(nn.Module):
    """The MoE layer next to a dense MLP (a shared expert: `up`, `down`) in a residual. Under TP
    the experts are spread over the tp ranks (`distribute_tensor(w, world["tp"], [Shard(0)])`,
    expert parallelism borrowing the TP dimension, as torchtitan does when EP and TP share ranks:
    one TP mesh dimension is what the optimizer reads), `up` is ColwiseParallel and `down`
    RowwiseParallel, and `moe.proj` stays plain (replicated over TP)."""

    def __init__(self, tp=None):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.moe = MoE(tp)
        self.up, self.down = nn.Linear(OUT, HID, bias=False), nn.Linear(HID, OUT, bias=False)
        with torch.no_grad():
            self.up.weight.copy_(torch.randn(HID, OUT, generator=g) / OUT**0.5)
            self.down.weight.copy_(torch.randn(OUT, HID, generator=g) / HID**0.5)
        if tp is not None:
            parallelize_module(self, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})

    def forward(self, x):
        h = self.moe(x)
        return h + self.down(torch.relu(self.up(h)))


def _tp_reference():
    model = TPMoE()
    mats = [*model.moe.experts, model.moe.proj.weight, model.up.weight, model.down.weight]
    opts = [torch.optim.Muon(mats, **MUON), torch.optim.AdamW([model.moe.proj.bias], **ADAMW)]
    for t in range(STEPS):
        mean_grad_reference(model.parameters(), 2, lambda r, t=t: _loss(model, t, r).backward())
        for opt in opts:
            opt.step()
    state = {
        "experts": torch.stack(list(model.moe.experts)),
        "proj": model.moe.proj.weight,
        "up": model.up.weight,
        "down": model.down.weight,
    }
    return {k: v.detach().clone() for k, v in state.items()}


def _tp_train(one_group, zero3):
    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = TPMoE(world["tp"])
    mats = [model.moe.experts, model.moe.proj.weight, model.up.weight, model.down.weight]
    adamw = {"params": [model.moe.proj.bias], "use_muon": False, **ADAMW}
    groups = [{"params": mats}, adamw] if one_group else [*({"params": [p]} for p in mats), adamw]
    units = dict(shard_modules=[model.moe, model]) if zero3 else {}
    opt = vo.Muon(groups, mesh=world["dp"], **units, **MUON)
    counts = _steps(model, opt, world["dp"].get_local_rank())
    with opt.gathered():
        state = {
            "experts": model.moe.experts,
            "proj": model.moe.proj.weight,
            "up": model.up.weight,
            "down": model.down.weight,
        }
        state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in state.items()}
        state = {k: v.clone() for k, v in state.items()}
    return state, counts


@pytest.mark.parametrize(
    "one_group, zero3",
    [(False, False), (True, False), (True, True)],
    ids=["groups", "one-segment", "one-segment-zero3"],
)
def test_expert_stacks_next_to_tp_cut_matrices_equal_one_process(world, one_group, zero3):
    """tp2 x ep2 (experts on the tp ranks) next to Colwise/Rowwise matrices and a plain one, in
    groups of their own or in one segment: each matrix once in the world (E experts, the plain
    `proj`, the two full TP matrices), the experts owned on their own tp rank."""
    want = _tp_reference()
    results = world(4).run(_tp_train, one_group, zero3)
    for t in range(STEPS):
        assert sum(counts[t] for _, counts in results) == E + 3
    for got, _ in results:
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=2e-4, msg=k)


def _resumed():
    """Two steps, against one step, opt.state_dict() into a fresh model and optimizer, one step."""
    world = init_device_mesh("cpu", (2, EP), mesh_dim_names=("dp", "ep"))
    dp = world["dp"].get_local_rank()

    def make():
        model = MoE(world["ep"])
        groups = [
            {"params": [model.experts, model.proj.weight]},
            {"params": [model.proj.bias], "use_muon": False, **ADAMW},
        ]
        return model, vo.Muon(groups, mesh=world["dp"], **MUON)

    def step(model, opt, t):
        _loss(model, t, dp).backward()
        opt.step()
        opt.zero_grad()

    (a, opt_a), (b, opt_b) = make(), make()
    for t in range(2):
        step(a, opt_a, t)
    step(b, opt_b, 0)
    saved = opt_b.state_dict()
    c, opt_c = make()
    with torch.no_grad():
        for p, q in zip(c.parameters(), b.parameters()):
            p.copy_(q)
    opt_c.load_state_dict(saved)
    step(c, opt_c, 1)
    return [
        (p.full_tensor() if isinstance(p, DTensor) else p).detach() for m in (a, c) for p in m.parameters()
    ]


def test_expert_stack_state_dict_resumes_exactly(world):
    for got in world(4).run(_resumed):
        half = len(got) // 2
        for want, have in zip(got[:half], got[half:]):
            torch.testing.assert_close(have, want, rtol=0, atol=0)


def _normuon_reference():
    """One process, the loop written out (`_muon_cases.normuon_reference`) on each expert and on
    `proj`, AdamW on the bias; the stack, `proj`, and the state under the one-process keys."""
    from _muon_cases import normuon_reference

    from vescale_optim.kernels import newton_schulz
    from vescale_optim.optim._muon_math import adjusted_lr

    model = MoE()
    mats = [*model.experts, model.proj.weight]
    adam = torch.optim.AdamW([model.proj.bias], **ADAMW)
    buf, v = [torch.zeros_like(p) for p in mats], [torch.zeros(p.shape[0]) for p in mats]
    for t in range(STEPS):
        mean_grad_reference(model.parameters(), 2, lambda r, t=t: _loss(model, t, r).backward())
        with torch.no_grad():
            for k, p in enumerate(mats):
                buf[k].lerp_(p.grad, 0.05)
                o, v[k] = normuon_reference(newton_schulz(p.grad.lerp(buf[k], 0.95), 5), v[k], 0.95)
                p.mul_(1 - MUON["lr"] * MUON["weight_decay"]).add_(
                    o.bfloat16(), alpha=-adjusted_lr(MUON["lr"], None, *p.shape)
                )
        adam.step()
    state = {"experts": torch.stack(list(model.experts)), "proj": model.proj.weight}
    experts = {"momentum_buffer": torch.stack(buf[:E]), **{f"variance_neuron_{e}": v[e] for e in range(E)}}
    saved = {"experts": experts, "proj": {"momentum_buffer": buf[E], "variance_neuron": v[E]}}
    return {k: x.detach().clone() for k, x in state.items()}, saved


def _normuon_train():
    world = init_device_mesh("cpu", (2, EP), mesh_dim_names=("dp", "ep"))
    model = MoE(world["ep"])
    groups = [
        {"params": [model.experts, model.proj.weight]},
        {"params": [model.proj.bias], "use_muon": False, **ADAMW},
    ]
    opt = vo.Muon(groups, mesh=world["dp"], normuon=True, **MUON)
    counts = _steps(model, opt, world["dp"].get_local_rank())
    saved = opt.state_dict()["state"]
    state = {
        "experts": model.experts.full_tensor().detach().clone(),
        "proj": model.proj.weight.detach().clone(),
    }
    return state, counts, {"experts": saved[0], "proj": saved[1]}


def test_normuon_expert_stack_next_to_a_plain_matrix_each_once(world):
    """dp2 x ep2 with NorMuon: each expert on its EP rank, the plain `proj` once in the world
    (E + 1 matrices a step over all ranks), equal to one process; opt.state_dict() holds the
    whole stack's `variance_neuron_{e}` for every expert e, gathered from their owners."""
    want, want_state = _normuon_reference()
    results = world(4).run(_normuon_train)
    for got, _, state in results:
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=2e-4, msg=k)
        for name, entry in want_state.items():
            assert set(state[name]) - {"step"} == set(entry), name
            for key, x in entry.items():
                torch.testing.assert_close(state[name][key], x, rtol=1e-3, atol=1e-6, msg=f"{name} {key}")
    for t in range(STEPS):
        assert sum(counts[t] for _, counts, _ in results) == E + 1
