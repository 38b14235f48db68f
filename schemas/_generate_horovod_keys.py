"""Regenerate ``keys/horovod.json``: the config-file keys, HOROVOD_* variables and horovodrun flags of Horovod 0.28.1,
from Horovod's own source.

Horovod 0.28.1 does not build against current torch, so it is never installed: this tool reads its source
distribution (``pip download --no-deps --no-binary :all: horovod==0.28.1 -d DIR``; ``make venv`` puts it in
``.venv/sdist/``) with ``tarfile`` and ``ast`` and runs none of it. ``python -m torsh.schemas._generate_horovod_keys
[SDIST]`` (default: ``sdist/horovod-0.28.1.tar.gz`` in the running environment).

From ``horovod/runner/common/util/config_parser.py``: each key ``set_args_from_config`` reads from the
``--config-file`` YAML (section, key, the horovodrun argument it sets) and the variable ``set_env_from_args`` exports
for that argument. From ``horovod/runner/launch.py``: every option ``parse_args`` gives the horovodrun parser, with its
destination.
"""

from __future__ import annotations

import ast
import json
import sys
import tarfile
from pathlib import Path
from typing import Any

VERSION = "0.28.1"
CONFIG_PARSER = f"horovod-{VERSION}/horovod/runner/common/util/config_parser.py"
LAUNCH = f"horovod-{VERSION}/horovod/runner/launch.py"


def default_sdist() -> Path:
    return Path(sys.prefix) / "sdist" / f"horovod-{VERSION}.tar.gz"


def _source(sdist: Path, member: str) -> ast.Module:
    with tarfile.open(sdist) as archive:
        handle = archive.extractfile(member)
        if handle is None:
            raise SystemExit(f"{member} is not a file in {sdist}")
        return ast.parse(handle.read().decode("utf-8"))


def _text(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _keyword(call: ast.Call, name: str) -> str | None:
    return next((_text(k.value) for k in call.keywords if k.arg == name), None)


def config_keys(tree: ast.Module) -> dict[str, dict[str, Any]]:
    """``section.key`` -> the horovodrun argument it sets and the variable horovodrun exports for that argument."""
    constants = {t.id: _text(n.value) for n in tree.body if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name) and _text(n.value)}  # fmt: skip
    sections: dict[str, str] = {}  # local variable -> the section it holds
    keys: dict[str, dict[str, Any]] = {}
    env: dict[str, str] = {}  # horovodrun argument -> variable
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            call = node.value
            if isinstance(call.func, ast.Attribute) and call.func.attr == "get" and getattr(call.func.value, "id",
                                                                                            None) == "config":
                sections[node.targets[0].id] = _text(call.args[0])  # type: ignore[attr-defined]
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
        if name == "_set_arg_from_config" and len(node.args) >= 4:
            key, section = _text(node.args[1]), sections.get(getattr(node.args[3], "id", ""))
            keys[f"{section}.{key}"] = {"argument": (_keyword(node, "arg_prefix") or "") + key}
        elif name == "get" and getattr(node.func.value, "id", None) in sections and _text(node.args[0]) == "enabled":
            section = sections[node.func.value.id]
            keys[f"{section}.enabled"] = {"argument": "autotune" if section == "autotune" else "no_stall_check"}
        elif name == "_add_arg_to_env" and isinstance(node.args[2], ast.Attribute):
            env[node.args[2].attr] = constants.get(getattr(node.args[1], "id", ""), "")
    for section in {s for s in sections.values() if s} - {k.split(".")[0] for k in keys}:  # read as a value, not a section
        keys[section] = {"argument": "use_gloo / use_mpi" if section == "controller" else section}
    for entry in keys.values():
        if entry["argument"] in env:
            entry["env"] = env[entry["argument"]]
    return dict(sorted(keys.items()))


def flags(tree: ast.Module) -> dict[str, str]:
    """Every horovodrun option string -> its destination (argparse's default destination when none is given)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            names = [t for t in map(_text, node.args) if t and t.startswith("-")]
            if not names:
                continue
            long = next((n for n in names if n.startswith("--")), names[0])
            dest = _keyword(node, "dest") or long.lstrip("-").replace("-", "_")
            out.update({n: dest for n in names})
    return dict(sorted(out.items()))


def build(sdist: Path | None = None) -> dict[str, Any]:
    sdist = sdist or default_sdist()
    if not sdist.exists():
        raise SystemExit(f"{sdist} is missing: pip download --no-deps --no-binary :all: horovod=={VERSION} -d "
                         f"{sdist.parent}")  # fmt: skip
    return {"framework": "horovod", "version": VERSION,
            "description": "Horovod's --config-file keys (section.key -> the horovodrun argument each sets and the "
                           "variable horovodrun exports for it) and horovodrun's options (-> destination), generated "
                           "from Horovod's source distribution by schemas/_generate_horovod_keys.py. horovodrun "
                           "passes over config keys it does not read.",
            "config_keys": config_keys(_source(sdist, CONFIG_PARSER)), "flags": flags(_source(sdist, LAUNCH))}  # fmt: skip


def render(table: dict[str, Any]) -> str:
    return json.dumps(table, indent=2) + "\n"


if __name__ == "__main__":
    target = Path(__file__).with_name("keys") / "horovod.json"
    target.write_text(render(build(Path(sys.argv[1]) if len(sys.argv) > 1 else None)), encoding="utf-8")
    print(f"wrote {target}")
