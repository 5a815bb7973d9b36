"""The package's dependencies point one way: no import cycles, lazy or type-only ones included.

A lazy import inside a function, or one under TYPE_CHECKING, still couples two
modules both ways; hiding a cycle that way is what this test is for.
"""

from __future__ import annotations

import ast
from pathlib import Path

import vrnic

ROOT = Path(vrnic.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # `from vrnic.core import rings` imports the module vrnic.core.rings.
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                # A package's __init__ importing its own submodules is how packages re-export, not a cycle.
                if target and target != name and not (path.name == "__init__.py" and target.startswith(name + ".")):
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_lazy_imports() -> None:
    graph = import_graph()
    assert "vrnic.backend.pyverbs_edge" in graph["vrnic.backend.drivers.paravirtual"]  # imported inside __init__
    assert "vrnic.core.rings" in graph["vrnic.backend.engine"]


def test_a_planted_cycle_is_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_in_vrnic() -> None:
    assert cycles(import_graph()) == []


def test_the_core_does_no_io_and_knows_no_backend() -> None:
    forbidden = ("vrnic.backend", "vrnic.api", "vrnic.db", "vrnic.cli", "vrnic.frontend", "vrnic.lab")
    graph = import_graph()
    for name in graph:
        if name.startswith("vrnic.core"):
            assert not [t for t in graph[name] if t.startswith(forbidden)], name
