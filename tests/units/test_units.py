"""Units and their schedule on their own: plain SGD on the shards equals one process."""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from _reference import mean_of
from _tiny_gpt import batch, build, loss_fn, world_grads
from hypothesis import given, settings
from hypothesis import strategies as st

import vescale_optim as vo
from vescale_optim.shard import plan_layout
from vescale_optim.shard.collectives import Comm
from vescale_optim.units import ShardingConfig, State, Unit
from vescale_optim.units.assign import assign_units
from vescale_optim.units.reduced_grad import ReducedGrad
from vescale_optim.units.schedule import Schedule
from vescale_optim.units.unit import UnitComms

LR = 0.1
# test_adamw.TOL. Measured over 80 interleavings at W=2: the first step's gradients equal the
# reference's bits (it reduces as the library does); the second step's differ by 4.8e-7 at most
# (the parameters after one step differ by AdamW's rounding, 3e-8), the parameters by 3e-8
ADAMW_TOL = dict(rtol=1e-5, atol=1e-6)


def make_units(model, shard_modules, comm, sharded=True, param_dtype=None):
    params = list(model.parameters())
    if shard_modules is None:
        groups, modules = [list(range(len(params)))], [None]
        names = {i: str(i) for i in range(len(params))}
    else:
        unit_of, listed, names = assign_units(params, shard_modules)
        order = sorted(set(unit_of), key=unit_of.index)
        groups = [[i for i, u in enumerate(unit_of) if u == k] for k in order]
        modules = [listed[k] for k in order]
    config = ShardingConfig(shard_modules=shard_modules if sharded else None, param_dtype=param_dtype)
    units = []
    for idx in groups:
        ps = [params[i] for i in idx]
        layout = plan_layout([p.numel() for p in ps], [1] * len(ps), comm.world_size, 4)
        units.append(
            Unit(
                ps,
                [names[i] for i in idx],
                layout,
                UnitComms(comm),
                config,
                index=len(units),
                name=str(len(units)),
            )
        )
    return units, modules


def reference(world, steps, micro=1, **kwargs):
    model = build(**kwargs)
    for t in range(steps):
        world_grads(model, t, world, micro)
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(LR * p.grad)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _train(steps, mode, micro=1, no_sync=False, reshard=True, checkpoint=False, param_dtype=None):
    comm = Comm()
    model = build(checkpoint=checkpoint)
    shard_modules = None if mode == "zero2" else [*model.layers, model]
    units, modules = make_units(model, shard_modules, comm, sharded=mode == "zero3", param_dtype=param_dtype)
    assert all(
        u.shard.dtype == torch.float32 and u.full.data.dtype == (param_dtype or torch.float32) for u in units
    )
    sched = Schedule(units, modules, reshard_after_forward=reshard)
    peak = []

    def probe(module, args):
        peak.append(sum(u.state is not State.RESHARDED for u in units if u.sharded))

    for layer in model.layers:
        layer.register_forward_pre_hook(probe)
    for t in range(steps):
        for m in range(micro):
            if no_sync and m < micro - 1:
                with sched.no_sync():
                    (loss_fn(model, *batch(t, comm.rank, m)) / micro).backward()
            else:
                (loss_fn(model, *batch(t, comm.rank, m)) / micro).backward()
        sched.finish()
        for u in units:
            u.shard.sub_(LR * u.grads.shard)
            u.grads.clear()
            u.gather_after_step()
        between = [u.transient_bytes() for u in units]
        assert all(b == 0 for b in between) if mode == "zero3" else True, between
    for u in units:
        u.unshard(async_op=False)
    out = {k: v.float().clone() for k, v in model.state_dict().items()}
    return out, max(peak)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("mode", ["zero3", "zero2"])
def test_sgd_on_shards_equals_one_process(world, world_size, mode):
    results = world(world_size).run(_train, 3, mode)
    want = reference(world_size, 3)
    for got, peak in results:
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
        if mode == "zero3":
            assert peak <= 3  # the root, the running layer and the prefetched one


@pytest.mark.parametrize(
    "case", [dict(reshard=False), dict(micro=2), dict(micro=3, no_sync=True), dict(checkpoint=True)]
)
def test_variants(world, case):
    results = world(3).run(_train, 2, "zero3", **case)
    want = reference(3, 2, micro=case.get("micro", 1), checkpoint=case.get("checkpoint", False))
    for got, _ in results:
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_bf16_compute_over_fp32_shards_tracks_fp32(world):
    """bf16 gathers and compute over fp32 shards: within bf16 rounding of the fp32 run
    (2 SGD steps at lr 0.1 move parameters by ~0.1; bf16 has 8 bits of mantissa)."""
    results = world(2).run(_train, 2, "zero3", param_dtype=torch.bfloat16)
    want = reference(2, 2)
    for got, _ in results:
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=2e-2, msg=k)
        assert any((got[k] - want[k]).abs().max() > 0 for k in want)  # it really ran in bf16


def _state_round_trip_with_schedule():
    from vescale_optim.units.model_state import ModelState

    comm = Comm()
    model = build()
    units, modules = make_units(model, [*model.layers, model], comm)
    Schedule(units, modules)
    ModelState(units, modules)
    fresh = build(seed=1)
    model.load_state_dict(fresh.state_dict())
    loss = loss_fn(model, *batch(0, comm.rank))
    want = loss_fn(fresh, *batch(0, comm.rank))
    sd = model.state_dict()
    return torch.allclose(loss, want), all(torch.equal(sd[k], v) for k, v in fresh.state_dict().items())


@pytest.mark.parametrize("world_size", [1, 3])
def test_model_state_dict_is_full_and_loads_into_shards(world, world_size):
    for ok in world(world_size).run(_state_round_trip_with_schedule):
        assert ok == (True, True)


def _meta(mode):
    from _tiny_gpt import TinyGPT

    from vescale_optim.units.materialize import materialize
    from vescale_optim.units.model_state import ModelState

    comm = Comm()
    torch.manual_seed(123 + comm.rank)  # ranks differ: rank 0's state must win
    with torch.device("meta"):
        model = TinyGPT()
    torch.manual_seed(0) if comm.rank == 0 else None
    units, modules = make_units(model, [*model.layers, model], comm, sharded=mode == "zero3")
    ModelState(units, modules)
    materialize(units, [model])
    peak = max(u.transient_bytes() for u in units)
    return {k: v.clone() for k, v in model.state_dict().items()}, peak


@pytest.mark.parametrize("world_size", [1, 2])
def test_meta_model_equals_model_built_normally(world, world_size):
    from _tiny_gpt import TinyGPT

    torch.manual_seed(0)
    want = TinyGPT().state_dict()
    for got, peak in world(world_size).run(_meta, "zero3"):
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k
        assert peak == 0


def test_blocks_under_a_root_without_parameters_are_freed_after_forward():
    """`shard_modules=[*blocks, model]` where the model holds only the blocks (no unit of its
    own): the blocks are not outermost, so each is freed after its forward (as FSDP2 does) and
    gathered again in backward; training still equals torch.optim.AdamW."""

    def build():
        torch.manual_seed(0)
        blocks = [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()) for _ in range(3)]
        return torch.nn.Sequential(*blocks)

    model, ref = build(), build()
    opt = vo.AdamW(model.parameters(), lr=0.01, shard_modules=[*model, model])
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    assert len(opt.units) == 3
    for t in range(2):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(t))
        out = model(x).square().mean()
        assert [u.full.data.untyped_storage().nbytes() for u in opt.units] == [0, 0, 0]
        out.backward()
        opt.step()
        opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=k)


# --- several forwards before their backwards: any interleaving torch accepts ------------------


class _ReusedBlockNet(torch.nn.Module):
    """A root with parameters of its own around two blocks (the second called twice when
    `shared`): the root is watched (its input needs no gradient), the blocks have triggers."""

    def __init__(self, shared):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(6, 8)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(2)
        )
        self.head = torch.nn.Linear(8, 1)
        self.shared = shared

    def forward(self, x):
        h = self.blocks[1](self.blocks[0](self.inp(x)))
        return self.head(self.blocks[1](h) if self.shared else h)


def _data(step, rank, j):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + j)
    return torch.randn(3, 6, generator=g), torch.randn(3, 1, generator=g)


def _replay(model, events, step, rank, after_backward):
    """Rank `rank`'s forwards and backwards of `step` in the order of `events`, calling
    `after_backward(model)` after each backward."""
    losses = {}
    for event in events:
        if event[0] == "forward":
            x, y = _data(step, rank, event[1])
            losses[event[1]] = (model(x) - y).square().mean()
        else:
            losses[event[1]].backward(retain_graph=event[2])
            after_backward(model)


@st.composite
def interleavings(draw):
    """k forwards (1..3), each before its backward, the backwards in any order among the
    forwards, each retaining its graph or not, and maybe a retained graph backwarded again."""
    k, events, forwarded, pending, retained = draw(st.integers(1, 3)), [], 0, [], []
    while forwarded < k or pending:
        if forwarded < k and (not pending or draw(st.booleans())):
            events.append(("forward", forwarded))
            pending.append(forwarded)
            forwarded += 1
            continue
        j = pending.pop(draw(st.integers(0, len(pending) - 1)))
        events.append(("backward", j, draw(st.booleans())))
        if events[-1][2]:
            retained.append(j)
    if retained and draw(st.booleans()):
        events.append(("backward", draw(st.sampled_from(retained)), False))
    return events, draw(st.sampled_from(["zero3", "zero3-kept", "zero2"])), draw(st.booleans())


def _interleaved(events, mode, shared, steps):
    """Each step's `.grad` right after its backwards (gathered whole), and the parameters
    after `steps` AdamW steps."""
    model = _ReusedBlockNet(shared)
    sharding = (
        {}
        if mode == "zero2"
        else dict(shard_modules=[*model.blocks, model], reshard_after_forward=mode == "zero3")
    )
    opt = vo.AdamW(model.parameters(), lr=0.01, **sharding)
    blocks = [u for u in opt.units if u.name.startswith("blocks.")]

    def freed(model):  # each backward frees the blocks (the next gathers them again)
        assert mode != "zero3" or all(u.state is State.RESHARDED for u in blocks), blocks

    grads = []
    for t in range(steps):
        _replay(model, events, t, dist.get_rank(), freed)
        unreduced = [n for n, p in model.named_parameters() if not isinstance(p.grad, ReducedGrad)]
        assert not unreduced, f"after the backwards {unreduced} hold no reduced gradient"
        grads.append([p.grad.full_tensor().clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return grads, [v.clone() for v in model.state_dict().values()]


def _take(into, model):
    """One backward's gradients alone (cleared for the next)."""
    into.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)


def _interleaved_reference(events, shared, steps, world):
    """torch's: each backward's gradients averaged over the ranks as a reduction does (summed
    in rank order, then divided: `mean_of`), added up over the backwards in their order;
    torch.optim.AdamW stepping on them."""
    model = _ReusedBlockNet(shared)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    grads = []
    for t in range(steps):
        per_rank = [[] for _ in range(world)]  # [rank][backward][parameter]: each backward's own
        for r in range(world):
            _replay(copy.deepcopy(model), events, t, r, functools.partial(_take, per_rank[r]))
        total = [None] * len(per_rank[0][0])
        for b in range(len(per_rank[0])):
            for i in range(len(total)):
                mean = mean_of([per_rank[r][b][i] for r in range(world)], world)
                total[i] = mean if total[i] is None else total[i].add_(mean)
        for p, g in zip(model.parameters(), total):
            p.grad = g
        grads.append([g.clone() for g in total])
        opt.step()
        opt.zero_grad()
    return grads, [v.clone() for v in model.state_dict().values()]


@settings(max_examples=12)
@given(interleavings())
def test_any_interleaving_of_forwards_and_backwards_gives_torchs_gradients(world, case):
    """`.grad` after the backwards (before the step) is torch's gradient summed over the
    backwards and averaged over the ranks, whatever the order of forwards and backwards and
    `retain_graph`: each backward gathers the units again and adds its reduced gradients.
    AdamW then steps as torch.optim.AdamW on that gradient."""
    events, mode, shared = case
    want_grads, want_params = _interleaved_reference(events, shared, 2, 2)
    for grads, params in world(2).run(_interleaved, events, mode, shared, 2, timeout=60):
        for got, want in zip(grads, want_grads):
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, **ADAMW_TOL)
        for a, b in zip(params, want_params):
            torch.testing.assert_close(a, b, **ADAMW_TOL)
