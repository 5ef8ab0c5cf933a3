"""The package's floors: each folder is one layer, and imports only run downward, with no circles.

Every import in every module counts, also one deferred into a function (a circle broken by
deferring an import is still a circle); only `if TYPE_CHECKING:` imports are left out, since they
never run. docs/architecture.md draws the same picture and says what each folder owns.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "zerotrain"

LAYERS: list[tuple[str, ...]] = [
    ("system",),  # the machine underneath: durable (fsynced, atomic) file writes, whether a process runs
    ("config",),  # what the user gives: the DeepSpeed config model, loading, "auto"; user errors and how they show
    ("comm",),  # process groups from any launcher, counted collectives, teardown at exit
    ("optim", "zero", "checkpoint", "profiling", "sequence"),  # a step's parts: optimizers, ZeRO, checkpoints, FLOPs, sequence shards
    ("runtime",),  # the engine: forward -> backward -> step, loss scaling, timers
    ("compat", "__init__"),  # the DeepSpeed face: initialize, the `deepspeed` stand-in; the package's public names
    ("train", "launcher", "planning", "autotuning", "bench"),  # the jobs
    ("cli", "__main__"),  # the command line: one parser per job, registered in one place
]
"""Bottom to top. A module may import its own layer's folders and those below, never those above."""
OUTSIDE = ("standin",)
"""Not part of the import tree: the `deepspeed` stand-in package is data that zerotrain puts on sys.path."""
LEVEL = {room: level for level, rooms in enumerate(LAYERS) for room in rooms}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py") if not set(OUTSIDE) & set(p.relative_to(PACKAGE).parts)}


def room_of(module: str) -> str:
    """The top folder (or root module) of `zerotrain.x.y`: "x"; the package itself is "__init__"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


class _Imports(ast.NodeVisitor):
    """Every zerotrain module a module imports, at any depth, outside `if TYPE_CHECKING:`."""

    def __init__(self, module: str, is_package: bool, modules: dict[str, Path]) -> None:
        self.module, self.is_package, self.modules = module, is_package, modules
        self.found: set[str] = set()

    def visit_If(self, node: ast.If) -> None:
        if "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def _add(self, name: str) -> None:
        parts = name.split(".")
        while parts and ".".join(parts) not in self.modules:
            parts.pop()
        if parts and ".".join(parts) != self.module:
            self.found.add(".".join(parts))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] == "zerotrain":
                self._add(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.module.split(".")
            base = base[: len(base) - node.level + (1 if self.is_package else 0)]
            name = ".".join(base + ([node.module] if node.module else []))
        else:
            name = node.module or ""
        if name.split(".")[0] != "zerotrain":
            return
        for alias in node.names:
            full = f"{name}.{alias.name}"
            self._add(full if full in self.modules else name)


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        visitor = _Imports(name, path.name == "__init__.py", modules)
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        graph[name] = visitor.found
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_every_folder_and_root_module_belongs_to_a_layer(graph):
    unplaced = sorted({room_of(m) for m in graph} - set(LEVEL))
    assert not unplaced, f"not in any layer of tests/test_layers.py LAYERS (and docs/architecture.md): {unplaced}"


def test_imports_only_run_downward(graph):
    upward = sorted(
        f"{a} ({room_of(a)}, layer {LEVEL[room_of(a)]}) imports {b} ({room_of(b)}, layer {LEVEL[room_of(b)]})"
        for a, targets in graph.items() for b in targets
        if room_of(a) in LEVEL and room_of(b) in LEVEL and LEVEL[room_of(b)] > LEVEL[room_of(a)]
    )
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


def test_no_module_imports_itself_in_a_circle(graph):
    found = circles(graph)
    assert not found, "import circles (deferred imports count):\n" + "\n".join(" -> ".join(c) for c in found)


def test_folders_of_one_layer_do_not_import_each_other_both_ways(graph):
    rooms: dict[str, set[str]] = defaultdict(set)
    for a, targets in graph.items():
        for b in targets:
            if room_of(a) != room_of(b):
                rooms[room_of(a)].add(room_of(b))
    both_ways = sorted({tuple(sorted((a, b))) for a, bs in rooms.items() for b in bs if a in rooms.get(b, ())})
    assert not both_ways, f"folders that import each other: {both_ways}"


def test_the_checker_sees_a_circle_and_an_upward_import():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert room_of("zerotrain.zero.stage") == "zero" and room_of("zerotrain") == "__init__"
    assert LEVEL["cli"] > LEVEL["train"] > LEVEL["runtime"] > LEVEL["zero"] > LEVEL["comm"] > LEVEL["config"] > LEVEL["system"]
