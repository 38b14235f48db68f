"""``torsh-migrate parity CONFIG``: run a config under real DeepSpeed and under torsh, step by step, and compare."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("parity", help="compare DeepSpeed and torsh on a config, step by step",
                            description="Train a small built-in model on synthetic data with CONFIG under real "
                            "DeepSpeed and under torsh (same initial weights, same data order) and compare loss, "
                            "gradient norm, learning rate, loss scale and skipped steps. Exit 0 within tolerance, "
                            "1 when not, 2 on bad input or when DeepSpeed is missing.")  # fmt: skip
    parser.add_argument("config", help="config file of any dialect")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--model", choices=["tiny-mlp", "tiny-transformer"], default="tiny-mlp")
    parser.add_argument("--candidate", metavar="CONFIG2",
                        help="run this config under torsh instead of CONFIG (e.g. its FSDP translation)")
    parser.add_argument("--reference", choices=["deepspeed", "torsh"], default="deepspeed",
                        help="engine that runs CONFIG: real DeepSpeed (default) or torsh (with --candidate)")
    parser.add_argument("--plot", metavar="PNG", help="write loss / grad-norm curves and their difference")
    parser.add_argument("--report-file", metavar="JSON", help="write the full report as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from torsh.errors import ConfigError, Problem

    if args.steps < 1 or args.nproc < 1:
        raise ConfigError([Problem("--steps/--nproc", (args.steps, args.nproc), "must be at least 1")])
    for path in filter(None, (args.config, args.candidate)):
        if not Path(path).is_file():
            raise ConfigError([Problem("", path, "no such file; check the path")], source=path)
    if args.reference == "torsh" and not args.candidate:
        raise ConfigError([Problem("--reference", "torsh", "comparing torsh with itself needs --candidate CONFIG2")])
    _status(_start_line(args))  # before anything slow: the first run can take minutes before its first step
    from torsh import parity

    if args.reference == "deepspeed" and not parity.deepspeed_available():
        print("error: DeepSpeed is not installed, so there is no reference to compare against.\n"
              "Install the extra: pip install 'torsh-distributed[parity]'", file=sys.stderr)  # fmt: skip
        return 2
    try:
        report = _run_with_progress(parity, args)
    except (parity.ParityRunError, parity.ParityUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _print_summary(report)
    if args.report_file:
        Path(args.report_file).write_text(json.dumps(report.to_dict(), indent=2, default=str))
    if args.plot:
        parity.plot(report, args.plot)
        print(f"plot: {args.plot}")
    return 0 if report.passed else 1


def _start_line(args: argparse.Namespace) -> str:
    """What parity is about to do, in one line: printed at once, so the screen is never blank."""
    engines = "DeepSpeed (reference) and torsh" if args.reference == "deepspeed" else "torsh (reference and candidate)"
    first = "DeepSpeed" if args.reference == "deepspeed" else "torsh"
    return (f"parity: training {args.model} for {args.steps} steps on {args.nproc} ranks under {engines}; starting "
            f"{first} workers (a first run also compiles DeepSpeed's CPU ops: a minute or two before step 1)...")


def _status(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


#: Shown while no run reports steps: workers starting, ops compiling, or the next engine being launched.
_WAITING = "starting workers (first run: compiling ops)"


def _run_with_progress(parity, args: argparse.Namespace):
    """The runs with one progress bar per scenario (reference, calibration, candidate) on stderr, and a spinner
    while no run reports steps; on a non-terminal stderr (a log, CI), one plain line per scenario as it starts."""
    from rich.console import Console

    def run(on_progress):
        return parity.check_config(args.config, steps=args.steps, nproc=args.nproc, model=args.model,
                                   candidate_config=args.candidate, reference_engine=args.reference,
                                   on_progress=on_progress)  # fmt: skip

    console = Console(stderr=True)
    if not console.is_terminal:
        started: set[str] = set()

        def on_line(name: str, done: int, total: int) -> None:
            if name not in started:
                started.add(name)
                _status(f"parity: running scenario '{name}' ({total} steps)")

        return run(on_line)
    from rich.progress import Progress

    with Progress(transient=True, console=console) as progress:
        tasks: dict[str, int] = {}
        waiting = progress.add_task(_WAITING, total=None)

        def on_progress(name: str, done: int, total: int) -> None:
            if name not in tasks:
                tasks[name] = progress.add_task(name, total=total)
            progress.update(tasks[name], completed=done)
            running = any(not task.finished for task in progress.tasks if task.id in tasks.values())
            progress.update(waiting, visible=not running, description="waiting for the next run" if tasks
                            else _WAITING)  # fmt: skip

        return run(on_progress)


def _print_summary(report) -> None:
    comparison = report.comparison
    verdict = "PASS" if report.passed else "FAIL"
    print(f"{verdict}: {report.candidate} vs {report.reference}, {report.precision}, "
          f"{len(report.reference_records)} steps")
    for metric, diff in comparison.max_rel_diff.items():
        print(f"  {metric:<10} max rel. diff {diff:.3g} (tolerance {comparison.tolerance[metric]:.3g})")
    if comparison.first_divergence is not None:
        d = comparison.first_divergence
        print(f"  first divergence: step {d.step}, {d.metric}: reference {d.reference:.6g} vs candidate "
              f"{d.candidate:.6g}")
    for note in comparison.notes:
        print(f"  note: {note}")
