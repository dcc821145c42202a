"""Every subpackage of `vescale_optim/` ships from both regular and editable installs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import vescale_optim

pytestmark = pytest.mark.slow  # make test-fast leaves it out

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = sorted(
    ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "vescale_optim").rglob("__init__.py")
)


def test_editable_install_imports_from_the_source_tree():
    assert Path(vescale_optim.__file__).resolve().parent == ROOT / "vescale_optim"
    assert "vescale_optim.kernels" in PACKAGES and "vescale_optim.checkpoint" in PACKAGES


@pytest.mark.timeout(300)
def test_regular_install_ships_every_subpackage(tmp_path):
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
    for name in PACKAGES:
        assert (target / name.replace(".", os.sep) / "__init__.py").is_file(), name
    code = (
        f"import importlib, vescale_optim; [importlib.import_module(n) for n in {PACKAGES!r}]; "
        "print(vescale_optim.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(target)},
    ).stdout
    assert str(target) in out
