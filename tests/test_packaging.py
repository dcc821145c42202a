"""`kernels/` ships as `vescale_optim.kernels` from both regular and editable installs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import vescale_optim.kernels

ROOT = Path(__file__).resolve().parents[1]


def test_editable_install_maps_kernels():
    assert Path(vescale_optim.kernels.__file__).resolve().parent == ROOT / "kernels"


@pytest.mark.timeout(300)
def test_regular_install_ships_kernels(tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(ROOT),
        ],
        check=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    assert (target / "vescale_optim" / "kernels" / "__init__.py").is_file()
    code = "import vescale_optim.kernels as k, vescale_optim.shard; print(k.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(target)},
    ).stdout
    assert str(target) in out
