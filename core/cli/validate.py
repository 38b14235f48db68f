"""``torsh-migrate validate FILE``: check a config of any dialect and report every key."""

from __future__ import annotations

import argparse
import sys

from torsh.cli._common import add_input_options, print_report


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("validate", help="check a config file of any dialect",
                            description="Check a config against its dialect's schema and the core model; "
                            "report what every key means.")  # fmt: skip
    parser.add_argument("file", help="config file (JSON, hjson, YAML or TOML)")
    add_input_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from torsh import adapters

    translation = adapters.load(args.file, args.dialect)
    print_report(translation, args.report, sys.stdout, title=f"{args.file} ({translation.source})")
    if args.report == "table":
        print(f"OK: {args.file} is a valid {translation.source} config")
    return 0
