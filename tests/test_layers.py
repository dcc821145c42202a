"""The package's layers import downwards only, with no import circle, and no module or
class outgrows one idea.

Every import counts, for both rules: at module level, under `if TYPE_CHECKING:` (a circle of
types is still a circle: the two modules cannot be understood one without the other) and
inside functions (imported late, but imported)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vescale_optim"
# each layer may import the layers after it in this list, never those before
LAYERS = [
    "demo",
    "distributed",
    "local_world",
    "checkpoint",
    "optim",
    "units",
    "owners",
    "shard",
    "kernels",
]
MAX_LINES = 420


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path) -> set[str]:
    """The package modules `name` imports anywhere: at module level, under TYPE_CHECKING
    and inside functions."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("vescale_optim"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("vescale_optim"):
                found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names)
    modules = _modules()
    return {m for m in found if m in modules and m != name}


def _layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def test_layers_import_downwards_only():
    bad = []
    for name, path in _modules().items():
        mine = _layer(name)
        if mine is None:
            continue
        for target in _imports(name, path):
            theirs = _layer(target)
            if theirs is not None and LAYERS.index(theirs) < LAYERS.index(mine):
                bad.append(f"{name} imports {target}")
    assert not bad, bad


def test_no_import_circle():
    modules = _modules()
    graph = {name: _imports(name, path) for name, path in modules.items()}
    # a package's __init__ re-exporting its submodules is not a circle of its own
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                pytest.fail("import circle: " + " -> ".join([*stack[stack.index(nxt) :], nxt]))
            if nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])


def test_modules_and_classes_stay_small():
    big = []
    for name, path in _modules().items():
        lines = path.read_text().splitlines()
        if len(lines) > MAX_LINES and not name.startswith("vescale_optim.kernels"):
            big.append(f"{name}: {len(lines)} lines")
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno > 400:
                big.append(f"{name}.{node.name}: {node.end_lineno - node.lineno} lines")
    assert not big, big


def test_tests_mirror_the_packages():
    """A test folder per package (the demo runs whole in tests/integration/), each on the
    tests' import path (conftest.FOLDERS); only tests of top-level modules and of the
    code base itself lie in tests/."""
    from conftest import FOLDERS, TESTS

    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} - {"demo"}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    assert folders == set(FOLDERS) == packages | {"integration"}, (folders, FOLDERS, packages)
    top = {p.stem for p in PACKAGE.glob("*.py")}
    for path in TESTS.glob("test_*.py"):
        assert path.stem[len("test_"):] in top | {"layers", "one_door", "references"}, path.name
