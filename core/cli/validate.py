"""``torsh-migrate validate FILE...``: check configs of any dialect and report every key.

Several files per call; the exit code is the worst of them (2 a file is invalid, 1 with ``--strict`` a file is
valid but something in it would not be read as written, 0 all valid). With ``--report json`` the whole result,
errors included, is one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from torsh.cli._common import add_input_options, echo, print_report


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("validate", help="check config files of any dialect",
                            description="Check configs against their dialect's schema and the core model; "
                            "report what every key means. Exit code: the worst file's (0 valid, 1 with --strict: "
                            "valid but approximated, dropped or unsupported keys, or JSON only hjson accepts; "
                            "2 invalid).")  # fmt: skip
    parser.add_argument("file", nargs="+", help="config files (JSON, hjson, YAML or TOML)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a valid file has keys that are "
                        "approximated, dropped or unsupported, or is JSON that only an hjson reader accepts")
    add_input_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    results = [_validate(path, args) for path in args.file]
    worst = max(r["exit_code"] for r in results)
    if args.report == "json":
        json.dump({"exit_code": worst, "files": results}, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    return worst


def _validate(path: str, args: argparse.Namespace) -> dict[str, Any]:
    """One file's result; in table mode also printed (report to stdout, errors to stderr)."""
    from torsh import adapters
    from torsh.errors import ConfigError
    from torsh.formats import load_document
    from torsh.translate import ErrorLevel, LossyTranslationError

    result: dict[str, Any] = {"file": path, "dialect": None, "valid": False, "exit_code": 2, "syntax_notes": [],
                              "errors": [], "lossy": None, "report": None}  # fmt: skip
    try:
        result["syntax_notes"] = load_document(path).notes
        translation = adapters.load(path, args.dialect)
    except ConfigError as exc:
        result["errors"] = [_problem(p) for p in exc.problems]
        if args.report != "json":
            print(f"error: {exc}", file=sys.stderr)
        return result
    result.update(dialect=translation.source, valid=True, exit_code=0, report=translation.to_dict())
    if args.strict:
        try:
            translation.check(ErrorLevel.RAISE)
        except LossyTranslationError as exc:
            result["lossy"] = str(exc)
            result["exit_code"] = 1
        if result["syntax_notes"]:
            result["exit_code"] = 1
    if args.report != "json":
        print_report(translation, "table", sys.stdout, title=f"{path} ({translation.source})")
        for note in result["syntax_notes"]:
            print(f"note: {path}: {note}", file=sys.stderr)
        if result["lossy"]:
            print(f"error: {result['lossy']}\n(--strict: some keys are not read as written)", file=sys.stderr)
        verdict = "OK" if result["exit_code"] == 0 else "NOT OK (--strict)"
        echo(f"{verdict}: {path} is a valid {translation.source} config", indent="  ")
    return result


def _problem(problem) -> dict[str, Any]:
    from torsh.errors import MISSING

    value = None if problem.value is MISSING else problem.value
    return {"path": problem.path, "value": value, "reason": problem.reason, "suggestion": problem.suggestion,
            "message": str(problem)}  # fmt: skip
