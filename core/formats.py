"""Reading and writing config files as plain data: JSON (and DeepSpeed's hjson), YAML (safe loading), TOML.

Only turns text into dicts and back; validation is the model's job. Duplicate keys are rejected in every
format (DeepSpeed rejects them in its hjson loader; silently keeping the last one loses a setting).

Input is bounded, because a config file may come from anywhere (a downloaded recipe, a model repository):
only regular files are read (a FIFO or a device would block or never end), at most :data:`MAX_BYTES`, nested at
most :data:`MAX_DEPTH` levels (deeper input exhausts the parsers' recursion), YAML aliases may not expand the
document past :data:`MAX_ALIAS_NODES` nodes (a one-kilobyte "billion laughs" file would take gigabytes), and JSON
numbers must be finite (``NaN``/``Infinity`` are not JSON; ``1e400`` overflows to infinity).
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import MISSING, ConfigError, Problem

FORMATS = ("json", "yaml", "toml")
_SUFFIXES = {".json": "json", ".hjson": "json", ".yaml": "yaml", ".yml": "yaml", ".toml": "toml"}
#: Suffixes of shell scripts (an sbatch script, a launch line in a file): read as text, for the launch dialect.
SHELL_SUFFIXES = (".sh", ".bash", ".sbatch", ".slurm")

#: Largest config file read, in bytes (the largest real config in the corpus is ~20 KB).
MAX_BYTES = 10 * 1024 * 1024
#: Deepest nesting of mappings and lists accepted (real configs nest fewer than 10 levels).
MAX_DEPTH = 64
#: Most nodes a YAML document may have once its aliases are expanded, when it uses aliases.
MAX_ALIAS_NODES = 100_000

_HJSON_NOTE = ("accepted as hjson (comments, trailing commas or unquoted text), as DeepSpeed reads it; a plain "
               "JSON loader (json.load, e.g. in transformers' HfDeepSpeedConfig) rejects this file")


@dataclass
class Document:
    """A parsed config file: its data, its format and what a reader of the file should know about its syntax."""

    data: Any
    format: str
    notes: list[str] = field(default_factory=list)
    """Syntax remarks (e.g. JSON accepted only as hjson)."""


def format_for(path: str | os.PathLike[str]) -> str | None:
    """The format implied by a file suffix, or None."""
    return _SUFFIXES.get(Path(path).suffix.lower())


def load_file(path: str | os.PathLike[str]) -> tuple[Any, str]:
    """Parse a config file; returns ``(data, format)``. Errors name the file, line and what to do."""
    document = load_document(path)
    return document.data, document.format


def load_document(path: str | os.PathLike[str]) -> Document:
    """Parse a config file into a :class:`Document` (data, format, syntax notes); errors are ConfigErrors."""
    path = Path(path)
    text = read_text(path)
    fmt = format_for(path)
    notes: list[str] = []
    if fmt is None and (path.suffix.lower() in SHELL_SUFFIXES or text.startswith("#!")):
        return Document(text, "shell", notes)  # the launch dialect reads the commands and #SBATCH directives
    try:
        if fmt:
            data = _parse(text, fmt, notes)
        else:
            data, fmt = _parse_any(text, notes)
    except ConfigError as exc:
        raise exc.with_source(str(path)) from None
    return Document(data, fmt, notes)


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))  # fmt: skip


def read_text(path: str | os.PathLike[str], *, what: str = "config file", limit: int = MAX_BYTES) -> str:
    """The UTF-8 text of a regular file of at most ``limit`` bytes; anything else is a ConfigError.

    The kind of file is checked before opening and again on the open descriptor (opened non-blocking, so even a
    FIFO swapped in between never blocks), and at most ``limit + 1`` bytes are ever read.
    """
    path = Path(path)
    source = str(path)

    def fail(reason: str) -> ConfigError:
        return ConfigError([Problem("", source, reason)], source=source)

    try:
        _check_regular(os.stat(path), fail, what)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise fail("no such file; check the path") from None
    except OSError as exc:
        raise fail(f"cannot be read ({_os_reason(exc)})") from None
    try:
        _check_regular(os.fstat(fd), fail, what)
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise fail(f"cannot be read ({_os_reason(exc)})") from None
    finally:
        os.close(fd)
    if size > limit:
        raise fail(f"is larger than the {_mib(limit)} limit for a {what}; is this the right file?")
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise fail(f"cannot be read as UTF-8 text ({exc})") from None


def is_regular_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a regular file; False (not an OSError) for a name the OS refuses, such as one longer
    than the filesystem allows (``Path.is_file`` raises on that)."""
    try:
        return stat.S_ISREG(os.stat(os.path.expanduser(path)).st_mode)
    except (OSError, ValueError):  # ValueError: an embedded NUL
        return False


def _check_regular(info: os.stat_result, fail: Any, what: str) -> None:
    if stat.S_ISREG(info.st_mode):
        if info.st_size > MAX_BYTES and what == "config file":
            raise fail(f"is larger than the {_mib(MAX_BYTES)} limit for a {what} ({info.st_size} bytes); "
                       "is this the right file?")  # fmt: skip
        return
    kind = next((name for test, name in _FILE_KINDS if test(info.st_mode)), "not a regular file")
    hint = f"; give a {what}" if kind == "a directory" else f"; only regular files are read as a {what}"
    raise fail(f"is {kind}{hint}")


def _os_reason(exc: OSError) -> str:
    return exc.strerror or errno.errorcode.get(exc.errno or 0, type(exc).__name__)


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):g} MiB" if n >= 1024 * 1024 else f"{n} bytes"


def parse_text(text: str, fmt: str) -> Any:
    """Parse text in one format; a syntax error or a broken limit becomes a ConfigError (line and column)."""
    return _parse(text, fmt, [])


def _parse(text: str, fmt: str, notes: list[str]) -> Any:
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    if len(text) > MAX_BYTES:
        raise InputLimitError([Problem("", f"{len(text)} characters", f"larger than the {_mib(MAX_BYTES)} limit")])
    try:
        if fmt == "json":
            data = _load_json(text, notes)
        elif fmt == "yaml":
            data = _load_yaml(text)
        else:
            data = _load_toml(text)
    except _DuplicateKey as exc:
        raise ConfigError([Problem(exc.key, exc.value, "duplicate key: the file sets it twice; keep one")]) from None
    except ConfigError:
        raise
    except RecursionError:
        raise _too_deep() from None
    except MemoryError:
        raise InputLimitError([Problem("", MISSING, f"not valid {fmt.upper()}: too large to parse")]) from None
    except Exception as exc:  # each parser has its own error type; all mean "not valid <fmt>"
        raise _syntax_error(exc, fmt, text) from None
    check_depth(data)
    return data


def _parse_any(text: str, notes: list[str]) -> tuple[Any, str]:
    errors = []
    for fmt in FORMATS:
        try:
            return _parse(text, fmt, notes), fmt
        except ConfigError as exc:
            if _is_limit(exc):  # the syntax was recognised; another format would only hide the real reason
                raise
            errors.append(str(exc.problems[0]))
    raise ConfigError([Problem("", MISSING, "not valid JSON, YAML or TOML: " + " | ".join(errors))])


class InputLimitError(ConfigError):
    """The input breaks one of the limits (depth, alias expansion, size): no other format is tried."""


def _is_limit(exc: ConfigError) -> bool:
    return isinstance(exc, InputLimitError)


def _too_deep() -> InputLimitError:
    return InputLimitError([Problem("", MISSING, f"nested more than {MAX_DEPTH} levels deep (the limit); a config "
                                    "never is")])  # fmt: skip


def check_depth(data: Any, limit: int = MAX_DEPTH) -> None:
    """Refuse data nested more than ``limit`` levels of mappings and lists (walked without recursion)."""
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        if depth >= limit:
            raise _too_deep()
        stack.extend((child, depth + 1) for child in children)


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


def null_paths(data: Any, prefix: str = "") -> list[str]:
    """The dotted paths of the None values in ``data`` (list items as ``[i]``): what TOML output leaves out."""
    if isinstance(data, dict):
        return [p for k, v in data.items() for p in null_paths(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(data, list):
        return [p for i, v in enumerate(data) for p in null_paths(v, f"{prefix}[{i}]")]
    return [prefix] if data is None else []


def _drop_none(data: Any) -> Any:
    """TOML has no null: drop None values (None means "default" throughout the core model; the writer's report says
    which keys were left out, :func:`null_paths`)."""
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


class _NotJsonNumber(Exception):
    pass


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotJsonNumber(f"the number {text} is too large for a float (it would be infinity)")
    return value


def _no_constant(name: str) -> Any:
    raise _NotJsonNumber(f"{name} is not JSON (write a number, or null)")


def _load_json(text: str, notes: list[str] | None = None) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_float=_finite_float,
                          parse_constant=_no_constant)  # fmt: skip
    except json.JSONDecodeError as strict_error:
        # DeepSpeed reads configs with hjson: comments and trailing commas are allowed there.
        import hjson

        try:
            data = _plain(hjson.loads(text, object_pairs_hook=_no_duplicates, parse_float=_finite_float))
        except (_DuplicateKey, _NotJsonNumber, RecursionError, ConfigError):
            raise
        except Exception:
            raise strict_error from None
        if notes is not None:
            notes.append(f"{_HJSON_NOTE} (first error for plain JSON: {strict_error})")
        return data


def _plain(value: Any) -> Any:
    check_depth(value)  # before the recursion below
    return _plain_unchecked(value)


def _plain_unchecked(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain_unchecked(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_unchecked(v) for v in value]
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
        # Keys merged in with ``<<: *base`` may be overridden (that is what merging is for); keys written in
        # the mapping itself may not repeat. flatten_mapping puts the merged pairs before the written ones.
        written = sum(1 for key, _ in node.value if key.tag != "tag:yaml.org,2002:merge")
        loader.flatten_mapping(node)
        pairs = [(loader.construct_object(k, deep=deep), loader.construct_object(v, deep=deep)) for k, v in node.value]
        for (key, _), (key_node, _) in zip(pairs, node.value):
            if not isinstance(key, str):  # every dialect's keys are names; YAML reads `1:`, `yes:` or `~:` otherwise
                line = key_node.start_mark.line + 1
                raise ConfigError([Problem(str(key), key, f"line {line}: a key must be text, not a "
                                           f"{type(key).__name__}; quote it if it is meant as a name")])  # fmt: skip
        split = len(pairs) - written
        merged = dict(pairs[:split])
        own = _no_duplicates(pairs[split:])
        return {**merged, **own}

    def get_single_node(loader: yaml.SafeLoader) -> Any:
        node = yaml.SafeLoader.get_single_node(loader)
        if node is not None:
            _check_yaml_graph(node)  # before anything is constructed from it
        return node

    depth = [0]

    def compose_node(loader: yaml.SafeLoader, parent: Any, index: Any) -> Any:
        # Stop composing a runaway nesting early: PyYAML's scanner slows quadratically with the flow depth and
        # its composer recurses per level. The exact depth is checked on the composed graph.
        depth[0] += 1
        try:
            if depth[0] > MAX_DEPTH + 1:
                raise _too_deep()
            return yaml.SafeLoader.compose_node(loader, parent, index)
        finally:
            depth[0] -= 1

    UniqueKeyLoader.get_single_node = get_single_node  # type: ignore[method-assign]
    UniqueKeyLoader.compose_node = compose_node  # type: ignore[method-assign]
    UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def _check_yaml_graph(root: Any) -> None:
    """Refuse a composed YAML node graph that is cyclic, too deep, or whose aliases expand it too far.

    An alias is the same node object reached twice, so the graph is walked once (post-order, without recursion)
    and each node's expanded size and depth are computed from its children's: the counts a construction and
    every later walk over the data would see, known before anything is built.
    """
    import yaml

    def children(node: Any) -> list[Any]:
        if isinstance(node, yaml.MappingNode):
            return [n for pair in node.value for n in pair]
        if isinstance(node, yaml.SequenceNode):
            return list(node.value)
        return []

    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            kids = children(node)
            size[key] = 1 + sum(size[id(k)] for k in kids)
            depth[key] = 1 + max((depth[id(k)] for k in kids), default=0) if kids else 0
            on_path.discard(key)
            if depth[key] > MAX_DEPTH:
                raise _too_deep()
            continue
        if key in size:
            continue
        if key in on_path:
            raise InputLimitError([Problem("", MISSING, "an alias refers to a node that contains it (a recursive "
                                           "structure); a config cannot be infinite")])  # fmt: skip
        on_path.add(key)
        stack.append((node, True))
        stack.extend((kid, False) for kid in children(node) if id(kid) not in size)
    unique = len(size)
    expanded = size[id(root)]
    if expanded > unique and expanded > MAX_ALIAS_NODES:
        raise InputLimitError([Problem("", MISSING, f"aliases (*name) expand this document to {expanded:,} nodes, "
                                       f"over the limit of {MAX_ALIAS_NODES:,}; write the repeated parts out or "
                                       "share fewer of them")])  # fmt: skip


def _syntax_error(exc: Exception, fmt: str, text: str) -> ConfigError:
    """A parser's exception as a ConfigError naming the line, the column and the parser's own problem."""
    reason, line, column = _where(exc, text)
    return ConfigError([Problem("", MISSING, f"not valid {fmt.upper()}: {reason}", line=line, column=column)])


def _where(exc: Exception, doc: str) -> tuple[str, int | None, int | None]:
    """(the problem in words, line, column) from a JSON, hjson, YAML or TOML parser's exception (1-based)."""
    import re

    mark = getattr(exc, "problem_mark", None)
    if mark is not None:  # PyYAML: "while parsing a flow sequence" + "expected ',' or ']', but got '<stream end>'"
        parts = [str(part) for part in (getattr(exc, "context", None), getattr(exc, "problem", None)) if part]
        return ": ".join(parts) or type(exc).__name__, mark.line + 1, mark.column + 1
    if isinstance(getattr(exc, "lineno", None), int) and isinstance(getattr(exc, "colno", None), int):
        return str(getattr(exc, "msg", "")) or _first_line(exc), exc.lineno, exc.colno  # type: ignore[attr-defined]
    text = _first_line(exc)
    found = re.search(r"\s*\(?at line (\d+), column (\d+)\)?", text)  # tomllib before Python 3.14
    if found:
        return text[: found.start()] + text[found.end():], int(found.group(1)), int(found.group(2))
    found = re.search(r"\s*\(?at end of document\)?", text)
    if found:  # tomllib names no position here: the end of the text is where it stopped
        last = doc.split("\n")
        return text[: found.start()] + " at the end of the file", len(last), len(last[-1]) + 1
    return text, None, None


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
