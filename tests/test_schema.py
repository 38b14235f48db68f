"""The checked-in schemas: the native one equals what the model generates; every schema is valid JSON Schema."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from torsh import schemas

SCHEMA_DIR = Path(schemas.__file__).parent


def test_torsh_schema_is_in_sync_with_the_model():
    expected = schemas.render(schemas.generate_torsh_schema())
    actual = (SCHEMA_DIR / "torsh.schema.json").read_text(encoding="utf-8")
    assert actual == expected, "schemas/torsh.schema.json is stale: regenerate it with `make schemas` " \
                               "(python -m torsh.schemas) and commit the result"


@pytest.mark.parametrize("dialect", schemas.available())
def test_schema_files_are_valid_json_schema(dialect):
    schema = json.loads((SCHEMA_DIR / f"{dialect}.schema.json").read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)


def test_torsh_schema_describes_every_field_and_accepts_auto():
    schema = schemas.load("torsh")
    batch = schema["$defs"]["BatchConfig"]["properties"]["micro_batch_size"]
    assert batch["description"].startswith("Samples per rank")
    assert {"const": "auto"}.items() <= next(a for a in batch["anyOf"] if "const" in a).items()
    assert schemas.check({"batch": {"micro_batch_size": "auto"}}, "torsh") == []
    bad = schemas.check({"batch": {"micro_batch_size": 0}, "shardin": {}}, "torsh")
    assert {p.path for p in bad} == {"", "batch.micro_batch_size"}
