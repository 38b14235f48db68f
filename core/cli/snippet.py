"""``torsh-migrate snippet CONFIG``: the FSDP2 ``fully_shard`` calls a config describes, as Python to paste."""

from __future__ import annotations

import argparse
import sys

from torsh.cli._common import add_from_option


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("snippet", help="print the FSDP2 fully_shard code for a config of any dialect",
                            description="Read a config of any dialect and print Python that builds the device "
                            "mesh and policies and applies fully_shard to `model` (the FSDP2 equivalent).")
    parser.add_argument("file", help="config file (JSON, hjson, YAML or TOML)")
    add_from_option(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from torsh import adapters
    from torsh.adapters.fsdp import snippet

    read = adapters.load(args.file, args.dialect)
    lossy = adapters.write(read.result, "fsdp", version="fsdp2").lossy
    sys.stdout.write(snippet(read.result))
    for note in lossy:
        print(f"# not in the snippet: {note}", file=sys.stderr)
    return 0
