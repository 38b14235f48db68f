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


# ---- the engine's components get their own sections of the config ----------------------------------------------

#: Engine functions that may take the whole config (a ``TorshConfig``, or an untyped ``cfg``/``config``), by
#: ``module:qualified name``, grouped by why. Everything else gets the plan (``EnginePlan``, with its ``sharding``)
#: and the typed sections it reads, as torchtitan's components get theirs.
WHOLE_CONFIG_READERS: dict[str, tuple[str, ...]] = {
    # the entry points: what the user passed, a DeepSpeed dict or path, a file of any dialect, or a TorshConfig
    "entry point reading the user's config": (
        "torsh.engine.initialize:initialize", "torsh.engine.pipeline.engine:initialize_pipeline",
        "torsh.engine.initialize:init_distributed",  # deepspeed.init_distributed's signature; the config is not read
    ),
    # choosing and reading that config into the model, and naming the settings it carries but the engine does not run
    "reads the config before the plan exists": (
        "torsh.engine.config_io:load_config", "torsh.engine.config_io:choose_config", "torsh.engine.config_io:_decoded",
        "torsh.engine.config_io:read_config", "torsh.engine.config_io:config_as_dict",
        "torsh.engine.config_io:warn_not_executed",
    ),
    # "auto" and the tensor-parallel degree tp_model_init recorded are filled in: a new config, which the plan reads
    "resolves the config the plan is decided from": (
        "torsh.engine.auto:resolve_auto", "torsh.engine.auto:_Resolution.__init__",
        "torsh.engine.auto:_resolve_scheduler", "torsh.engine.auto:_total_steps",
        "torsh.engine.initialize:_with_tp_model_init", "torsh.engine.initialize:_data_parallel_size",
    ),
    # the pipeline engine's own refusals, raised together with the plan's before the model is touched; they name
    # keys of five sections (their home is the plan's refusals for a pipeline)
    "refuses what the pipeline engine cannot run, beside the plan's refusals": (
        "torsh.engine.pipeline.engine:pipeline_refusals", "torsh.engine.pipeline.engine:_config_refusals",
        "torsh.engine.pipeline.engine:_layout_refusals",
    ),
}  # fmt: skip


def _engine_functions() -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """``(module:qualified name, node)`` for every function and method of ``torsh.engine``."""
    out = []

    def visit(node: ast.AST, module: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((f"{module}:{prefix}{child.name}", child))
                visit(child, module, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, module, f"{prefix}{child.name}.")

    for name, (path, _) in _modules().items():
        if name == "torsh.engine" or name.startswith("torsh.engine."):
            visit(ast.parse(path.read_text(encoding="utf-8")), name, "")
    return out


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    a = node.args
    return [*a.posonlyargs, *a.args, *a.kwonlyargs, *([a.vararg] if a.vararg else []),
            *([a.kwarg] if a.kwarg else [])]  # fmt: skip


def _takes_whole_config(arg: ast.arg) -> bool:
    """Annotated ``TorshConfig`` (whatever its name), or a ``cfg``/``config`` of no stated type (``Any`` or none),
    behind which the root model would pass unseen."""
    annotation = ast.unparse(arg.annotation) if arg.annotation is not None else None
    if annotation is not None and "TorshConfig" in annotation:
        return True
    return arg.arg in ("cfg", "config") and annotation in (None, "Any", "typing.Any")


def _whole_config_takers() -> set[str]:
    return {name for name, node in _engine_functions() if any(_takes_whole_config(a) for a in _parameters(node))}


def test_engine_components_take_their_sections_not_the_whole_config():
    allowed = {name for names in WHOLE_CONFIG_READERS.values() for name in names}
    assert sorted(_whole_config_takers() - allowed) == []


def test_every_whole_config_reader_listed_still_takes_it():
    allowed = {name for names in WHOLE_CONFIG_READERS.values() for name in names}
    assert sorted(allowed - _whole_config_takers()) == []  # a listed function that no longer does leaves the list


def test_the_engine_never_reads_extensions_nor_the_dialect_a_config_came_from():
    # extensions holds the keys with no core meaning, kept for round trips; the plan carries everything the engine
    # acts on, whichever dialect the config was written in
    engine = ROOT / "core" / "engine"
    mentions = sorted(str(p.relative_to(engine)) for p in engine.rglob("*.py") if "extensions" in p.read_text("utf-8"))
    assert mentions == []
    dialect_parameters = sorted(f"{name}({a.arg})" for name, node in _engine_functions() for a in _parameters(node)
                                if a.arg in ("source", "dialect"))  # fmt: skip
    assert dialect_parameters == []


def test_the_whole_config_finder_sees_an_annotation_and_an_untyped_cfg():
    source = ("def a(cfg: TorshConfig): ...\ndef b(x, *, whole: 'TorshConfig | None' = None): ...\n"
              "def c(cfg: Any): ...\ndef d(cfg: GradientsConfig, config: dict): ...\n"
              "class E:\n    def f(self, cfg): ...\n")  # fmt: skip
    found = [node.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)
             and any(_takes_whole_config(a) for a in _parameters(node))]  # fmt: skip
    assert found == ["a", "b", "c", "f"]
