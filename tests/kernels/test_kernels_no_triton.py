"""Triton is optional: without it the kernels and optimizers run on the torch reference,
with the same numbers, and ``backend="triton"`` is a clear error.

A subprocess makes ``triton`` unimportable (``sys.modules["triton"] = None``: importing it
raises ``ModuleNotFoundError`` and ``importlib.util.find_spec`` finds nothing, as when it is
not installed) and trains the same small model as this process, which has Triton.
"""

import subprocess
import sys
import textwrap

import torch

TRAIN = textwrap.dedent(
    """
    import torch
    import vescale_optim as vo


    def train():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 64))
        weights = [p for p in model.parameters() if p.ndim == 2]
        biases = [p for p in model.parameters() if p.ndim < 2]
        opts = [
            vo.Muon([dict(params=weights), dict(params=biases, use_muon=False)], lr=0.02),
            vo.AdamW(model.parameters(), lr=1e-3, state_bits=8),
        ]
        x = torch.randn(32, 64)
        for opt in opts:
            for _ in range(2):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]
    """
)

BLOCKED = (
    "import sys\nsys.modules['triton'] = None\n"
    + TRAIN
    + textwrap.dedent(
        """
    import importlib.util

    from vescale_optim.kernels import newton_schulz, quantize_blockwise

    assert importlib.util.find_spec("triton") is None
    x = torch.randn(24, 40)
    for call in (lambda: newton_schulz(x, backend="triton"),
                 lambda: quantize_blockwise(x, backend="triton")):
        try:
            call()
        except RuntimeError as e:
            assert "needs the `triton` package" in str(e), e
        else:
            raise AssertionError("backend='triton' without triton did not raise")
    try:
        import vescale_optim.kernels.aot  # noqa: F401
    except ImportError as e:
        assert "vescale_optim[triton]" in str(e), e
    else:
        raise AssertionError("kernels.aot imported without triton")
    torch.save(train(), sys.argv[1])
    assert sys.modules["triton"] is None
    """
    )
)


def test_kernels_and_optimizers_run_without_triton(tmp_path):
    out = tmp_path / "params.pt"
    cmd = [sys.executable, "-c", BLOCKED, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    namespace = {}
    exec(TRAIN, namespace)
    expected = namespace["train"]()
    for got, want in zip(torch.load(out), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
