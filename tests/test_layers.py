"""The package's layers import downwards only, with no import circle, and no module, class
or function outgrows one idea; ARCHITECTURE.md's map of the files says what their imports are;
the formatter is off for a few tables only.

Every import counts, for both rules: at module level, under `if TYPE_CHECKING:` (a circle of
types is still a circle: the two modules cannot be understood one without the other) and
inside functions (imported late, but imported)."""

import ast
import re
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
MAX_FUNCTION_LINES = 60
# functions that may be longer, each a data table or an argparse table that reads best whole:
# "module.qualified_name" -> why
LONG_FUNCTIONS: dict[str, str] = {}
# `# fmt: skip` / `# fmt: off` lines in the package, at most; each keeps a table whose alignment
# carries meaning, with a comment on the line above the statement it keeps saying why
MAX_FORMATTER_OFF = 15
FORMATTER_OFF = re.compile(r"#\s*fmt:\s*(skip|off)\b")
ARCHITECTURE = PACKAGE.parent / "ARCHITECTURE.md"
# the packages ARCHITECTURE.md maps file by file ("## File by file")
MAPPED = ["units", "optim", "owners", "shard", "checkpoint", "kernels"]


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
        if len(lines) > MAX_LINES:
            big.append(f"{name}: {len(lines)} lines")
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno > 400:
                big.append(f"{name}.{node.name}: {node.end_lineno - node.lineno} lines")
    assert not big, big


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function in `tree`, methods and nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def test_functions_stay_short():
    """No function (with its signature and docstring, without its decorators) is over
    MAX_FUNCTION_LINES lines, but the data tables of LONG_FUNCTIONS."""
    long, stale = [], set(LONG_FUNCTIONS)
    for name, path in _modules().items():
        for qualified, node in _functions(ast.parse(path.read_text())):
            key = f"{name}.{qualified}"
            stale.discard(key)
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES and key not in LONG_FUNCTIONS:
                long.append(f"{key}: {lines} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into named pieces): {long}"
    assert not stale, f"LONG_FUNCTIONS names functions that no longer exist: {sorted(stale)}"


def _statement_start(tree: ast.AST, line: int) -> int:
    """The first line (decorators included) of the innermost statement that ends on `line`,
    or whose header does (a `def ...:  # fmt: skip`)."""
    best = None
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt) or node.lineno > line:
            continue
        body = getattr(node, "body", None)
        ends_here = node.end_lineno == line or (body and body[0].lineno > line)
        if ends_here and (best is None or node.lineno > best.lineno):
            best = node
    if best is None:
        return line
    return min([best.lineno, *(d.lineno for d in getattr(best, "decorator_list", []))])


def test_the_formatter_is_off_for_a_few_tables_only():
    """`ruff format` runs on the whole package (`make lint`); at most MAX_FORMATTER_OFF lines
    switch it off, each under a comment that says why."""
    found, unexplained = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        for number, line in enumerate(lines, 1):
            if not FORMATTER_OFF.search(line):
                continue
            where = f"{path.relative_to(PACKAGE).as_posix()}:{number}"
            found.append(where)
            start = number if line.strip().startswith("#") else _statement_start(tree, number)
            if start < 2 or not lines[start - 2].strip().startswith("#"):
                unexplained.append(where)
    assert len(found) <= MAX_FORMATTER_OFF, f"{len(found)} lines switch the formatter off: {found}"
    assert not unexplained, f"no comment above says why the formatter is off: {unexplained}"


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
        assert path.stem[len("test_") :] in top | {"layers", "one_door", "references"}, path.name


def _test_modules_imported(source: str, test_modules: set[str]) -> list[tuple[int, str]]:
    """(line, module) of each import in `source` of a module named in `test_modules`: `import`,
    `from ... import` (at module level or inside a function) and `importlib.import_module` of a
    literal name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            targets = [node.module or ""]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            targets = [str(node.args[0].value)]
        else:
            continue
        found += [(node.lineno, t) for t in targets if t.split(".")[0] in test_modules]
    return found


def test_no_test_module_is_imported_by_another_module():
    """What tests share (models, training loops, references, tolerances) lives in helpers, tests/_*.py;
    no file under tests/ imports a test module (tests/**/test_*.py), so each reads and runs alone."""
    from conftest import TESTS

    seen = _test_modules_imported(  # the check sees every form (a relative import is a package's)
        "import test_a\nfrom test_b.c import d\ndef f():\n    from test_c import e as g\n"
        "importlib.import_module('test_d')\nimport _helper\nfrom . import test_e\n",
        {"test_a", "test_b", "test_c", "test_d", "test_e"},
    )
    assert sorted(seen) == [(1, "test_a"), (2, "test_b.c"), (4, "test_c"), (5, "test_d")], seen
    test_modules = {p.stem for p in TESTS.rglob("test_*.py")}
    found = [
        f"{path.relative_to(TESTS)}:{line} imports {module}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, module in _test_modules_imported(path.read_text(), test_modules)
    ]
    assert not found, "move what is shared into a tests/_*.py helper:\n" + "\n".join(found)


def map_imports(name: str, path: Path) -> str:
    """The imports cell of module `name`'s row in ARCHITECTURE.md's map: every package module it
    imports (all of them, as `_imports` counts): those of its own package first, by file name
    (`unit`), then others as `package.module` (`shard.collectives`), a package's `__init__` as the
    package (`kernels`) and only when none of its modules is named; `—` for none."""
    own = name.split(".")[1]
    found = _imports(name, path)
    found = {m for m in found if not any(other.startswith(m + ".") for other in found)}
    names = [m.removeprefix("vescale_optim.") for m in found]
    mine = sorted(m.removeprefix(own + ".") for m in names if m.startswith(own + "."))
    return ", ".join(f"`{m}`" for m in mine + sorted(m for m in names if not m.startswith(own + "."))) or "—"


def _map_rows() -> dict[str, dict[str, str]]:
    """package -> file name -> imports cell, from ARCHITECTURE.md's "File by file" tables."""
    text = ARCHITECTURE.read_text()
    assert "\n## File by file\n" in text, "ARCHITECTURE.md has no '## File by file' section"
    section = text.split("\n## File by file\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, dict[str, str]] = {}
    package = None
    for line in section.splitlines():
        if heading := re.fullmatch(r"### `(\w+)/`", line):
            package = heading[1]
            rows[package] = {}
        elif package and (row := re.fullmatch(r"\| `(\w+\.py)` \| .+ \| ([^|]*) \|", line)):
            assert row[1] not in rows[package], f"{package}/{row[1]} has two rows"
            rows[package][row[1]] = row[2]
    return rows


def test_the_map_has_a_row_for_every_file_and_no_other():
    rows = _map_rows()
    assert list(rows) == MAPPED, list(rows)
    wrong = []
    for package in MAPPED:
        files, named = {p.name for p in (PACKAGE / package).glob("*.py")}, set(rows[package])
        wrong += [f"{package}/{f}: no row" for f in sorted(files - named)]
        wrong += [f"{package}/{f}: a row, but no such file" for f in sorted(named - files)]
    assert not wrong, "ARCHITECTURE.md's map:\n" + "\n".join(wrong)


def test_the_maps_imports_are_the_codes():
    modules = {path: name for name, path in _modules().items()}
    wrong = []
    for package, rows in _map_rows().items():
        for file, cell in rows.items():
            path = PACKAGE / package / file
            want = map_imports(modules[path], path)
            if cell != want:
                wrong.append(f"{package}/{file}: the imports cell should read | {want} |")
    assert not wrong, "ARCHITECTURE.md's map:\n" + "\n".join(wrong)
