"""The repository's Markdown pages and their ```python blocks, for the tests that run or link
them: README.md and every docs/*.md (ARCHITECTURE.md has no Python blocks to run)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the pages whose ```python blocks run as written, README first, then docs/ by name
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", flags=re.S)


def page_name(page: Path) -> str:
    """`README.md`, `docs/guide.md`: the page's path inside the repository."""
    return page.relative_to(ROOT).as_posix()


def python_blocks() -> list[tuple[str, str]]:
    """(`page-index`, code) for every ```python block, e.g. `docs/guide.md-3` (0-based per page)."""
    return [
        (f"{page_name(page)}-{i}", code)
        for page in PAGES
        for i, code in enumerate(BLOCK.findall(page.read_text()))
    ]


def blocks_with(*needles: str) -> list[tuple[str, str]]:
    """The blocks (id, code) that contain every one of `needles`."""
    return [(name, code) for name, code in python_blocks() if all(n in code for n in needles)]
