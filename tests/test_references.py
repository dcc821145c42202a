"""The references the distributed runs are compared against reduce as the library does, and
every tolerance covers the noise that the order of that reduction leaves.

- No test builds its mean gradient by scaling each rank's loss by `1/world` before backward:
  that rounds unlike the library's sum-then-divide, by an amount that depends on the host's
  kernels (AVX2, AVX-512 BF16, AMX). They all go through `_reference.mean_grad_reference`.
- On W >= 3 gloo's ring sums each chunk starting at another rank, so even a reference that sums
  in rank order can differ in the last bits. Each tolerance must cover twice the difference
  between the reference and itself with the ranks summed in reverse order, measured here on
  this host: a host whose kernels round more fails here, naming the tolerance to widen, rather
  than in a distributed test with no explanation.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
from _reference import max_difference, mean_grad_reference

TESTS = pathlib.Path(__file__).parent
# `(loss / world).backward()`, `(sum(...) / world_size).backward()`, `/ (world * micro)).backward()`
SCALED_BY_WORLD = re.compile(r"/\s*\(?\s*world\w*\b[^\n]*\)\s*\.backward\(")


def test_no_reference_scales_each_loss_by_one_over_world():
    for old in [
        "(loss_fn(model, batch(t, r)) / world).backward()",
        "(sum(_loss(model, t, r) for r in range(world)) / world).backward()",
        "(sum(_loss(model, 0, r) for r in range(world_size)) / world_size).backward()",
        "(loss_fn(model, *batch(step, r, m)) / (world * micro)).backward()",
    ]:
        assert SCALED_BY_WORLD.search(old), old  # the pattern this test refuses is recognised
    assert not SCALED_BY_WORLD.search("(loss_fn(model, *batch(t, rank, m)) / micro).backward()")
    found = [
        f"{path.name}:{n}: {line.strip()}"
        for path in sorted(TESTS.rglob("*.py"))
        if path.name != pathlib.Path(__file__).name
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if SCALED_BY_WORLD.search(line)
    ]
    assert not found, "use _reference.mean_grad_reference (sum, then divide):\n" + "\n".join(found)


def test_mean_grad_reference_sums_each_ranks_gradient_then_divides():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5, 3))
    unused = torch.nn.Parameter(torch.randn(2))
    xs = [torch.randn(4, 5) for _ in range(3)]

    def rank_backward(r):  # two micro-batches, accumulated as a rank does
        (xs[r] @ w).tanh().sum().backward()
        (xs[r] @ w).square().mean().backward()

    per_rank = []
    for r in range(3):
        w.grad = None
        rank_backward(r)
        per_rank.append(w.grad.clone())
    mean_grad_reference([w, unused], 3, rank_backward)
    assert torch.equal(w.grad, (per_rank[0] + per_rank[1] + per_rank[2]) / 3)
    assert unused.grad is None  # no rank has a gradient for it: no step, as in torch


def _floor_within(a, b, rtol, atol, what):
    """`a` and `b` (the reference and itself summed in reverse) agree within half the test's
    tolerance: the tolerance is at least twice the measured noise floor."""
    floor = max_difference(a, b)
    try:
        torch.testing.assert_close(a, b, rtol=rtol / 2, atol=atol / 2)
    except AssertionError as e:
        raise AssertionError(
            f"{what}: the reduction order's noise floor on this host ({floor:.3g}) "
            f"exceeds half the tolerance (rtol={rtol}, atol={atol}); widen it"
        ) from e


@pytest.mark.parametrize("world_size", [3, 4, 5])
def test_adamw_tolerance_covers_the_noise_floor(world_size):
    from _adamw_cases import TOL, reference

    a, _, _ = reference(world_size)
    b, _, _ = reference(world_size, reversed_order=True)
    _floor_within([p.detach() for p in a], [p.detach() for p in b], **TOL, what="_adamw_cases.TOL")


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_step_agreement_tolerance_covers_the_noise_floor(kind):
    from _step_agreement_cases import TOL, reference

    a, _ = reference(kind, 3)
    b, _ = reference(kind, 3, reversed_order=True)
    _floor_within(a, b, **TOL[kind], what=f"_step_agreement_cases.TOL[{kind!r}]")


@pytest.mark.parametrize("kind", ["adamw", "muon", "shampoo"])
@pytest.mark.parametrize("world_size", [3, 4])
def test_fsdp_tolerance_covers_the_noise_floor(kind, world_size):
    from _fsdp_cases import TOL, reference

    a, b = reference(kind, world_size), reference(kind, world_size, reversed_order=True)
    _floor_within(a, b, rtol=1e-5, atol=TOL[kind], what=f"_fsdp_cases.TOL[{kind!r}]")


HF_CASES = [("llama", "adamw", 2), ("llama", "muon", 2), ("mixtral", "adamw", 2), ("mixtral", "muon", 1)]


@pytest.mark.parametrize("kind,optimizer,steps", HF_CASES)
def test_hf_tolerance_covers_the_noise_floor(kind, optimizer, steps):
    pytest.importorskip("transformers")
    from _hf_models import TOL, WORLD, reference

    a = reference(kind, optimizer, WORLD, steps)
    b = reference(kind, optimizer, WORLD, steps, reversed_order=True)
    _floor_within(a, b, rtol=1e-5, atol=TOL[optimizer], what=f"_hf_models.TOL[{optimizer!r}]")
