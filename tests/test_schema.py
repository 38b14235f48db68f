"""The checked-in schemas: the native one equals what the model generates; every schema is valid JSON Schema;
the quick validity check (``schemas.conforms``) agrees with jsonschema."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


# ------------------------------------------------------------------------------------------------
# schemas.conforms: the check that lets a valid file skip jsonschema must never pass what jsonschema fails

ROOT = SCHEMA_DIR.parent
DIALECT_SCHEMAS = [d for d in schemas.available() if d != "torsh"]
CONFIG_FILES = sorted(p for folder in (ROOT / "tests" / "fixtures" / "corpus", ROOT / "migration_examples")
                      for p in folder.rglob("*") if p.suffix in (".json", ".yaml", ".toml", ".conf"))  # fmt: skip


def _jsonschema_valid(data, dialect: str) -> bool:
    return not any(jsonschema.Draft202012Validator(schemas.load(dialect)).iter_errors(data))


@functools.cache
def _parsed(path: Path):
    """The file's data (shared: copy before changing it), or None when torsh refuses to parse it (the corpus keeps a few real files that are
    refused on purpose, e.g. a YAML file that sets one key twice)."""
    from torsh.errors import ConfigError
    from torsh.formats import load_file, parse_text

    try:
        return parse_text(path.read_text("utf-8"), "json") if path.suffix == ".conf" else load_file(path)[0]
    except ConfigError:
        return None


@pytest.mark.parametrize("dialect", DIALECT_SCHEMAS)
def test_conforms_agrees_with_jsonschema_on_every_example_config(dialect):
    assert len(CONFIG_FILES) > 50
    verdicts = [(path.name, schemas.conforms(data, schemas.load(dialect)), _jsonschema_valid(data, dialect))
                for path in CONFIG_FILES for data in [_parsed(path)] if data is not None]  # fmt: skip
    assert [v for v in verdicts if v[1] != v[2]] == []
    if dialect != "launch":  # launch's schema uses oneOf, which conforms leaves to jsonschema
        assert any(ours for _, ours, _ in verdicts), "the fast path never applies"


def test_conforms_leaves_uncovered_keywords_and_value_types_to_jsonschema():
    assert not schemas.conforms({"a": 1}, {"$ref": "#/$defs/x"})
    assert not schemas.conforms(1, {"oneOf": [{"type": "integer"}]})
    from decimal import Decimal

    assert not schemas.conforms(Decimal(1), {"minimum": 0})
    assert schemas.conforms("x", {"minimum": 0, "description": "bounds apply to numbers only"})
    assert not schemas.conforms(True, {"const": 1}) and not schemas.conforms(1, {"enum": [True]})
    assert schemas.conforms(2.0, {"type": "integer"}) and not schemas.conforms(True, {"type": "number"})


def _subschemas(schema):
    """Every schema nested in a dialect schema (they are self-contained: no $ref)."""
    if not isinstance(schema, dict):
        return
    yield schema
    for sub in [*schema.get("properties", {}).values(), *schema.get("anyOf", []), schema.get("items"),
                schema.get("additionalProperties")]:  # fmt: skip
        yield from _subschemas(sub)


def _candidates(schema) -> list:
    """Values at and around every bound, enum member and constant of a schema, of every JSON type."""
    values = [None, True, False, 0, 1, -1, 1.0, 2.5, -0.5, "", "auto", "x", [], [1], [1, "a"], [1, 2, 3], {}, {"x": 1}]
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minItems", "maxItems"):
        if key in schema:
            b = schema[key]
            values += [b - 1, b - 0.5, b, b + 0.5, b + 1, float(b), [0] * max(0, int(b)), [0] * (int(b) + 1)]
    values += [*schema.get("enum", []), schema.get("const")]
    values += [s.upper() if isinstance(s, str) else s for s in schema.get("enum", [])]
    properties = list(schema.get("properties", {}))
    values += [{key: value} for key in properties[:40] for value in (None, "auto", 1, -1, 0.5, "x", [], {})]
    values += [{key: 1 for key in schema.get("required", [])}, {**dict.fromkeys(properties[:3], 1), "unknown": 1}]
    return values


@pytest.mark.parametrize("dialect", [d for d in DIALECT_SCHEMAS if d != "launch"])  # launch's oneOf: undecided
def test_conforms_agrees_with_jsonschema_on_every_keyword_of_every_subschema(dialect):
    checked = 0
    for sub in _subschemas(schemas.load(dialect)):
        validator = jsonschema.Draft202012Validator(sub)
        for value in _candidates(sub):
            assert schemas.conforms(value, sub) == (not any(validator.iter_errors(value))), (sub, value)
            checked += 1
    assert checked > 500


_SCALARS = (st.none() | st.booleans() | st.integers(-3, 10**9) | st.floats(-10.0, 1e9) | st.text(max_size=8)
            | st.sampled_from([-1, 0, 1, 2, -0.5, 0.0, 0.5, 1.0, 1.5, 65536, 2**31]))  # around the bounds
_JSON_VALUES = st.recursive(
    _SCALARS | st.sampled_from(["auto", "cpu", "none", "nvme", "fp16", "bf16", "fp32", "float32", "WarmupLR", "AdamW",
                                "", "parameters", "type:transformer", "mean", "sum", "warn", "fail", "ignore"]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=6,
)  # fmt: skip


def _paths(schema, prefix=()):
    """Every property path the schema names (where enums, bounds and strict sections live)."""
    for key, sub in (schema.get("properties") or {}).items():
        yield (*prefix, key)
        if isinstance(sub, dict):
            yield from _paths(sub, (*prefix, key))
            for option in sub.get("anyOf", []):
                yield from _paths(option, (*prefix, key))


@st.composite
def _mutated(draw, dialect: str):
    """An example config with a few values replaced or keys added, mostly at paths the schema names."""
    import copy

    readable = [p for p in CONFIG_FILES if _parsed(p) is not None]
    files = [p for p in readable if dialect in p.parts or dialect in p.name] or readable
    data = copy.deepcopy(_parsed(draw(st.sampled_from(files))))
    if not isinstance(data, dict):
        return data
    paths = sorted(set(_paths(schemas.load(dialect))))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths)) if draw(st.integers(0, 4)) else (draw(st.text(max_size=6)),)
        node = data
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[path[-1]] = draw(_JSON_VALUES)
    return data


@pytest.mark.parametrize("dialect", [d for d in DIALECT_SCHEMAS if d != "launch"])  # launch's oneOf: undecided
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_conforms_agrees_with_jsonschema_on_mutated_configs(dialect, data):
    config = data.draw(_mutated(dialect))
    assert schemas.conforms(config, schemas.load(dialect)) == _jsonschema_valid(config, dialect)



def test_an_anyof_error_comes_from_the_branch_the_value_fits():
    """-5 for a DeepSpeed size that is "auto" or an integer >= 0: the message is about the minimum, not "auto"."""
    problems = schemas.check({"train_batch_size": 8, "zero_optimization": {"zero_hpz_partition_size": -5}},
                             "deepspeed")  # fmt: skip
    assert [(p.path, p.reason) for p in problems] == [
        ("zero_optimization.zero_hpz_partition_size", "-5 is less than the minimum of 0")]
