"""Ranks start from rank 0's parameters (as with DDP), every optimizer runs on a subgroup of
the world, where group ranks and global ranks differ, and a second group over a group's ranks
is made by those ranks alone."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from _adamw_cases import SKIP, STEPS, groups, make_params, set_grads
from _adamw_cases import reference as adamw_reference
from _muon_cases import STEPS as MUON_STEPS
from _muon_cases import grad as muon_grad
from _muon_cases import make_params as muon_params
from _muon_cases import reference as muon_reference

import vescale_optim as vo
from vescale_optim.shard import handle

OPTIMIZERS = {
    "adamw": lambda ps, **kw: vo.AdamW(ps, **kw),
    "muon": lambda ps, **kw: vo.Muon([{"params": ps[:3]}, {"params": ps[3:], "use_muon": False}], **kw),
    "shampoo": lambda ps, **kw: vo.Shampoo(ps, max_preconditioner_dim=4, **kw),
}


def _model():
    """Seeded by the caller; the last layer is frozen at construction."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 5), torch.nn.Linear(5, 3))
    model[2].requires_grad_(False)
    return model


def _init(kind, sync):
    torch.manual_seed(dist.get_rank())  # every rank its own initial weights, as under torchrun
    model = _model()
    weights, biases = [m.weight for m in model], [m.bias for m in model]
    OPTIMIZERS[kind](weights + biases, sync_params=sync)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_every_rank_starts_from_rank_0s_parameters(world, kind):
    synced = world(3).run(_init, kind, True)
    torch.manual_seed(0)
    want = [p.detach() for p in _model().parameters()]
    for res in synced:
        assert all(torch.equal(a, b) for a, b in zip(res, want))  # frozen parameters too
    unsynced = world(3).run(_init, kind, False)
    assert not torch.equal(unsynced[1][0], want[0])


def _bf16_master_after_sync():
    torch.manual_seed(dist.get_rank())
    model = _model().bfloat16()
    opt = vo.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    opt.step()  # p <- master * (1 - lr*wd): the masters must hold rank 0's values
    return [p.detach().clone() for p in model.parameters()]


def test_masters_are_taken_after_the_broadcast(world):
    torch.manual_seed(0)
    model = _model().bfloat16()
    opt = vo.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    opt.step()
    for res in world(3).run(_bf16_master_after_sync):
        assert all(torch.equal(a, b.detach()) for a, b in zip(res, model.parameters()))


# --- a subgroup: ranks 1, 2, 3 of a world of 4 ---------------------------------------------


def _on_subgroup(kind):
    rank = dist.get_rank()
    sub = dist.new_group([1, 2, 3])
    if rank == 0:
        return None
    me = dist.get_rank(sub)
    if kind == "adamw":
        params = make_params()
        with torch.no_grad():
            for p in params:
                p.add_(rank - 1)  # different on ranks 2 and 3: group rank 0 (global rank 1) wins
        opt = vo.AdamW(groups(params), process_group=sub)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.8**t)
        for t in range(STEPS):
            set_grads(params, t, me, skip=SKIP.get(t, ()))
            opt.step()
            sched.step()
        return [p.detach().clone() for p in params]
    muon, adam = muon_params()
    opt = vo.Muon(
        [{"params": muon}, {"params": adam, "use_muon": False, "lr": 0.01, "weight_decay": 0.05}],
        lr=0.02,
        weight_decay=0.1,
        bucket_cap_numel=64,
        process_group=sub,
    )
    for t in range(MUON_STEPS):
        for i, p in enumerate(muon + adam):
            p.grad = muon_grad(p.shape, t, me, i)
        opt.step()
    return [p.detach().clone() for p in muon + adam]


def test_adamw_on_a_subgroup_equals_torch(world):
    results = world(4).run(_on_subgroup, "adamw", timeout=60)
    ref, _, _ = adamw_reference(3)
    for res in results[1:]:
        for got, want in zip(res, ref):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def test_muon_on_a_subgroup_equals_torch(world):
    results = world(4).run(_on_subgroup, "muon", timeout=60)
    want, _ = muon_reference(3, None, True)
    for res in results[1:]:
        for got, ref in zip(res, want):
            torch.testing.assert_close(got, ref, rtol=0, atol=2e-4)


# --- groups made from a subgroup by all of its ranks (shard.groups) ----------------------------


def _split_of_subgroup():
    from vescale_optim.shard.groups import split_groups

    sub = dist.new_group([1, 2, 3])
    if dist.get_rank() == 0:
        return None
    me = dist.get_rank(sub)
    wanted = [(0, 1), (1, 2), (0, 2), (0, 1, 2), (1,)]  # overlapping: three layers and more
    mine = split_groups(sub, wanted)
    sums = {}
    for members, group in mine.items():  # each group works and holds its members, in order
        t = torch.tensor([float(10 ** dist.get_rank())])
        dist.all_reduce(t, group=group)
        sums[members] = (t.item(), dist.get_rank(group), dist.get_world_size(group))
    errors = []
    for bad in ([(1, 0)], [()], [(0, 3)], [(0, 0)]):
        try:
            split_groups(sub, bad)
        except ValueError as e:
            errors.append(str(e))
    return me, sums, errors


def test_split_groups_of_a_subgroup_hold_their_members(world):
    """`split_groups` over ranks 1, 2, 3 of a world of 4 (rank 0 outside, making no call): each
    rank gets exactly the wanted groups it is in, of overlapping ones too, each a working group
    whose ranks keep the parent's order; malformed groups raise ValueError on every rank."""
    results = world(4).run(_split_of_subgroup, timeout=60)
    assert results[0] is None
    wanted = [(0, 1), (1, 2), (0, 2), (0, 1, 2), (1,)]
    for me, sums, errors in results[1:]:
        assert sorted(sums) == sorted(g for g in wanted if me in g)
        for members, (total, rank, size) in sums.items():
            assert total == sum(10.0 ** (r + 1) for r in members)  # global rank = sub rank + 1
            assert (rank, size) == (members.index(me), len(members))
        assert len(errors) == 4 and all("distinct, ascending" in e for e in errors)


# --- a second group over a group's ranks (`handle.duplicate_group`) --------------------------------


def _duplicates():
    """A copy of the world: its ranks and a sum over it; and what a copy of this rank's half is
    on a world not bound to a device."""
    rank = dist.get_rank()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both (torch's rule)
    copy = handle.duplicate_group()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=copy)
    ranks = [dist.get_global_rank(copy, r) for r in range(dist.get_world_size(copy))]
    return ranks, total.item(), copy is not dist.group.WORLD, handle.duplicate_group(halves[rank // 2])


def test_a_duplicate_group_holds_the_same_ranks(world):
    for ranks, total, new, half in world(4).run(_duplicates, timeout=60):
        assert (ranks, total, new) == ([0, 1, 2, 3], 6.0, True)
        assert half is None  # unbound: no copy of a smaller group (its members alone could hang)


class _Dist:
    """torch.distributed as `duplicate_group` calls it, recording group creation: a world of 8
    whose default group is bound to a device or not; `parent` holds world ranks 5, 6, 7."""

    def __init__(self, bound, backend="nccl"):
        self.made, self.parent, self.backend = [], object(), backend
        self.group = SimpleNamespace(WORLD=SimpleNamespace(bound_device_id=bound))

    def get_world_size(self, group=None):
        return 3 if group is self.parent else 8

    def get_backend(self, group):
        return self.backend

    def split_group(self, parent_pg, split_ranks, **options):
        which = "parent" if parent_pg is self.parent else "world"
        self.made.append(("split_group", which, split_ranks, options))
        return "split"

    def new_group(self, ranks, **options):
        self.made.append(("new_group", ranks, options))
        return "new"


def test_a_duplicate_is_made_by_every_rank_of_the_group_split_from(monkeypatch):
    """With a bound default group a new NCCL group is split from a parent that every rank of the
    parent joins: the copy is split from the group itself, never from the world by the group's
    members alone (the world's other ranks would be missing from the split: a hang). Unbound,
    only the world is copied, by every rank; a smaller group is not."""
    cuda = torch.device("cuda", 0)
    for bound, backend, whole, want in [
        (cuda, "nccl", False, ("split_group", "parent", [[0, 1, 2]], {})),
        (cuda, "nccl", True, ("split_group", "world", [list(range(8))], {})),
        (None, "nccl", True, ("new_group", None, dict(backend="nccl"))),
        (cuda, "gloo", True, ("new_group", None, dict(backend="gloo"))),
        (None, "nccl", False, None),
        (cuda, "gloo", False, None),
    ]:
        fake = _Dist(bound, backend)
        monkeypatch.setattr(handle, "dist", fake)
        copy = handle.duplicate_group(None if whole else fake.parent)
        assert fake.made == ([want] if want else []) and (copy is None) == (want is None), (bound, backend)
