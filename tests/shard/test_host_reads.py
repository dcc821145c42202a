"""`host_reads()` sees every read of a tensor value on the host, in backward's hooks too (where
a `TorchFunctionMode` would not), a read through a tensor subclass once, and leaves
`torch.Tensor` as it found it."""

import torch

from vescale_optim.shard.host_reads import READS, host_reads


class _Logged(torch.Tensor):
    """A subclass whose reads dispatch through `__torch_function__` (as the stand-ins' do)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def test_every_read_is_counted_once_and_where():
    w = torch.ones(3, requires_grad=True)
    w.register_hook(lambda g: g * g.sum().item())  # a read inside backward
    sub = torch.ones(2).as_subclass(_Logged)
    with host_reads() as reads:
        (w * 2).sum().backward()
        t = torch.arange(4.0)
        t.tolist(), bool(t[1]), int(t[2]), float(t[3]), [0, 1][torch.tensor(1)], t.nonzero()
        sub.sum().item()
        t + 1  # not a read
    kinds = [r.split(" at ")[0] for r in reads]
    assert kinds == ["item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "item"]
    assert all(r.endswith(f"test_host_reads.py:{r.rsplit(':', 1)[1]}") for r in reads), reads


def test_torch_tensor_is_restored():
    before = {name: torch.Tensor.__dict__.get(name) for name in READS}
    with host_reads():
        assert all(name in torch.Tensor.__dict__ for name in READS)
    assert {name: torch.Tensor.__dict__.get(name) for name in READS} == before
    with host_reads() as reads:
        pass
    torch.ones(1).item()
    assert reads == []
