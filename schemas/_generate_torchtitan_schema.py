"""Regenerate ``torchtitan.schema.json`` from ``keys/torchtitan.json`` (the key table generated from torchtitan's
source): each key's JSON type and choices, so a wrong type is refused before the map reads the file. Unknown keys are
left to the reader, which refuses them with a did-you-mean. ``python -m torsh.schemas._generate_torchtitan_schema``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
_SCALARS = {"bool": "boolean", "int": "integer", "float": "number", "str": "string", "None": "null"}


def key_schema(python_type: str) -> dict[str, Any]:
    """The JSON Schema of one key from its Python annotation (``int | None``, ``Literal['a', 'b']``, ``list[str]``)."""
    choices: list[Any] = []
    types: list[str] = []
    for part in (p.strip() for p in re.split(r"\|(?![^\[]*\])", python_type)):
        literal = re.fullmatch(r"Literal\[(.*)\]", part)
        if literal:
            choices += [json.loads(c.strip().replace("'", '"')) for c in literal.group(1).split(",")]
        elif part.startswith("list["):
            types.append("array")
        else:
            types.append(_SCALARS[part])
    if choices:
        return {"enum": choices + ([None] if "null" in types else [])}
    return {"type": types[0] if len(types) == 1 else sorted(set(types))}


def build() -> dict[str, Any]:
    table = json.loads((HERE / "keys" / "torchtitan.json").read_text("utf-8"))
    sections: dict[str, dict[str, Any]] = {}
    for spec in (table["sections"], *table["extensions"].values()):
        for section, keys in spec.items():
            sections.setdefault(section, {}).update({k: key_schema(v["type"]) for k, v in keys.items()})

    def nest(name: str) -> dict[str, Any]:
        children = {s.rsplit(".", 1)[1]: nest(s) for s in sections if s.rsplit(".", 1)[0] == name and "." in s}
        return {"type": "object", "properties": {**sections[name], **children}}

    top = {s: nest(s) for s in sections if "." not in s}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": f"torchtitan {table['version']} job config (TOML)",
            "description": "Generated from keys/torchtitan.json by _generate_torchtitan_schema.py; unknown keys are "
                           "the reader's to refuse.", "type": "object", "properties": top}  # fmt: skip


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    (HERE / "torchtitan.schema.json").write_text(render(build()), encoding="utf-8")
    print("wrote torchtitan.schema.json")
