"""Regenerate the schemas that are generated from code: ``python -m torsh.schemas``."""

from pathlib import Path

from torsh.schemas import generate_torsh_schema, render

target = Path(__file__).with_name("torsh.schema.json")
target.write_text(render(generate_torsh_schema()), encoding="utf-8")
print(f"wrote {target.name}")
