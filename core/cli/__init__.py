"""``torsh-migrate``: convert, validate, explain and compare distributed-training configs.

Each sub-command is a module of this package with ``register(subparsers)`` and ``run(args) -> int``; adding
one is a module plus a line in ``COMMANDS``. Exit codes: 0 ok, 1 lossy under ``--strict``, 2 bad input.
A user error prints one clear message and never a traceback. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

EXIT_OK, EXIT_LOSSY, EXIT_BAD_INPUT = 0, 1, 2

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
        return args.run(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except LossyTranslationError as exc:
        print(f"error: {exc}\n(--strict: the translation loses meaning; drop --strict to accept it)", file=sys.stderr)
        return EXIT_LOSSY
    except KeyboardInterrupt:
        return 130


def entry() -> None:  # pragma: no cover - console script
    sys.exit(main())
