"""``torsh-migrate explain FILE [--world-size N]``: what a config of any dialect means at run time."""

from __future__ import annotations

import argparse
import json
import sys

from torsh.cli._common import (add_deprecated_alias, add_from_option, add_report_option, echo, render_table,
                               terminal_width)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("explain", help="batch math, precision contract, loss scaling and engine plan",
                            description="Read a config of any dialect and print what it means at run time: the "
                            "resolved batch sizes, the dtype of every tensor class (the precision contract), the "
                            "loss-scaling rule and what torsh.initialize would build.")  # fmt: skip
    parser.add_argument("file", help="config file (JSON, hjson, YAML or TOML)")
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="processes in the job, to lay out the mesh and resolve the batch sizes for (the "
                        "data-parallel ranks are N / (tp x pp x cp); default: the process count the config states, "
                        "else 1)")
    add_from_option(parser)
    add_report_option(parser, help="output format (default: table)")
    add_deprecated_alias(parser, "--format", "--report", "report", choices=["table", "json"])
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from torsh import adapters
    from torsh.contract import explain
    from torsh.errors import ConfigError, Problem

    if args.world_size is not None and args.world_size < 1:
        raise ConfigError([Problem("--world-size", args.world_size, "must be at least 1")])
    translation = adapters.load(args.file, args.dialect)
    data = explain(translation.result, args.world_size)
    if args.report == "json":
        data["precision_contract"] = [asdict(r) for r in data["precision_contract"]]
        json.dump({"file": args.file, "dialect": translation.source, **data}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    echo(f"{args.file} ({translation.source})")
    ranks = f"{data['data_parallel_size']} data-parallel rank(s)"
    if data["data_parallel_size"] != data["world_size"]:
        ranks += f" of {data['world_size']}"
    echo(f"\nBatch ({ranks}): {data['batch']}\n", indent="  ")
    rows = [(row.tensor, row.dtype, row.detail) for row in data["precision_contract"]]
    sys.stdout.write(render_table("Precision contract", ("tensor", "dtype", "detail"), rows,
                                  terminal_width(sys.stdout)))  # fmt: skip
    echo(f"\nLoss scaling: {data['loss_scaling']}", indent="  ")
    print("\nEngine:")
    for i, step in enumerate(data["engine"], 1):
        echo(f"  {i}. {step}", indent="     ")
    if data["deferred"]:
        echo(f"\nDeferred (\"auto\"): {', '.join(data['deferred'])}", indent="  ")
    if data["refused"]:
        print("\nRefused by torsh.initialize (before the model is touched):")
        for reason in data["refused"]:
            echo(f"  - {reason}", indent="    ")
    return 0
