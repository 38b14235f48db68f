"""MkDocs hook: the reference pages are generated at build time, never written by hand.

A page holding one of the markers below gets it replaced by text generated from the code:

* ``<!-- generated: cli-reference -->``: every ``torsh-migrate`` sub-command, its usage and options, read from
  the argparse parser the command line itself builds (``torsh.cli.build_parser``);
* ``<!-- generated: config-reference -->``: every section and key of the native config, read from the JSON
  Schema the core model generates (``torsh.schemas.load("torsh")``, kept equal to the model by a test).

A marker left unreplaced or a parser without sub-commands fails the build rather than publishing a stale page.
"""

from __future__ import annotations

import argparse
import html
import json
import os
from typing import Any

CLI_MARKER = "<!-- generated: cli-reference -->"
CONFIG_MARKER = "<!-- generated: config-reference -->"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:  # noqa: ARG001 - MkDocs' signature
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    if CONFIG_MARKER in markdown:
        markdown = markdown.replace(CONFIG_MARKER, config_reference())
    return markdown


# ---- the command line ------------------------------------------------------------------------------------------


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The sub-parsers of ``parser`` by name, in the order ``--help`` lists them."""
    for action in parser._actions:  # noqa: SLF001 - argparse has no public accessor for its sub-parsers
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return dict(action.choices)
    return {}


def cli_reference() -> str:
    from torsh.cli import build_parser

    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps usage lines to the terminal: the same page on every machine
    try:
        parser = build_parser()
        return _cli_reference(parser)
    finally:
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous


def _cli_reference(parser: argparse.ArgumentParser) -> str:
    commands = subcommands(parser)
    if not commands:
        raise RuntimeError("torsh-migrate's parser has no sub-commands: the CLI reference would be empty")
    out = [f"`{parser.prog}`: {cell(parser.description or '')}", "", "| command | what it does |", "|---|---|"]
    help_of = {a.dest: a.help for a in _choices_actions(parser)}
    out += [f"| [`{name}`](#{anchor(name)}) | {cell(help_of.get(name) or '')} |" for name in commands]
    out.append("")
    out += _options_section(parser, "Options of every invocation", level=3)
    for name, sub in commands.items():
        out += [f"## `{parser.prog} {name}` {{#{anchor(name)}}}", ""]
        if sub.description or help_of.get(name):
            out += [cell(sub.description or help_of.get(name) or ""), ""]
        out += ["```text", sub.format_usage().strip(), "```", ""]
        out += _options_section(sub, "Arguments and options", level=3)
    return "\n".join(out) + "\n"


def anchor(name: str) -> str:
    return f"cli-{name}"


def _choices_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return list(action._choices_actions)  # noqa: SLF001
    return []


def _options_section(parser: argparse.ArgumentParser, title: str, level: int) -> list[str]:
    rows = []
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action, (argparse._SubParsersAction, argparse._HelpAction)):  # noqa: SLF001
            continue
        if action.help == argparse.SUPPRESS:
            continue
        name = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}`"
        value = _value_of(action)
        default = ""
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS) and action.nargs != 0:
            default = f"`{action.default}`"
        help_text = (action.help or "").replace("%(default)s", str(action.default)).replace("%(prog)s", parser.prog)
        rows.append(f"| {name} | {value} | {default} | {cell(help_text)} |")
    if not rows:
        return []
    return [f"{'#' * level} {title}", "", "| argument | value | default | meaning |", "|---|---|---|---|", *rows, ""]


def _value_of(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "(flag)"
    if action.choices:
        return " \\| ".join(f"`{c}`" for c in action.choices)
    metavar = action.metavar or (action.dest.upper() if action.option_strings else "")
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    nargs = action.nargs if isinstance(action.nargs, str) else None
    suffix = {"*": " ...", "+": " ...", "?": " (optional)"}.get(nargs, "")
    return f"`{metavar}`{suffix}" if metavar else suffix.strip()


def cell(text: str) -> str:
    """Text made safe for one Markdown table cell (no pipes, no line breaks, no stray HTML)."""
    return html.escape(" ".join(str(text).split()), quote=False).replace("|", "\\|")


# ---- the config model ------------------------------------------------------------------------------------------


def config_reference() -> str:
    from torsh.schemas import load

    schema = load("torsh")
    if not schema or not schema.get("properties"):
        raise RuntimeError("the native config schema (torsh.schema.json) has no sections")
    defs = schema.get("$defs", {})
    out = [cell(schema.get("description", "")), ""]
    out += ["| section | what it holds |", "|---|---|"]
    out += [f"| [`{name}`](#config-{name}) | {cell(_first_line(prop.get('description', '')))} |"
            for name, prop in schema["properties"].items()]
    out.append("")
    for name, prop in schema["properties"].items():
        out += [f"## `{name}` {{#config-{name}}}", "", cell(prop.get("description", "")), ""]
        target = _resolve(prop, defs)
        variants = _variants(prop, defs)
        if target is not None and target.get("properties"):
            out += _table(target, name, defs)
        elif variants:
            out += ["One of:", ""]
            for title, variant in variants:
                out += [f"### `{name}`: {title}", "", cell(variant.get("description", "")), ""]
                out += _table(variant, name, defs)
        else:
            out += [f"Type: {_type(prop, defs)}; default: {_default(prop)}.", ""]
    return "\n".join(out) + "\n"


def _first_line(text: str) -> str:
    return text.strip().split("\n")[0]


def _ref(schema: dict, defs: dict) -> dict | None:
    ref = schema.get("$ref")
    return defs.get(ref.rsplit("/", 1)[-1]) if isinstance(ref, str) else None


def _resolve(schema: dict, defs: dict) -> dict | None:
    """The object schema behind ``schema`` ($ref, or a nullable $ref), if there is exactly one."""
    direct = _ref(schema, defs)
    if direct is not None:
        return direct
    options = [o for o in schema.get("anyOf", []) if o.get("type") != "null"]
    if len(options) == 1 and _ref(options[0], defs) is not None:
        return _ref(options[0], defs)
    return None


def _variants(schema: dict, defs: dict) -> list[tuple[str, dict]]:
    """The alternatives of a union of object schemas (the scheduler's kinds)."""
    found = []
    stack = [schema]
    while stack:
        node = stack.pop(0)
        for key in ("anyOf", "oneOf"):
            for option in node.get(key, []):
                target = _ref(option, defs)
                if target is not None:
                    found.append((target.get("title") or option["$ref"].rsplit("/", 1)[-1], target))
                elif key in option or "oneOf" in option or "anyOf" in option:
                    stack.append(option)
    return found


def _table(obj: dict, prefix: str, defs: dict) -> list[str]:
    rows: list[str] = []
    _rows(obj, prefix, defs, rows, depth=0)
    return ["| key | type | default | meaning |", "|---|---|---|---|", *rows, ""]


def _rows(obj: dict, prefix: str, defs: dict, rows: list[str], depth: int) -> None:
    for key, prop in obj.get("properties", {}).items():
        path = f"{prefix}.{key}"
        nested = _resolve(prop, defs)
        if nested is not None and nested.get("properties") and depth < 3:
            rows.append(f"| `{path}` | table | | {cell(prop.get('description') or nested.get('description', ''))} |")
            _rows(nested, path, defs, rows, depth + 1)
            continue
        default = "required" if key in obj.get("required", []) else _default(prop)
        rows.append(f"| `{path}` | {_type(prop, defs)} | {default} | {cell(prop.get('description', ''))} |")


def _type(schema: dict, defs: dict) -> str:
    target = _ref(schema, defs)
    if target is not None:
        if "enum" in target:
            return " \\| ".join(f"`{json.dumps(v)}`" for v in target["enum"])
        return f"{target.get('title', 'object')}"
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " or ".join(dict.fromkeys(_type(o, defs) for o in schema[key]))
    kind = schema.get("type", "any")
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind == "array" and "items" in schema:
        items = schema["items"]
        return f"list of {_type(items, defs)}" if isinstance(items, dict) else "list"
    bounds = []
    for word, sign in (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"), ("exclusiveMaximum", "<")):
        if word in schema:
            bounds.append(f"{sign} {schema[word]:g}" if isinstance(schema[word], float) else f"{sign} {schema[word]}")
    return kind + (f" ({', '.join(bounds)})" if bounds else "")


def _default(schema: dict) -> str:
    if "default" not in schema:
        return ""
    value = schema["default"]
    if isinstance(value, dict) and value:
        return "(see below)"
    return f"`{cell(json.dumps(value))}`"
