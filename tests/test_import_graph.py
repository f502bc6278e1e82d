"""nanoserve's imports point one way: no cycle between modules, none between folders.

The graph is read from the source with `ast` (nothing is imported, so CUDA-only modules count
too). Every import statement counts, wherever it is written: inside a function (a lazy import is
still a dependency, only a later one) and under `if TYPE_CHECKING:` (a type-only import still
ties the two designs together; that is how the llm <-> streaming cycle hid). `from pkg import
name` is an edge to the submodule pkg.name when that is a module, else to pkg itself. A package's
__init__ is not counted as imported by its submodules (Python runs it first, but that is not a
dependency anyone wrote), so a package re-exporting its own modules is no cycle.

Folders: nanoserve/engine/x.py belongs to `engine`, and each top-level module (nanoserve/llm.py)
is a unit of its own, as is the package's __init__ (the public facade).
"""
from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

import nanoserve

# Cycles that other commits of the same series remove (issue 20); each must still exist, so an
# entry is deleted with the cycle it names. Not a place for new cycles.
ROOT = Path(nanoserve.__file__).parent
PACKAGE = ROOT.name


def module_name(path: Path) -> str:
    parts = (PACKAGE, *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The nanoserve modules `name` (at `path`) imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: climb level - 1 packages from this one
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


@cache  # read once per session; callers do not modify it
def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def unit(module: str) -> str:
    """The folder a module belongs to; a top-level module, or the package __init__, is its own."""
    parts = module.split(".")
    if module == PACKAGE:
        return f"{PACKAGE}/__init__"
    if len(parts) == 2 and (ROOT / f"{parts[1]}.py").exists():
        return f"{parts[1]}.py"
    return parts[1]


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    folders: dict[str, set[str]] = {}
    for module, deps in graph.items():
        folders.setdefault(unit(module), set()).update(unit(d) for d in deps if unit(d) != unit(module))
    return folders


def components(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one node: each holds at least one cycle (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:  # recursion depth is bounded by the number of modules (~150)
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            members = stack[stack.index(node):]
            del stack[stack.index(node):]
            if len(members) > 1:
                found.append(frozenset(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A concrete path start -> ... -> start inside a strongly connected component (BFS back to start)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for dep in sorted(graph[node] & component):
                if dep == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if dep not in parents:
                    parents[dep] = node
                    nxt.append(dep)
        frontier = nxt
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def check_acyclic(graph: dict[str, set[str]], what: str) -> None:
    found = set(components(graph))
    assert not found, f"import cycles between {what} (one cycle shown per tangle):\n" + "\n".join(
        "  " + " -> ".join(cycle_in(graph, c)) for c in sorted(found, key=min))


def test_the_graph_sees_every_kind_of_import():
    """The walker finds the imports this test relies on (else an empty graph would pass)."""
    graph = import_graph()
    assert len(graph) > 50
    assert "nanoserve.engine.model_runner" in graph["nanoserve.engine.llm_engine"]  # module level
    assert "nanoserve.engine.tp_runner" in graph["nanoserve.engine.llm_engine"]  # inside a function
    assert "nanoserve.engine.model_runner" in graph["nanoserve.engine.runner"]  # under TYPE_CHECKING
    assert "nanoserve.distributed.process_group" in graph["nanoserve.engine.tp_runner"]  # from pkg import module
    assert unit("nanoserve.engine.tp_runner") == "engine" and unit("nanoserve.llm") == "llm.py"


def test_cycles_are_found_and_named():
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set(), "e": {"d"}}
    assert components(graph) == [frozenset("abc")]
    assert cycle_in(graph, frozenset("abc")) == ["a", "b", "c", "a"]
    with pytest.raises(AssertionError, match="a -> b -> c -> a"):
        check_acyclic(graph, "modules")
    check_acyclic({"a": {"b"}, "b": set()}, "modules")


def test_no_module_imports_itself_through_others():
    check_acyclic(import_graph(), "modules")


def test_no_folder_imports_itself_through_others():
    check_acyclic(folder_graph(import_graph()), "folders")


def test_distributed_holds_collectives_only():
    """distributed/ is below the engine: it imports nothing from engine/ (DESIGN.md's folder table)."""
    graph = import_graph()
    upward = {(m, d) for m, deps in graph.items() if unit(m) == "distributed" for d in deps if unit(d) == "engine"}
    assert not upward
