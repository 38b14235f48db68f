"""``torsh-migrate diff A B``: the semantic differences of two configs, in any two dialects.

Both files are read into the core model; the differences are listed by core path, with both values and the
source keys that produced them (e.g. an Accelerate YAML against the DeepSpeed JSON of the same job). Values are
compared as the engine uses them: an unset reduce dtype equals the parameter dtype, an unset
``reshard_after_forward`` equals what the stage implies. Exit code 0: same meaning, 1: they differ, 2: bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from torsh.cli._common import _short, echo, render_table, terminal_width


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("diff", help="semantic differences of two configs, across dialects",
                            description="Read two configs (any dialects) into the core model and list what differs, "
                            "by core path, with both values and their source keys. Exit 1 when they differ.")
    parser.add_argument("a", help="first config file")
    parser.add_argument("b", help="second config file")
    parser.add_argument("--from-a", metavar="DIALECT", help="dialect of A (default: detected)")
    parser.add_argument("--from-b", metavar="DIALECT", help="dialect of B (default: detected)")
    parser.add_argument("--ignore", action="append", default=[], metavar="PREFIX",
                        help="core path prefix to leave out (repeatable), e.g. --ignore launch")
    parser.add_argument("--report", choices=["table", "json"], default="table", help="output format")
    parser.set_defaults(run=run)  # fmt: skip


@dataclass(frozen=True)
class Difference:
    """One core field that two configs set differently."""

    path: str
    """Dotted core path."""
    a: Any
    """Value in the first config."""
    b: Any
    """Value in the second config."""
    a_sources: tuple[str, ...]
    """Keys of the first file that set it (empty: a default)."""
    b_sources: tuple[str, ...]
    """Keys of the second file that set it (empty: a default)."""

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "a": self.a, "b": self.b, "a_sources": list(self.a_sources),
                "b_sources": list(self.b_sources)}  # fmt: skip


def semantic_view(cfg) -> dict[str, Any]:
    """The core config as leaves, with the values the engine derives made explicit."""
    from torsh.config import iter_leaves

    data = cfg.model_dump(mode="json", exclude={"extensions"})
    data["precision"]["reduce_dtype"] = cfg.precision.effective_reduce_dtype
    data["precision"]["grad_accum_dtype"] = cfg.precision.effective_grad_accum_dtype
    data["sharding"]["reshard_after_forward"] = cfg.sharding.effective_reshard_after_forward
    return dict(iter_leaves(data))


def sources(translation, path: str) -> tuple[str, ...]:
    """The source keys whose notes target ``path`` or one of its parents."""
    derived = {"precision.reduce_dtype": "precision.param_dtype", "precision.grad_accum_dtype": "precision.param_dtype",
               "sharding.reshard_after_forward": "sharding.stage"}  # fmt: skip
    found = []
    for candidate in (path, derived.get(path)):
        for note in translation.notes:
            target = note.target_path or ""
            if candidate and target and (candidate == target or candidate.startswith(target + ".")):
                found.append(note.source_path)
        if found:
            break
    return tuple(dict.fromkeys(found))


def semantic_diff(a, b, ignore: tuple[str, ...] = ()) -> list[Difference]:
    """Differences between two read translations, by core path."""
    left, right = semantic_view(a.result), semantic_view(b.result)
    out = []
    for path in sorted(set(left) | set(right)):
        if any(path == p or path.startswith(p + ".") for p in ignore):
            continue
        if left.get(path) != right.get(path):
            out.append(Difference(path, left.get(path), right.get(path), sources(a, path), sources(b, path)))
    return out


def run(args: argparse.Namespace) -> int:
    from torsh import adapters

    a = adapters.load(args.a, args.from_a)
    b = adapters.load(args.b, args.from_b)
    differences = semantic_diff(a, b, tuple(args.ignore))
    if args.report == "json":
        json.dump({"a": {"file": args.a, "dialect": a.source}, "b": {"file": args.b, "dialect": b.source},
                   "differences": [d.to_dict() for d in differences]}, sys.stdout, indent=2)  # fmt: skip
        sys.stdout.write("\n")
    else:
        _print_table(args, a, b, differences)
    return 1 if differences else 0


def _print_table(args: argparse.Namespace, a, b, differences: list[Difference]) -> None:
    """Plain text (no box drawing): aligned in a pipe, wrapped to the terminal's width on a terminal."""
    if not differences:
        echo(f"same meaning: {args.a} ({a.source}) and {args.b} ({b.source})", indent="  ")
        return
    rows = [(d.path, _short(d.a), ", ".join(d.a_sources) or "(default)", _short(d.b),
             ", ".join(d.b_sources) or "(default)") for d in differences]  # fmt: skip
    title = f"{args.a} ({a.source})  vs  {args.b} ({b.source})"
    sys.stdout.write(render_table(title, ("core path", "A", "A keys", "B", "B keys"), rows,
                                  terminal_width(sys.stdout)))  # fmt: skip
    print(f"{len(differences)} difference(s)")
