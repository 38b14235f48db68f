"""``torsh-migrate schema DIALECT``: print a dialect's JSON Schema."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("schema", help="print the JSON Schema of a dialect")
    parser.add_argument("dialect", help="dialect name (e.g. torsh, deepspeed)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from torsh import schemas
    from torsh.errors import ConfigError, Problem, did_you_mean

    schema = schemas.load(args.dialect)
    if schema is None:
        known = schemas.available()
        raise ConfigError([Problem("dialect", args.dialect, f"no schema for this dialect; known: {', '.join(known)}",
                                   did_you_mean(args.dialect, known))])  # fmt: skip
    sys.stdout.write(schemas.render(schema))
    return 0
