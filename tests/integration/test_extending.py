"""docs/extending.md's optimizer: `examples/lion.py`'s `Lion`, a Lion built on the sharded base,
matches a one-process Lion on the mean gradient under ZeRO-2 and ZeRO-3 on 1, 2 and 3 ranks
(`lion.check`), takes 16- and 8-bit state by declaring `state_bits`, and the page shows the
file's code as it is."""

from __future__ import annotations

import ast
import re

import lion
import pytest
import torch
from _docs import ROOT
from torch import nn

PAGE = ROOT / "docs" / "extending.md"
EXAMPLE = ROOT / "examples" / "lion.py"


def test_check_in_one_process_without_a_group():
    assert lion.check(1) == {"weights": 492, "exp_avg": 492}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_check_on_gloo_ranks(world, world_size):
    assert (
        world(world_size).run(lion.check, world_size, timeout=120)
        == [{"weights": 492, "exp_avg": 492}] * world_size
    )


class LowBitLion(lion.Lion):
    """The page's one-line change: Lion taking `state_bits`, its update as it is."""

    def __init__(self, params, state_bits: int = 32, **kwargs):
        self.state_bits = state_bits
        super().__init__(params, **kwargs)


def _one_step(state_bits: int) -> tuple[LowBitLion, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 64))  # 6144 weights: a low-bit tier
    opt = LowBitLion(model.parameters(), state_bits=state_bits, lr=1e-2, weight_decay=0.1)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    model(x).square().mean().backward()
    opt.step()
    return opt, model


@pytest.mark.parametrize("state_bits, tier, dtype", [(16, "bf16", torch.bfloat16), (8, "q8", torch.int8)])
def test_lion_keeps_low_bit_state_by_declaring_state_bits(state_bits, tier, dtype):
    """After one step m = (1 - b2) * g and the weights moved by lr * sign((1 - b1) * g) whatever
    the storage: the weights equal fp32's, and the momentum is fp32's as the tier stores it
    (bf16: rounded to nearest; q8: within half a step of its block's absmax / 127)."""
    exact, exact_model = _one_step(32)
    opt, model = _one_step(state_bits)
    assert torch.equal(model[0].weight, exact_model[0].weight)
    big = next(seg for seg in opt.segments if seg.tier == tier)
    assert any(t.dtype == dtype for t in big.state.values())
    i = next(i for i, p in enumerate(model.parameters()) if p.numel() >= 4096)
    m = opt.state_dict()["state"][i]["exp_avg"]
    want = exact.state_dict()["state"][i]["exp_avg"]
    if state_bits == 16:
        assert torch.equal(m, want.bfloat16().float())
    else:
        blocks = want.reshape(-1, 256)
        bound = blocks.abs().amax(1, keepdim=True) / 127 / 2 * (1 + 1e-6)
        assert bool(((m.reshape(-1, 256) - blocks).abs() <= bound).all())
        assert not torch.equal(m, want)  # stored in 8 bits indeed


def _definitions(source: str) -> dict[str, str]:
    """Each top-level class and function of `source`, by name, as written."""
    lines = source.splitlines()
    return {
        node.name: "\n".join(lines[node.lineno - 1 : node.end_lineno])
        for node in ast.parse(source).body
        if isinstance(node, (ast.ClassDef, ast.FunctionDef))
    }


def _imported(source: str) -> set[tuple[str, str, str | None]]:
    """(module, name, as) of every top-level import of `source`."""
    found = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            found |= {(a.name, "", a.asname) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found |= {(node.module, a.name, a.asname) for a in node.names}
    return found


def _drift(block: str, source: str) -> list[str]:
    """How a page's block differs from the file: a definition written otherwise or missing from
    the file, an import the file does not make."""
    shown, written = _definitions(block), _definitions(source)
    wrong = [f"{name} differs" for name, code in shown.items() if code != written.get(name)]
    return wrong + [f"imports {i}" for i in sorted(_imported(block) - _imported(source), key=str)]


def _block() -> str:
    blocks = [
        b for b in re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S) if "class Lion(" in b
    ]
    assert len(blocks) == 1, len(blocks)
    return blocks[0]


def test_the_page_shows_the_files_code():
    """The page's block that defines `Lion` defines it, `lion_update_` and `lion_group_problem`
    exactly as examples/lion.py does, and imports only what the file imports."""
    block = _block()
    assert {"Lion", "lion_update_", "lion_group_problem"} <= set(_definitions(block))
    assert _drift(block, EXAMPLE.read_text()) == []


def test_a_drifted_copy_is_found():
    block, source = _block(), EXAMPLE.read_text()
    edited = source.replace("param.mul_(1 - lr * weight_decay)", "param.mul_(1 - lr)")
    assert edited != source and _drift(block, edited) == ["lion_update_ differs"]
    assert _drift("import math\n" + block, source) == ["imports ('math', '', None)"]
