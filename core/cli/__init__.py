"""``torsh-migrate``: convert, validate, explain and compare distributed-training configs.

Each sub-command is a module of this package with ``register(subparsers)`` and ``run(args) -> int``; adding
one is a module plus a line in ``COMMANDS``. Exit codes: 0 ok, 1 lossy under ``--strict`` (or: the configs differ,
parity failed), 2 bad input, 3 an internal error (a bug: one line asking for a report, never a traceback),
141 when the reader of the output went away (``validate x | head -1``; quietly, as a SIGPIPE would end it).
A user error prints one clear message and never a traceback. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

EXIT_OK, EXIT_LOSSY, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a writer ended by SIGPIPE

#: Sub-command modules, in the order ``--help`` lists them.
COMMANDS = ["convert", "validate", "explain", "diff", "launch", "snippet", "schema", "parity",
            "env", "merge"]


def build_parser() -> argparse.ArgumentParser:
    from torsh import __version__

    parser = argparse.ArgumentParser(
        prog="torsh-migrate",
        description="Translate distributed-training configs (DeepSpeed, FSDP, FairScale, Accelerate, Horovod, "
        "launchers) through one typed model, with a report that accounts for every key.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"{__name__}.{name}")
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (also used by tests)."""
    from torsh.errors import ConfigError
    from torsh.translate import LossyTranslationError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.run(args)
        sys.stdout.flush()
        return code
    except ConfigError as exc:
        _print_error(f"error: {exc}")
        return EXIT_BAD_INPUT
    except LossyTranslationError as exc:
        _print_error(f"error: {exc}\n(--strict: the translation loses meaning; drop --strict to accept it)")
        return EXIT_LOSSY
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except Exception as exc:  # noqa: BLE001 - a bug: one line, its own exit code, never a traceback
        _print_error(internal_error_message(exc, args))
        return EXIT_INTERNAL


def internal_error_message(exc: BaseException, args: argparse.Namespace | None = None) -> str:
    """The one line printed for a bug: what failed and where, and where to report it."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    command = f" in '{args.command}'" if args is not None and getattr(args, "command", None) else ""
    text = " ".join(str(exc).split())
    text = text if len(text) <= 200 else text[:197] + "..."
    return (f"internal error{command}: {type(exc).__name__}{': ' + text if text else ''}{where}; this is a bug in "
            "torsh-migrate, please report it with the command and the input file")


def _print_error(message: str) -> None:
    try:
        print(message, file=sys.stderr)
    except (BrokenPipeError, ValueError):  # stderr closed too: nothing left to tell
        pass


def _silence_stdout() -> None:
    """After a closed pipe: point stdout at /dev/null so the interpreter's final flush does not complain."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def entry() -> None:  # pragma: no cover - console script
    sys.exit(main())
