"""Every ```python block of README.md and of docs/*.md runs as written (one process, no process
group, in a fresh working directory: blocks may write files), and every relative link of
README.md, ARCHITECTURE.md and docs/*.md leads to a file of the repository (and an anchor to a
heading of that page)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _docs import PAGES, ROOT, page_name, python_blocks

BLOCKS = python_blocks()
LINKED_PAGES = [*PAGES, ROOT / "ARCHITECTURE.md"]
FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_PATH = re.compile(r"`(\.\./[^`\s]*)`")  # a path written as code that climbs out of the page's folder


def test_readme_has_examples():
    assert len([name for name, _ in BLOCKS if name.startswith("README.md-")]) >= 4


def test_readme_stays_a_front_page():
    """Under 300 lines: the rest lives in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) < 300


@pytest.mark.parametrize("name, code", BLOCKS, ids=[name for name, _ in BLOCKS])
def test_readme_example_runs(name, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"{name} (block)", "exec"), {"__name__": "__readme__"})


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    """The anchors of a page's headings (outside code fences); repeats get -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", page.read_text()), flags=re.M):
        slug = _slug(heading)
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _broken_links(page: Path, root: Path = ROOT) -> list[str]:
    text = FENCE.sub("", page.read_text())
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not a file of the repository
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.is_relative_to(root) or not file.exists():
            broken.append(f"{target}: no such file in the repository")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(root).as_posix()}")
    for path in CODE_PATH.findall(text):
        if not (page.parent / path).resolve().is_relative_to(root):
            broken.append(f"`{path}`: outside the repository")
    return broken


@pytest.mark.parametrize("page", LINKED_PAGES, ids=[page_name(p) for p in LINKED_PAGES])
def test_links_resolve_inside_the_repository(page):
    assert _broken_links(page) == []


def test_broken_links_are_found(tmp_path):
    assert _slug("Kernels (`vescale_optim.kernels`)") == "kernels-vescale_optimkernels"
    assert _anchors(ROOT / "README.md") >= {"quick-start", "install"}
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "README.md").write_text("# Title\n\n## Install\n\n## Install\n")
    page = root / "docs" / "page.md"
    page.write_text(
        "# Probe\n[a](../README.md#install-1) [b](../README.md#usage) [c](missing.md) [d](#probe)\n"
        "[e](https://example.org) `../../outside.md` `../README.md`\n```\n[f](in-a-fence.md)\n```\n"
    )
    assert _broken_links(page, root) == [
        "../README.md#usage: no heading #usage in README.md",
        "missing.md: no such file in the repository",
        "`../../outside.md`: outside the repository",
    ]
