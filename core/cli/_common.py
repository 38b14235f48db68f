"""Helpers shared by the sub-commands: input options, reports, safe output."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

from torsh.errors import ConfigError, Problem
from torsh.translate import Translation


def add_from_option(parser: argparse.ArgumentParser) -> None:
    """``--from DIALECT``: the input's dialect when its content is not enough to tell."""
    parser.add_argument("--from", dest="dialect", metavar="DIALECT",
                        help="dialect of the input (default: detected from the content)")


def add_input_options(parser: argparse.ArgumentParser) -> None:
    """``--from`` and ``--report table|json``."""
    add_from_option(parser)
    parser.add_argument("--report", choices=["table", "json"], default="table",
                        help="report format (default: table)")


def print_report(translation: Translation[Any], style: str, stream: IO[str], *, title: str = "") -> None:
    """The translation report as a readable table or as JSON."""
    if style == "json":
        json.dump(translation.to_dict(), stream, indent=2)
        stream.write("\n")
        return
    counts = ", ".join(f"{n} {k}" for k, n in translation.counts().items() if n)
    summary = f"{len(translation.notes)} keys: {counts or 'none'}"
    title = title or f"{translation.source} -> {translation.target}"
    if not _is_terminal(stream):
        # Piped or redirected (scripts, CI logs): a plain table; rich (about a sixth of a cold
        # ``torsh-migrate`` run) is imported only for a terminal, where its colours help.
        stream.write(_plain_table(title, translation) + summary + "\n")
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(file=stream, width=max(100, _width(stream)), highlight=False, soft_wrap=False)
    table = Table(title=title, show_lines=False)
    for column in ("source key", "target", "value", "fidelity", "reason"):
        table.add_column(column, overflow="fold")
    for note in translation.notes:
        style_ = {"exact": "", "defaulted": "dim", "ignored": "dim", "deferred": "cyan"}.get(note.fidelity.value, "yellow")
        table.add_row(note.source_path, note.target_path or "-", _short(note.value), note.fidelity.value,
                      note.reason, style=style_)
    console.print(table)
    console.print(summary)


_COLUMNS = ("source key", "target", "value", "fidelity", "reason")


def _plain_table(title: str, translation: Translation[Any]) -> str:
    """The report as aligned plain-text columns (the reason column last and never cut)."""
    rows = [_COLUMNS] + [(n.source_path, n.target_path or "-", _short(n.value), n.fidelity.value, n.reason)
                         for n in translation.notes]  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS) - 1)]
    lines = [title]
    for k, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
        if k == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * len(_COLUMNS[-1]))
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def write_output(text: str, out: str | None, force: bool) -> None:
    """Write to stdout, or atomically to a file that must not exist unless ``force``."""
    if out is None or out == "-":
        sys.stdout.write(text)
        return
    path = Path(out)
    if path.exists() and not force:
        raise ConfigError([Problem("-o", out, "the output file exists; pass --force to overwrite it")])
    if path.parent and not path.parent.exists():
        raise ConfigError([Problem("-o", out, f"the directory {path.parent} does not exist")])
    fd, tmp = tempfile.mkstemp(dir=path.parent or ".", prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _short(value: Any, limit: int = 40) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value  # AUTO prints as "auto"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _width(stream: IO[str]) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 140
