"""``torsh-migrate convert FILE --to DIALECT``: translate a config, with a report for every key."""

from __future__ import annotations

import argparse
import json
import sys

from torsh.cli._common import add_deprecated_alias, add_input_options, print_report, write_output
from torsh.formats import FORMATS, dump_text, format_for, null_paths


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("convert", help="translate a config to another dialect",
                            description="Read a config of any dialect into the core model and write it in "
                            "another. The converted config goes to -o (or stdout); the report to stdout "
                            "with -o, else to stderr, so each stream carries one document (with --report json, "
                            "one JSON object with the read and write reports).")  # fmt: skip
    parser.add_argument("file", help="config file (JSON, hjson, YAML or TOML)")
    parser.add_argument("--to", required=True, metavar="DIALECT", help="target dialect (e.g. torsh, deepspeed)")
    parser.add_argument("--variant", dest="target_version", metavar="VARIANT", help="variant of the target dialect "
                        "to write (e.g. --to accelerate --variant fsdp2; --to fsdp --variant fsdp1)")
    # --version is the program's version (torsh-migrate --version); the old spelling here still works.
    add_deprecated_alias(parser, "--version", "--variant", "target_version", metavar="VARIANT")
    parser.add_argument("--format", choices=FORMATS, help="output format (default: from -o, else the dialect's own)")
    parser.add_argument("--full", action="store_true", help="with --to torsh: write every setting, defaults "
                        "included (default: only what differs from the defaults)")
    parser.add_argument("-o", "--output", metavar="OUT", help="output file (default: stdout)")
    parser.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    parser.add_argument("--strict", action="store_true", help="exit 1 if any key is approximated, dropped or "
                        "unsupported")  # fmt: skip
    for flag, what in (("--world-size", "processes over all nodes"), ("--nnodes", "nodes"),
                       ("--nproc-per-node", "processes per node")):  # fmt: skip
        parser.add_argument(flag, type=int, default=None, metavar="N", help=f"{what}, where the source leaves it to "
                            "the launcher (so an Accelerate YAML gets num_processes); must agree with the source")
    add_input_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from torsh import adapters
    from torsh.translate import ErrorLevel

    adapter = adapters.get(args.to)
    read = adapters.load(args.file, args.dialect)
    read.result = _with_launch_sizes(read.result, args)
    written = _write(adapter, read.result, args)
    payload = written.result
    if isinstance(payload, str):
        text = payload if payload.endswith("\n") else payload + "\n"
    else:
        fmt = args.format or (format_for(args.output) if args.output else None) or getattr(
            adapter, "DEFAULT_FORMAT", "json")
        text = dump_text(payload, fmt)
        if fmt == "toml":
            _report_nulls_left_out(written, null_paths(payload))
    report_stream = sys.stderr if _is_stdout(args.output) else sys.stdout
    if args.report == "json":
        json.dump({"file": args.file, "output": args.output or "-", "read": read.to_dict(),
                   "write": written.to_dict()}, report_stream, indent=2)  # fmt: skip
        report_stream.write("\n")
    else:
        print_report(read, args.report, report_stream, title=f"read {args.file} ({read.source})")
        print_report(written, args.report, report_stream, title=f"write {args.to}")
    if args.strict:
        read.check(ErrorLevel.RAISE)
        written.check(ErrorLevel.RAISE)
    write_output(text, args.output, args.force)
    return 0


def _report_nulls_left_out(written, paths: list[str]) -> None:
    """TOML has no null: each key whose value is null is left out of the file, and its note says so."""
    from dataclasses import replace

    from torsh.translate import Fidelity, Note

    reason = "TOML has no null: left out of the file (YAML or JSON output keep it)"
    for path in paths:
        at = [i for i, n in enumerate(written.notes) if n.target_path == path]
        for i in at:
            written.notes[i] = replace(written.notes[i], target_path=None, fidelity=Fidelity.DROPPED, reason=reason)
        if not at:
            written.notes.append(Note(path, None, None, Fidelity.DROPPED, reason))


#: The launch sizes convert fills from its flags: flag -> (argparse dest, launch field).
_LAUNCH_FLAGS = {"--world-size": ("world_size", "world_size"), "--nnodes": ("nnodes", "nnodes"),
                 "--nproc-per-node": ("nproc_per_node", "nproc_per_node")}  # fmt: skip


def _with_launch_sizes(cfg, args: argparse.Namespace):
    """The config with the process counts the flags give; a flag that contradicts the source is refused (the
    source's own count wins nowhere silently), as are counts that do not multiply out."""
    from torsh.contract import config_world_size
    from torsh.errors import ConfigError, Problem

    given = {flag: getattr(args, dest) for flag, (dest, _) in _LAUNCH_FLAGS.items() if getattr(args, dest) is not None}
    if not given:
        return cfg
    problems = [Problem(flag, n, "must be at least 1") for flag, n in given.items() if n < 1]
    launch = cfg.launch.model_dump()
    for flag, value in given.items():
        field = _LAUNCH_FLAGS[flag][1]
        if launch[field] not in (None, value):
            problems.append(Problem(flag, value, f"the source says launch.{field} = {launch[field]!r}; drop the flag "
                                    "or give the same number"))  # fmt: skip
        launch[field] = value
    nodes, per_node, world = launch["nnodes"], launch["nproc_per_node"], launch["world_size"]
    if all(isinstance(v, int) for v in (nodes, per_node, world)) and nodes * per_node != world:
        problems.append(Problem("--world-size", world, f"is not --nnodes {nodes} x --nproc-per-node {per_node}"))
    if problems:
        raise ConfigError(problems)
    updated = cfg.model_copy(update={"launch": type(cfg.launch).model_validate(launch)})
    stated, now = config_world_size(cfg), config_world_size(updated)
    if stated is not None and now is not None and stated[0] != now[0]:
        flag = next(iter(given))
        raise ConfigError([Problem(flag, given[flag], f"gives {now[0]} processes but the source implies {stated[0]} "
                                   f"({stated[1]}); drop the flag or make them agree")])  # fmt: skip
    return updated


def _write(adapter: object, cfg: object, args: argparse.Namespace):
    """The config in the target dialect; a wrong variant is reported under the flag that set it (--variant)."""
    from dataclasses import replace

    from torsh.errors import ConfigError

    try:
        return adapter.write(cfg, version=args.target_version, **_full_option(adapter, args.full))
    except ConfigError as exc:
        if not any(p.path == "version" for p in exc.problems):
            raise
        problems = [replace(p, path="--variant") if p.path == "version" else p for p in exc.problems]
        raise ConfigError(problems) from None


def _full_option(adapter: object, full: bool) -> dict:
    """``full=`` for the native writer (minimal unless --full); --full means nothing for another dialect."""
    from torsh.errors import MISSING, ConfigError, Problem

    if getattr(adapter, "NAME", None) == "torsh":
        return {"full": full}
    if full:
        raise ConfigError([Problem("--full", MISSING, "applies to --to torsh only (other dialects are written whole); "
                                   "drop --full")])  # fmt: skip
    return {}


def _is_stdout(output: str | None) -> bool:
    """True when the converted config goes to stdout (no -o, ``-o -``, or -o naming stdout, e.g. /dev/stdout)."""
    if output in (None, "-"):
        return True
    import os

    try:
        a, b = os.stat(output), os.fstat(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
