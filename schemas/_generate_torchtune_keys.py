"""Regenerate ``keys/torchtune.json``: the recipe-config keys torchtune's distributed recipes read, from their source.

A maintenance tool for a torchtune version bump. It reads the installed recipes with ``ast`` and imports nothing
of torchtune (its imports need its training dependencies), so ``pip install --no-deps torchtune==0.6.1`` is
enough: ``python -m torsh.schemas._generate_torchtune_keys [OUT]`` (default: ``keys/torchtune.json`` next to this
file).

A torchtune recipe gets the whole YAML as ``cfg`` and reads what it needs: ``cfg.get("x", default)`` (optional, with
its default), ``cfg.x`` or ``cfg["x"]`` (required). A section handed to a helper method (``cfg_dataset=cfg.dataset``)
is followed into it (``dataset.packed``). A section passed to ``config.instantiate`` is a component: its
``_component_`` names a callable and every other key is that callable's argument, so its keys are open. torchtune
does not refuse a key no recipe reads; it ignores it.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import sys
from pathlib import Path
from typing import Any

from torsh.schemas._generate_torchtitan_keys import package_dir

#: Methods of an OmegaConf DictConfig, not keys, when read as ``cfg.<name>``.
_METHODS = {"get", "pop", "items", "keys", "values", "setdefault"}


def _definitions(root: Path) -> dict[str, ast.ClassDef | ast.FunctionDef]:
    """Module-level classes and functions of a package by name (a name defined twice is left out)."""
    found: dict[str, ast.ClassDef | ast.FunctionDef] = {}
    seen: set[str] = set()
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text("utf-8")).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                if node.name in seen:
                    found.pop(node.name, None)
                else:
                    found[node.name] = node
                seen.add(node.name)
    return found


def _string_constants(root: Path) -> dict[str, str]:
    """Module-level ``NAME = "text"`` constants of a package (``PROFILER_KEY = "profiler"``)."""
    found: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text("utf-8")).body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):  # fmt: skip
                found.setdefault(node.targets[0].id, node.value.value)
    return found


def _default(node: ast.expr | None) -> Any:
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except ValueError:
        return {"expression": ast.unparse(node)}


class Recipe:
    """The keys one recipe module reads from its config."""

    def __init__(self, path: Path, constants: dict[str, str]) -> None:
        self.tree = ast.parse(path.read_text("utf-8"))
        self.constants = constants
        self.keys: dict[str, dict] = {}
        self.params = self._section_params()

    def _name(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return self.constants.get(node.id)
        return None

    def path(self, node: ast.expr, scope: dict[str, str]) -> str | None:
        """The config path an expression reads (``cfg.optimizer`` -> "optimizer"), or None."""
        if isinstance(node, (ast.Name, ast.Attribute)) and ast.unparse(node) in scope:  # cfg, self._cfg
            return scope[ast.unparse(node)]
        if isinstance(node, ast.Attribute) and node.attr not in _METHODS:
            base = self.path(node.value, scope)
            return None if base is None else f"{base}.{node.attr}".lstrip(".")
        if isinstance(node, ast.Subscript):
            base, key = self.path(node.value, scope), self._name(node.slice)
            return None if base is None or key is None else f"{base}.{key}".lstrip(".")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and node.args):  # fmt: skip
            base, key = self.path(node.func.value, scope), self._name(node.args[0])
            return None if base is None or key is None else f"{base}.{key}".lstrip(".")
        return None

    def _section_params(self) -> dict[str, str]:
        """Parameters that receive a section: ``self._setup_data(cfg_dataset=cfg.dataset)`` -> cfg_dataset: dataset;
        a positional ``self._setup_profiler(cfg.get(PROFILER_KEY, None))`` is matched by position."""
        methods = {n.name: n for n in ast.walk(self.tree) if isinstance(n, ast.FunctionDef)}
        root = {"cfg": ""}
        params: dict[str, str] = {}
        for call in ast.walk(self.tree):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and call.func.attr in methods):  # fmt: skip
                continue
            target = methods[call.func.attr]
            names = [a.arg for a in target.args.args if a.arg != "self"]
            for i, arg in enumerate(call.args):
                section = self.path(arg, root)
                if section and i < len(names):
                    params[names[i]] = section
            for kw in call.keywords:
                section = self.path(kw.value, root)
                if section and kw.arg:
                    params[kw.arg] = section
        return params

    def read(self) -> dict[str, dict]:
        """Every key read, with its default when read with ``.get``."""
        for func in ast.walk(self.tree):
            if not isinstance(func, ast.FunctionDef):
                continue
            args = {a.arg for a in func.args.args}
            scope = {name: section for name, section in self.params.items() if name in args}
            if "cfg" in args:
                scope["cfg"] = ""
            if scope:
                self._visit(func, scope)
        return dict(sorted(self.keys.items()))

    def follow(self, library: dict[str, ast.ClassDef | ast.FunctionDef]) -> None:
        """Read the keys of torchtune classes and functions the recipe hands its whole config to
        (``CheckpointClient(cfg)`` reads ``cfg.checkpointer`` through ``self._cfg``)."""
        for call in ast.walk(self.tree):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in library):
                continue
            positions = [i for i, arg in enumerate(call.args) if isinstance(arg, ast.Name) and arg.id == "cfg"]
            keywords = [kw.arg for kw in call.keywords if isinstance(kw.value, ast.Name) and kw.value.id == "cfg"]
            if not positions and not keywords:
                continue
            target = library[call.func.id]
            init = target
            if isinstance(target, ast.ClassDef):
                init = next((n for n in target.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
            if init is None:
                continue
            names = [a.arg for a in init.args.args if a.arg != "self"]
            params = {names[i] for i in positions if i < len(names)} | set(keywords)
            scope = {name: "" for name in params}
            for node in ast.walk(init):  # self._cfg = cfg
                if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id in params
                        and isinstance(node.targets[0], ast.Attribute)):  # fmt: skip
                    scope[ast.unparse(node.targets[0])] = ""
            for func in [init] if init is target else [n for n in target.body if isinstance(n, ast.FunctionDef)]:
                self._visit(func, scope)

    def _entry(self, key: str) -> dict:
        return self.keys.setdefault(key, {})

    def _visit(self, func: ast.FunctionDef, scope: dict[str, str]) -> None:
        for node in ast.walk(func):
            if isinstance(node, ast.arg) or (isinstance(node, ast.Name) and node.id in scope):
                continue
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
                key = self.path(node, scope)
                if key:
                    entry = self._entry(key)
                    if "default" not in entry and not entry.get("required"):
                        entry["default"] = _default(node.args[1] if len(node.args) > 1 else None)
            elif isinstance(node, (ast.Attribute, ast.Subscript)) and not isinstance(node.ctx, ast.Store):
                key = self.path(node, scope)
                if key:
                    entry = self._entry(key)
                    entry.pop("default", None)
                    entry["required"] = True
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "instantiate" and node.args:
                key = self.path(node.args[0], scope)
                if key:
                    self._entry(key)["component"] = True


def recipe_files(root: Path) -> list[Path]:
    """torchtune's distributed recipes (``recipes/*distributed*.py`` and ``recipes/dev/*distributed*.py``)."""
    return sorted(p for p in root.rglob("*distributed*.py") if "configs" not in p.parts)


def build() -> dict:
    """The whole table."""
    root = package_dir("recipes")
    constants = _string_constants(package_dir("torchtune"))
    library = _definitions(package_dir("torchtune"))
    recipes = {}
    for path in recipe_files(root):
        name = "/".join(path.relative_to(root).with_suffix("").parts)
        recipe = Recipe(path, constants)
        recipe.follow(library)
        keys = recipe.read()
        for key in [k for k in keys if "." in k]:  # a key under a component section is that component's argument
            if keys.get(key.rsplit(".", 1)[0], {}).get("component"):
                keys[key]["component_argument"] = True
        recipes[name] = keys
    return {
        "framework": "torchtune",
        "version": importlib.metadata.version("torchtune"),
        "description": "Keys torchtune's distributed recipes read from their YAML config, per recipe, generated "
        "from the recipes' source by schemas/_generate_torchtune_keys.py. default: the recipe's cfg.get default "
        "(an optional key); required: read as cfg.x; component: passed to config.instantiate, so any key of it "
        "beside _component_ is the component's argument. torchtune ignores keys no recipe reads.",
        "recipes": recipes,
    }


def render(table: dict) -> str:
    """The canonical text of a key table file."""
    return json.dumps(table, indent=2) + "\n"


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("keys") / "torchtune.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(render(build()), encoding="utf-8")
    print(f"wrote {out}")
