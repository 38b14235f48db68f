"""Helpers shared by the sub-commands: input options, reports, safe output."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import stat
import sys
import tempfile
from collections.abc import Sequence
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
    add_report_option(parser)


def add_report_option(parser: argparse.ArgumentParser, help: str = "report format (default: table)") -> None:
    """``--report table|json``: the one spelling, in every command, for how the report is printed."""
    parser.add_argument("--report", choices=["table", "json"], default="table", help=help)


class _DeprecatedAlias(argparse.Action):
    """A hidden old spelling of an option: stores into the new option's destination, with a note on stderr."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: str, **kwargs: Any):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:  # fmt: skip
        print(f"note: {option_string} is deprecated; use {self.new} (same meaning)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_deprecated_alias(parser: argparse.ArgumentParser, old: str, new: str, dest: str, **kwargs: Any) -> None:
    """Keep ``old`` working for scripts written before it was renamed ``new``; hidden from ``--help``."""
    parser.add_argument(old, dest=dest, action=_DeprecatedAlias, new=new, help=argparse.SUPPRESS,
                        default=argparse.SUPPRESS, **kwargs)  # fmt: skip


def print_report(translation: Translation[Any], style: str, stream: IO[str], *, title: str = "") -> None:
    """The translation report as a readable table or as JSON."""
    if style == "json":
        json.dump(translation.to_dict(), stream, indent=2)
        stream.write("\n")
        return
    stream.write(report_table(translation, title, stream))


def report_table(translation: Translation[Any], title: str, stream: IO[str]) -> str:
    """The report's table (one row per source key) and its summary line, for ``stream``'s width."""
    counts = ", ".join(f"{n} {k}" for k, n in translation.counts().items() if n)
    summary = f"{len(translation.notes)} keys: {counts or 'none'}"
    title = title or f"{translation.source} -> {translation.target}"
    rows = [(n.source_path, n.target_path or "-", _short(n.value), n.fidelity.value, n.reason)
            for n in translation.notes]  # fmt: skip
    return render_table(title, _COLUMNS, rows, terminal_width(stream)) + summary + "\n"


_COLUMNS = ("source key", "target", "value", "fidelity", "reason")
#: Narrowest last column worth a column layout; below it, each row is printed as a block.
_MIN_LAST = 24


def render_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], width: int | None) -> str:
    """Rows as plain text: aligned columns with the last one wrapped at word boundaries to ``width``.

    ``width`` None (a pipe or a file) never wraps, so every row stays on one line for grep and diff. When the other
    columns leave less than a readable last column, each row becomes a block: its first cell, then ``column: cell``
    lines. Words are never cut; a dotted key or a path longer than the line is broken after a ``.`` or ``/``.
    """
    rows = [tuple(str(c) for c in row) for row in rows]
    table = [tuple(columns), *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns) - 1)]
    indent = sum(widths) + 2 * len(widths)
    lines = fit(title, width) if title else []
    if width is not None and width - indent < _MIN_LAST:
        for row in rows:
            lines += fit(row[0], width)
            for name, cell in zip(columns[1:], row[1:]):
                label = f"    {name}: "
                wrapped = fit(cell, width - len(label))
                if max(map(len, wrapped)) > width - len(label):  # a long key: on its own lines under the label
                    lines.append(label.rstrip())
                    lines += ["      " + part for part in fit(cell, width - 6)]
                    continue
                lines.append(label + wrapped[0])
                lines += [" " * len(label) + more for more in wrapped[1:]]
        return "\n".join(line.rstrip() for line in lines) + "\n"
    for k, row in enumerate(table):
        head = "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  "
        last = [row[-1]] if width is None else fit(row[-1], width - indent)
        lines.append(head + last[0])
        lines += [" " * indent + more for more in last[1:]]
        if k == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * len(columns[-1]))
    return "\n".join(line.rstrip() for line in lines) + "\n"


def fit(text: str, width: int | None) -> list[str]:
    """``text`` as lines of at most ``width`` characters (None: one line), broken at spaces, then after ``.``/``/``
    inside a word too long for a line; never inside a name."""
    import re
    import textwrap

    if width is None or len(text) <= width:
        return [text]
    width = max(width, 8)
    out: list[str] = []
    for line in textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False) or [""]:
        while len(line) > width:
            cuts = [m.end() for m in re.finditer(r"[./]", line[: width + 1]) if m.end() <= width]
            cut = cuts[-1] if cuts else width
            out.append(line[:cut])
            line = line[cut:]
        out.append(line)
    return out


def echo(text: str, stream: IO[str] | None = None, *, indent: str = "") -> None:
    """Print prose: wrapped to the terminal's width on a terminal (continuation lines indented), as is elsewhere."""
    stream = stream or sys.stdout
    width = terminal_width(stream)
    lines = fit(text, None if width is None else width - len(indent))
    stream.write("\n".join([lines[0], *(indent + line for line in lines[1:])]) + "\n")


def terminal_width(stream: IO[str]) -> int | None:
    """The width to wrap at: the terminal's (``COLUMNS`` first), or None when ``stream`` is not a terminal."""
    if not _is_terminal(stream):
        return None
    try:
        columns = int(os.environ.get("COLUMNS", ""))
        if columns > 0:
            return columns
    except ValueError:
        pass
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80
    except (OSError, ValueError, AttributeError):
        return 80


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def write_output(text: str, out: str | None, force: bool) -> None:
    """Write to stdout, or atomically to a file that must not exist unless ``force``.

    The file is written to a temporary file next to it and renamed over it, so a reader never sees half a file;
    the temporary file is removed on any error and on SIGTERM/SIGHUP (the signal is then re-raised). The new file
    gets the mode ``open()`` would give it (0666 less the umask); with ``--force`` an existing file keeps its mode.
    A character device or FIFO (``-o /dev/stdout``) is written to directly.
    """
    if out is None or out == "-":
        sys.stdout.write(text)
        return
    path = Path(out)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        info = None
    except OSError as exc:
        raise ConfigError([Problem("-o", out, f"cannot be written ({exc.strerror})")]) from None
    if info is not None and stat.S_ISDIR(info.st_mode):
        raise ConfigError([Problem("-o", out, "is a directory; give a file name (e.g. -o DIR/config.json)")])
    if info is not None and (stat.S_ISCHR(info.st_mode) or stat.S_ISFIFO(info.st_mode)):
        _write_stream(path, text, out)
        return
    if info is not None and not force:
        raise ConfigError([Problem("-o", out, "the output file exists; pass --force to overwrite it")])
    parent = path.parent
    if not parent.is_dir():
        raise ConfigError([Problem("-o", out, f"the directory {parent} does not exist")])
    mode = stat.S_IMODE(info.st_mode) if info is not None else 0o666 & ~_umask()
    with _removed_on_signal() as pending:
        with _signals_blocked():  # a signal between creating the file and registering it is delivered after
            try:
                fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".tmp")
            except OSError as exc:
                raise ConfigError([Problem("-o", out, f"cannot create a file in {parent} ({exc.strerror}); "
                                           "choose a writable directory")]) from None  # fmt: skip
            pending.append(tmp)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
                os.fchmod(handle.fileno(), mode)
            os.replace(tmp, path)
        except OSError as exc:
            Path(tmp).unlink(missing_ok=True)
            raise ConfigError([Problem("-o", out, f"cannot be written ({exc.strerror})")]) from None
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _write_stream(path: Path, text: str, out: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as exc:
        raise ConfigError([Problem("-o", out, f"cannot be written ({exc.strerror})")]) from None


def _umask() -> int:
    mask = os.umask(0o022)  # the only portable way to read it is to set it; restored at once
    os.umask(mask)
    return mask


_CLEANUP_SIGNALS = ("SIGTERM", "SIGHUP")


@contextlib.contextmanager
def _signals_blocked():
    """Hold SIGTERM/SIGHUP until the block ends (where signal masks exist)."""
    import signal

    numbers = {getattr(signal, name) for name in _CLEANUP_SIGNALS if hasattr(signal, name)}
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, numbers)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def _removed_on_signal():
    """While the block runs, SIGTERM/SIGHUP first remove the files added to the yielded list, then end the process
    as the signal would have."""
    import signal

    pending: list[str] = []

    def handler(signum: int, frame: Any) -> None:
        for tmp in pending:
            Path(tmp).unlink(missing_ok=True)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    previous = {}
    try:
        for name in _CLEANUP_SIGNALS:
            number = getattr(signal, name, None)
            if number is not None:
                previous[number] = signal.signal(number, handler)
    except ValueError:  # not the main thread: signals cannot be handled here
        pass
    try:
        yield pending
    finally:
        for number, old in previous.items():
            signal.signal(number, old if old is not None else signal.SIG_DFL)


def _short(value: Any, limit: int = 40) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value  # AUTO prints as "auto"
    return text if len(text) <= limit else text[: limit - 3] + "..."
