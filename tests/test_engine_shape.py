"""The engine keeps a shape one can read: its modules import one another in one direction only (no cycle, lazy
imports inside functions included), and none is over 1,000 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "core" / "engine"


def _imports() -> dict[str, set[str]]:
    """module -> the engine modules it imports (``from . import x``, ``from .x import y``, at any depth)."""
    modules = {p.stem for p in ENGINE.glob("*.py")}
    edges: dict[str, set[str]] = {}
    for path in ENGINE.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                targets = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
                found.update(t for t in targets if t in modules and t != path.stem)
        edges[path.stem] = found
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_engine_modules_import_one_another_in_one_direction():
    assert _cycles(_imports()) == []


def test_the_cycle_finder_sees_a_lazy_import_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_engine_module_is_over_1000_lines():
    sizes = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in ENGINE.glob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 1000} == {}
