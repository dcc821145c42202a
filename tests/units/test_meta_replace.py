"""Meta-device initialisation that *replaces* tensors instead of writing into them, as
torchtitan's `init_weights` does with `freqs_cis` (`self.freqs_cis = precompute(...)`) and many
rotary modules with `inv_freq`: the module's buffer after initialisation is the one kept (moved
to the units' device), and a replaced parameter's values are copied into its unit (the
optimizer keeps the parameter it holds); one of another shape is refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vescale_optim as vo


class ReplacingRotary(nn.Module):
    """Computes its buffer afresh in `reset_parameters()` and assigns it."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.register_buffer("freqs", torch.empty(dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.freqs = 1.0 / 10000 ** (torch.arange(0, self.dim, 2, device="cpu").float() / self.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.cos(self.freqs).repeat(2)


class Fresh(nn.Linear):
    """Replaces its weight by a new Parameter in `reset_parameters()`."""

    def reset_parameters(self) -> None:
        self.weight = nn.Parameter(torch.randn(self.out_features, self.in_features) * 0.1)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class ReplacingNet(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.rope = ReplacingRotary(dim)
        self.fc = Fresh(dim, dim)
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(self.rope(x)))


def _optimizer(model: ReplacingNet, **kw) -> vo.AdamW:
    return vo.AdamW(model.parameters(), lr=0.1, shard_modules=[model.fc, model], **kw)


def test_replaced_buffers_and_parameters_are_adopted():
    torch.manual_seed(0)
    want = ReplacingNet()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = ReplacingNet()
    held = list(model.parameters())
    opt = _optimizer(model, device="cpu")
    assert [id(p) for p in model.parameters()] == [id(p) for p in held]  # the optimizer's parameters
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert left == []
    assert torch.equal(model.rope.freqs, want.rope.freqs)
    assert model.state_dict().keys() == want.state_dict().keys()
    for k, v in want.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    x = torch.randn(4, 8)
    model(x).square().sum().backward()
    opt.step()  # it trains: the unit holds the replaced values


def test_a_replaced_parameter_of_another_shape_is_named():
    class Wrong(Fresh):
        def __init__(self, *args):
            super().__init__(*args)
            self.grow = 1  # built (8, 8) on meta; initialised, (9, 8)

        def reset_parameters(self) -> None:
            rows = self.out_features + getattr(self, "grow", 0)
            self.weight = nn.Parameter(torch.zeros(rows, self.in_features))
            nn.init.zeros_(self.bias)

    class Bad(ReplacingNet):
        def __init__(self):
            super().__init__()
            self.fc = Wrong(8, 8)

    with torch.device("meta"):
        model = Bad()
    named = r"Bad\.fc\.weight was replaced by reset_parameters\(\).*shape \(9, 8\)"
    with pytest.raises(ValueError, match=named):
        _optimizer(model, device="cpu")
