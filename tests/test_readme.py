"""Every ```python block of the README runs as written (one process, no process group, in a
fresh working directory: blocks may write files)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = BLOCKS[index]
    exec(compile(code, f"README.md block {index}", "exec"), {"__name__": "__readme__"})
