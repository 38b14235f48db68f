"""The project keeps a shape one can read: its modules import one another in one direction only (no cycle, lazy
imports inside functions included), no module imports a higher layer than its own (lazily or not), and no engine
module is over 1,000 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Source directory -> the import package it installs as (pyproject.toml's package-dir).
PACKAGES = {"core": "torsh", "adapters": "torsh.adapters", "schemas": "torsh.schemas"}

#: The layers, lowest first. A module may import modules of its own layer and of lower layers, never of a higher
#: one: the config model knows no dialect, the dialects know no engine, the engine knows neither the DeepSpeed and
#: Horovod compatibility packages nor the command line (DESIGN.md: "keep the compatibility layer at the edge").
#: An entry names a module or a package with everything under it (``torsh`` itself is only the package root).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("torsh", "torsh.errors", "torsh.deferred", "torsh._config_docs", "torsh.concepts",
                    "torsh.formats", "torsh.ranks", "torsh.launch_args")),
    ("config model", ("torsh.config_base", "torsh.config_job", "torsh.config_training", "torsh.config",
                      "torsh.sharding_plan")),
    ("dialect pipeline", ("torsh.translate", "torsh.compression_rules", "torsh.schemas", "torsh.dialect")),
    # torch-free readings of the model that the engine, `explain` and the adapters share (accelerate's writer
    # states the process count from torsh.contract)
    ("plan", ("torsh.plan", "torsh.contract")),
    ("adapters", ("torsh.adapters",)),
    # the engine reads configs through the adapters (the same pipeline as convert)
    ("engine", ("torsh.engine", "torsh.models")),
    ("compatibility", ("torsh.compat", "torsh.horovod")),
    ("runners", ("torsh.run", "torsh.parity")),
    ("command line", ("torsh.cli", "torsh.demo", "torsh.__main__")),
)  # fmt: skip

#: Upward imports that are being removed, each with why it is still here (none now).
ALLOWED_UPWARD: set[tuple[str, str]] = set()


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, whether it is a package's ``__init__``), for every .py file of the three packages."""
    found = {}
    for directory, package in PACKAGES.items():
        for path in sorted((ROOT / directory).rglob("*.py")):
            parts = list(path.relative_to(ROOT / directory).with_suffix("").parts)
            if "__pycache__" in parts or any(p.startswith(".") for p in parts):
                continue
            is_package = parts[-1] == "__init__"
            name = ".".join([package, *(parts[:-1] if is_package else parts)])
            found[name] = (path, is_package)
    return found


def _targets(node: ast.Import | ast.ImportFrom, package: str, modules: dict) -> list[str]:
    """The modules an import statement loads: ``import a.b`` -> a.b; ``from a import b`` -> a, and a.b when b is
    a module (relative imports resolved against ``package``); names outside the project are dropped."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
        source = ".".join(base + ([node.module] if node.module else []))
        names = [source] + [f"{source}.{alias.name}" for alias in node.names]
    out = []
    for name in names:
        parts = name.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()  # a.b.Class -> a.b
        if parts:
            out.append(".".join(parts))
    return out


def _imports(source: str, name: str, is_package: bool, modules: dict) -> set[str]:
    """The project modules module ``name`` imports anywhere in ``source`` (inside functions too), leaving out its
    own package and the packages above it (loaded before it in any case)."""
    package = name if is_package else name.rpartition(".")[0]
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update(t for t in _targets(node, package, modules) if t not in ancestors)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path.read_text(encoding="utf-8"), name, is_package, modules)
            for name, (path, is_package) in modules.items()}  # fmt: skip


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _layer(module: str) -> int | None:
    for rank, (_, entries) in enumerate(LAYERS):
        if any(module == e or (e != "torsh" and module.startswith(e + ".")) for e in entries):
            return rank
    return None


def test_no_import_cycle_in_the_project():
    assert _cycles(_graph()) == []


def test_every_module_has_a_layer():
    assert sorted(m for m in _modules() if _layer(m) is None) == []


def test_no_module_imports_a_higher_layer():
    upward = sorted(f"{a} ({LAYERS[_layer(a)][0]}) -> {b} ({LAYERS[_layer(b)][0]})"
                    for a, targets in _graph().items() for b in targets
                    if (a, b) not in ALLOWED_UPWARD and None not in (_layer(a), _layer(b)) and _layer(b) > _layer(a))
    assert upward == []


def test_the_cycle_finder_sees_a_lazy_import_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_import_finder_sees_imports_inside_functions_and_relative_ones():
    modules = {"torsh.engine": None, "torsh.engine.a": None, "torsh.engine.zero": None, "torsh.engine.zero.b": None,
               "torsh.compat": None}  # fmt: skip
    source = "from ..a import f\n\ndef g():\n    from torsh.compat import x\n    from . import b\n"
    assert _imports(source, "torsh.engine.zero.c", False, modules) == {"torsh.engine.a", "torsh.compat",
                                                                       "torsh.engine.zero.b"}


def test_no_engine_module_is_over_1000_lines():
    engine = ROOT / "core" / "engine"
    sizes = {str(p.relative_to(engine)): len(p.read_text(encoding="utf-8").splitlines()) for p in engine.rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 1000} == {}
