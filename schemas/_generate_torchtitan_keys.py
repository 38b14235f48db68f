"""Regenerate ``keys/torchtitan.json``: every section and key of a torchtitan job-config TOML, from torchtitan's source.

A maintenance tool for a torchtitan version bump. It reads the installed package's source with ``ast`` and imports
nothing of it (torchtitan's own imports need its training dependencies), so ``pip install --no-deps
torchtitan==0.2.2`` is enough: ``python -m torsh.schemas._generate_torchtitan_keys [OUT]`` (default:
``keys/torchtitan.json`` next to this file).

torchtitan 0.2.2 is the last release that reads TOML job configs (``--job.config_file``): ``ConfigManager`` turns the
file into the ``JobConfig`` dataclass of ``torchtitan/config/job_config.py`` and refuses any key it does not define.
A model or experiment extends it through ``[job] custom_config_module``, a module whose own ``JobConfig`` is merged in
(section by section); every such ``job_config.py`` in the package is listed under ``extensions``. From 0.3.0 on,
torchtitan configures runs with Python config functions and has no TOML file format.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

MAIN = "torchtitan.config.job_config"
_NO_DEFAULT = object()


def package_dir(name: str) -> Path:
    """Where an installed package's source is, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{name} is not installed: pip install --no-deps {name}==<version>")
    return Path(next(iter(spec.submodule_search_locations)))


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any((isinstance(d, ast.Name) and d.id == "dataclass")
               or (isinstance(d, ast.Call) and getattr(d.func, "id", None) == "dataclass")
               for d in node.decorator_list)  # fmt: skip


class Module:
    """The dataclasses of one ``job_config.py`` and the names it imports from the main one."""

    def __init__(self, path: Path, main: Module | None = None) -> None:
        tree = ast.parse(path.read_text("utf-8"))
        self.classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef) and _is_dataclass(n)}
        self.main = main
        self.imported: dict[str, str] = {}  # local name -> class name in the main module
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module == MAIN:
                self.imported |= {(a.asname or a.name): a.name for a in node.names}

    def resolve(self, name: str) -> tuple[Module, ast.ClassDef] | None:
        if name in self.classes:
            return self, self.classes[name]
        if self.main is not None and name in self.imported:
            return self.main.resolve(self.imported[name])
        return None

    def fields(self, cls: ast.ClassDef) -> dict[str, tuple[ast.expr, ast.expr | None]]:
        """A dataclass's fields, its bases' first (a subclass redefines a field in place)."""
        out: dict[str, tuple[ast.expr, ast.expr | None]] = {}
        for base in cls.bases:
            found = self.resolve(base.id) if isinstance(base, ast.Name) else None
            if found:
                out |= found[0].fields(found[1])
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                out[stmt.target.id] = (stmt.annotation, stmt.value)
        return out


def _default(value: ast.expr | None) -> Any:
    """A field's default as JSON, or _NO_DEFAULT (a nested dataclass, ``default_factory=X``, is the caller's)."""
    if value is None:
        return _NO_DEFAULT
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
        for kw in value.keywords:
            if kw.arg == "default":
                return _default(kw.value)
            if kw.arg == "default_factory":
                factory = kw.value
                if isinstance(factory, ast.Lambda):
                    return _default(factory.body)
                if isinstance(factory, ast.Name) and factory.id in ("list", "dict"):
                    return [] if factory.id == "list" else {}
                return {"expression": ast.unparse(factory) + "()"}
        return _NO_DEFAULT
    try:
        return ast.literal_eval(value)
    except ValueError:
        return {"expression": ast.unparse(value)}


def _choices(annotation: ast.expr) -> list | None:
    """The values of a ``Literal[...]`` annotation (also inside ``Literal[...] | None``)."""
    for node in ast.walk(annotation):
        if isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "Literal":
            items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            return [ast.literal_eval(item) for item in items]
    return None


def _nested(module: Module, annotation: ast.expr) -> tuple[Module, ast.ClassDef] | None:
    return module.resolve(annotation.id) if isinstance(annotation, ast.Name) else None


def sections(module: Module, cls: ast.ClassDef, prefix: str = "") -> dict[str, dict]:
    """``{"section.sub": {key: entry}}`` for a dataclass whose fields are sections (JobConfig) or keys."""
    out: dict[str, dict] = {}
    for name, (annotation, value) in module.fields(cls).items():
        nested = _nested(module, annotation)
        path = f"{prefix}{name}"
        if nested:
            out[path] = {}
            for sub, entries in sections(*nested, prefix=f"{path}.").items():
                out[sub] = entries
            continue
        section, key = path.rsplit(".", 1) if "." in path else ("", path)
        entry: dict[str, Any] = {"type": ast.unparse(annotation)}
        default = _default(value)
        if default is not _NO_DEFAULT:
            entry["default"] = default
        choices = _choices(annotation)
        if choices is not None:
            entry["choices"] = choices
        out.setdefault(section, {})[key] = entry
    return out


def _clean(table: dict[str, dict]) -> dict[str, dict]:
    return {name: dict(sorted(keys.items())) for name, keys in sorted(table.items())}


def build() -> dict:
    """The whole table."""
    root = package_dir("torchtitan")
    main = Module(root / "config" / "job_config.py")
    extensions = {}
    for path in sorted(root.rglob("job_config.py")):
        dotted = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        if dotted == MAIN:
            continue
        module = Module(path, main)
        if "JobConfig" in module.classes:
            extensions[dotted] = _clean(sections(module, module.classes["JobConfig"]))
    aliases = {}  # a package whose __init__ re-exports an extension's JobConfig: custom_config_module may name it
    for init in sorted(root.rglob("__init__.py")):
        package = ".".join(init.parent.relative_to(root.parent).parts)
        for node in ast.parse(init.read_text("utf-8")).body:
            if isinstance(node, ast.ImportFrom) and any(a.name == "JobConfig" for a in node.names):
                source = f"{package}.{node.module}" if node.level == 1 else node.module
                if source in extensions:
                    aliases[package] = source
    return {
        "framework": "torchtitan",
        "version": importlib.metadata.version("torchtitan"),
        "description": "Sections and keys of a torchtitan job-config TOML (--job.config_file), generated from "
        "torchtitan's source by schemas/_generate_torchtitan_keys.py. torchtitan refuses a key its JobConfig "
        "does not define. extensions: the JobConfig of each module a file may name in [job] "
        "custom_config_module, merged into the base one section by section. A nested section is dotted "
        "(training.dataloader is [training.dataloader]).",
        "sections": _clean(sections(main, main.classes["JobConfig"])),
        "extensions": extensions,
        "extension_aliases": aliases,
    }


def render(table: dict) -> str:
    """The canonical text of a key table file."""
    return json.dumps(table, indent=2) + "\n"


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("keys") / "torchtitan.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(render(build()), encoding="utf-8")
    print(f"wrote {out}")
