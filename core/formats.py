"""Reading and writing config files as plain data: JSON (and DeepSpeed's hjson), YAML (safe loading), TOML.

Only turns text into dicts and back; validation is the model's job. Duplicate keys are rejected in every
format (DeepSpeed rejects them in its hjson loader; silently keeping the last one loses a setting).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from .errors import ConfigError, Problem

FORMATS = ("json", "yaml", "toml")
_SUFFIXES = {".json": "json", ".hjson": "json", ".yaml": "yaml", ".yml": "yaml", ".toml": "toml"}


def format_for(path: str | os.PathLike[str]) -> str | None:
    """The format implied by a file suffix, or None."""
    return _SUFFIXES.get(Path(path).suffix.lower())


def load_file(path: str | os.PathLike[str]) -> tuple[Any, str]:
    """Parse a config file; returns ``(data, format)``. Errors name the file, line and what to do."""
    path = Path(path)
    if not path.exists():
        raise ConfigError([Problem("", str(path), "no such file; check the path")], source=str(path))
    if path.is_dir():
        raise ConfigError([Problem("", str(path), "is a directory; give a config file")], source=str(path))
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([Problem("", str(path), f"cannot be read as UTF-8 text ({exc})")], source=str(path)) from None
    fmt = format_for(path)
    try:
        return (parse_text(text, fmt), fmt) if fmt else _parse_any(text)
    except ConfigError as exc:
        raise exc.with_source(str(path)) from None


def parse_text(text: str, fmt: str) -> Any:
    """Parse text in one format; a syntax error becomes a ConfigError with its line and column."""
    try:
        if fmt == "json":
            return _load_json(text)
        if fmt == "yaml":
            return _load_yaml(text)
        if fmt == "toml":
            return _load_toml(text)
    except _DuplicateKey as exc:
        raise ConfigError([Problem(exc.key, exc.value, "duplicate key: the file sets it twice; keep one")]) from None
    except ConfigError:
        raise
    except Exception as exc:  # each parser has its own error type; all mean "not valid <fmt>"
        raise ConfigError([Problem("", None, f"not valid {fmt.upper()}: {_first_line(exc)}")]) from None
    raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")


def _parse_any(text: str) -> tuple[Any, str]:
    errors = []
    for fmt in FORMATS:
        try:
            return parse_text(text, fmt), fmt
        except ConfigError as exc:
            errors.append(str(exc.problems[0]))
    raise ConfigError([Problem("", None, "not valid JSON, YAML or TOML: " + " | ".join(errors))])


def dump_text(data: Any, fmt: str) -> str:
    """Serialise plain data (dicts, lists, scalars) in one format."""
    if fmt == "json":
        return json.dumps(data, indent=2) + "\n"
    if fmt == "yaml":
        import yaml

        return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    if fmt == "toml":
        import tomli_w

        return tomli_w.dumps(_drop_none(data))
    raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")


def _drop_none(data: Any) -> Any:
    """TOML has no null: drop None values (None means "default" throughout the core model)."""
    if isinstance(data, dict):
        return {k: _drop_none(v) for k, v in data.items() if v is not None}
    if isinstance(data, list):
        return [_drop_none(v) for v in data if v is not None]
    return data


class _DuplicateKey(Exception):
    def __init__(self, key: str, value: Any):
        self.key, self.value = key, value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key, value)
        out[key] = value
    return out


def _load_json(text: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as strict_error:
        # DeepSpeed reads configs with hjson: comments and trailing commas are allowed there.
        import hjson

        try:
            return _plain(hjson.loads(text, object_pairs_hook=_no_duplicates))
        except _DuplicateKey:
            raise
        except Exception:
            raise strict_error from None


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _load_toml(text: str) -> Any:
    # Imported here, like yaml and hjson: reading a JSON config or a dict never needs a TOML parser.
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib

    return tomllib.loads(text)


def _load_yaml(text: str) -> Any:
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        pass

    def construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
        loader.flatten_mapping(node)
        pairs = [(loader.construct_object(k, deep=deep), loader.construct_object(v, deep=deep)) for k, v in node.value]
        return _no_duplicates(pairs)

    UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
