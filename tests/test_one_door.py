"""One door for torch.distributed: no module of the package calls it but `shard/handle.py`.

Collectives on tensors are built in `shard/collectives.py` (and `shard/flags.py`) and handed
to the door as calls (`issue(op, lambda: dist.all_reduce(...))`): the door issues, queues
(`delayed()`) and traces them. The rest (object calls, group creation, rank and size
queries) are `handle`'s own functions. What other modules may still name, and why (the
docstring of `shard/handle.py` says the same):

- the types `ProcessGroup` and `DeviceMesh`, for isinstance checks and annotations (never
  called: a type is not a call);
- DCP, `torch.distributed.checkpoint` (the checkpoint format; its save and load coordinate
  the group they are given themselves), in `checkpoint/` and `shard/dcp.py`;
- the setup of a user's process group (init, destroy, the stores) in `distributed.py`,
  `local_world.py` and `demo/launch.py`: they make the group the library then uses.

The check reads the source (AST): imports of torch.distributed and its submodules, names
imported from them, and attribute chains through an alias (`dist.x`) or
`torch.distributed.x`, at module level and inside functions alike.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vescale_optim"
DOOR = "shard/handle.py"
COLLECTIVE_LAYER = "shard/collectives.py"
COLLECTIVE_FILES = {COLLECTIVE_LAYER, "shard/flags.py"}  # the collective layer: its flags' all-reduces too
TYPES = {"torch.distributed.ProcessGroup", "torch.distributed.device_mesh.DeviceMesh"}
DCP = "torch.distributed.checkpoint"
DCP_FILES = ("checkpoint/", "shard/dcp.py")
SETUP_FILES = {"distributed.py", "local_world.py", "demo/launch.py"}
SETUP = {
    f"torch.distributed.{name}"
    for name in (
        "init_process_group",
        "destroy_process_group",
        "is_available",
        "TCPStore",
        "PrefixStore",
        "Store",
        "DistError",
        "constants.default_pg_timeout",
    )
}
# a synchronous collective of the collective layer, announced to the door (before_synchronous)
SYNCHRONOUS = {("all_gather_object", "torch.distributed.all_gather_object")}


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _uses(tree: ast.Module) -> list[tuple[ast.AST, str]]:
    """Each use of torch.distributed in `tree`: the node and the full name it reaches."""
    aliases: dict[str, str] = {}
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch" or a.name.startswith("torch."):
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                if a.name.startswith("torch.distributed"):
                    uses.append((node, a.name))
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full.startswith("torch.distributed"):
                    aliases[a.asname or a.name] = full
                    uses.append((node, full))
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Attribute, ast.Name)) or id(node) in inner:
            continue  # only the outermost node of a chain
        parts = _dotted(node)
        if parts is None or parts[0] not in aliases:
            continue
        full = ".".join([aliases[parts[0]], *parts[1:]])
        if full.startswith("torch.distributed"):
            uses.append((node, full))
    return uses


def _parents(tree: ast.Module) -> dict[int, ast.AST]:
    return {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _called(node: ast.AST, parents: dict[int, ast.AST]) -> bool:
    parent = parents.get(id(node))
    return isinstance(parent, ast.Call) and parent.func is node


def _handed_to_issue(node: ast.AST, parents: dict[int, ast.AST]) -> bool:
    """Whether `node` is inside a lambda passed to `issue(...)` (the door makes the call)."""
    while (parent := parents.get(id(node))) is not None:
        if isinstance(node, ast.Lambda) and isinstance(parent, ast.Call) and node in parent.args:
            name = _dotted(parent.func)
            if name is not None and name[-1] == "issue":
                return True
        node = parent
    return False


def _function(node: ast.AST, parents: dict[int, ast.AST]) -> str | None:
    while (node := parents.get(id(node))) is not None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return node.name
    return None


def _within(full: str, names) -> bool:
    return any(full == n or full.startswith(n + ".") for n in names)


def _allowed(rel: str, node: ast.AST, full: str, parents: dict[int, ast.AST]) -> bool:
    if rel == DOOR or full == "torch.distributed" and isinstance(node, ast.Import):
        return True  # the door; a bare `import torch.distributed as dist` is judged by its uses
    if _within(full, TYPES) and not _called(node, parents):
        return True
    if _within(full, [DCP]) and rel.startswith(DCP_FILES):
        return True
    if rel in SETUP_FILES and _within(full, SETUP):
        return True
    if rel in COLLECTIVE_FILES:
        if not _called(node, parents) and not isinstance(node, ast.ImportFrom):
            return True  # constants (ReduceOp) and the functions it hands to the door
        return _handed_to_issue(node, parents) or (_function(node, parents), full) in SYNCHRONOUS
    return False


def violations(rel: str, source: str) -> list[str]:
    """`rel:line: name` for each use of torch.distributed in `source` (module `rel` of the
    package, a path relative to it) that does not go through the door."""
    tree = ast.parse(source)
    parents = _parents(tree)
    found = {
        f"{rel}:{node.lineno}: {full}" for node, full in _uses(tree) if not _allowed(rel, node, full, parents)
    }
    return sorted(found, key=lambda s: int(s.split(":")[1]))


def test_every_torch_distributed_call_goes_through_the_door():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        bad += violations(rel, path.read_text())
    assert not bad, "torch.distributed used outside shard/handle.py:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("rel", "source", "expected"),
    [
        (
            "units/x.py",
            "import torch.distributed as dist\n\ndist.all_reduce(t)\n",
            ["3: torch.distributed.all_reduce"],
        ),
        ("units/x.py", "import torch\ntorch.distributed.barrier()\n", ["2: torch.distributed.barrier"]),
        (
            "optim/x.py",
            "def f():\n    from torch.distributed import new_group\n    new_group([0])\n",
            ["2: torch.distributed.new_group", "3: torch.distributed.new_group"],
        ),
        (
            "units/x.py",
            "from torch import distributed as d\nd.get_rank()\n",
            ["1: torch.distributed", "2: torch.distributed.get_rank"],
        ),
        (
            "checkpoint/x.py",
            "import torch.distributed as dist\nw = dist.all_gather_object\n",
            ["2: torch.distributed.all_gather_object"],
        ),
        (
            "units/x.py",
            "import torch.distributed.checkpoint as dcp\ndcp.save(sd)\n",
            ["1: torch.distributed.checkpoint", "2: torch.distributed.checkpoint.save"],
        ),
        (
            "units/x.py",
            "from torch.distributed import ProcessGroup\nProcessGroup()\n",
            ["2: torch.distributed.ProcessGroup"],
        ),
        (
            "demo/launch.py",
            "import torch.distributed as dist\ndist.barrier()\n",
            ["2: torch.distributed.barrier"],
        ),
        (
            COLLECTIVE_LAYER,
            "import torch.distributed as dist\ndist.all_reduce(t)\n",
            ["2: torch.distributed.all_reduce"],
        ),
        (COLLECTIVE_LAYER, "from torch.distributed import all_reduce\n", ["1: torch.distributed.all_reduce"]),
    ],
    ids=[
        "alias",
        "attribute",
        "function-level",
        "from-torch",
        "reference",
        "dcp-outside",
        "type-called",
        "setup-collective",
        "collective-outside-issue",
        "collective-imported",
    ],
)
def test_the_check_can_fail(rel, source, expected):
    """Each snippet breaks the rule: the check names the file and the line."""
    assert violations(rel, source) == [f"{rel}:{e}" for e in expected]


@pytest.mark.parametrize(
    ("rel", "source"),
    [
        ("units/x.py", "from torch.distributed import ProcessGroup\nisinstance(g, ProcessGroup)\n"),
        ("units/x.py", "from torch.distributed.device_mesh import DeviceMesh\ndef f(m: DeviceMesh): ...\n"),
        ("checkpoint/x.py", "import torch.distributed.checkpoint as dcp\ndcp.save(sd)\n"),
        ("local_world.py", "import torch.distributed as dist\ndist.init_process_group('gloo')\n"),
        (
            COLLECTIVE_LAYER,
            "import torch.distributed as dist\nissue(op, lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM))\n",
        ),
        (
            COLLECTIVE_LAYER,
            "import torch.distributed as dist\ndef all_gather_object(o):\n    dist.all_gather_object(o)\n",
        ),
        (DOOR, "import torch.distributed as dist\ndist.new_group([0, 1])\n"),
    ],
    ids=["type-isinstance", "type-annotation", "dcp", "setup", "collective-issued", "synchronous", "door"],
)
def test_the_check_allows_the_door_and_its_exceptions(rel, source):
    assert violations(rel, source) == []
