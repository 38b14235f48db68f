"""``torsh run``: torchrun, with every ``deepspeed`` import in the workers resolved to torsh's compatibility package.

``torsh run [torchrun options] train.py [args]`` (or ``python -m torsh.run ...``) takes exactly torchrun's
options: they are parsed by ``torch.distributed.run``'s own parser and the job is started by its own ``run``.
The one change is what each worker executes: a small bootstrap (:mod:`torsh.run._worker`) installs the import
hook (:func:`torsh.compat.install_deepspeed_alias`) and then runs the script (or ``-m module``) as ``__main__``
with the ``sys.argv`` torchrun would have given it (``--local-rank=N`` included under ``--no-use-env``). With
``--no-python`` the command is not a Python script; the hook is then installed by a ``sitecustomize`` module
put first on the workers' ``PYTHONPATH`` (it chains to any other ``sitecustomize``).
"""

from __future__ import annotations

import os
import sys

#: Marks, in the worker's arguments, that the target is a module (torchrun's ``-m``), not a script path.
MODULE_FLAG = "--torsh-module"

_HERE = os.path.dirname(os.path.abspath(__file__))
SITE_DIR = os.path.join(_HERE, "_site")
WORKER_FILE = os.path.join(_HERE, "_worker.py")


def _through_worker(args) -> None:
    """Rewrite torchrun's parsed arguments so that each worker starts in the bootstrap, which runs the target."""
    if args.no_python:
        # The command is an executable; any Python it starts imports our sitecustomize first.
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SITE_DIR, os.environ.get("PYTHONPATH")) if p)
        return
    target = [MODULE_FLAG, args.training_script] if args.module else [args.training_script]
    args.training_script_args = [*target, *args.training_script_args]
    if args.run_path:
        args.training_script, args.module = WORKER_FILE, False  # run in-process by path, like torchrun --run-path
    else:
        args.training_script, args.module = "torsh.run._worker", True


def main(argv: list[str] | None = None) -> None:
    """Parse torchrun's options from ``argv`` (default: the command line), and launch the job through the worker
    bootstrap. Exits as torchrun does (a failed worker raises ``ChildFailedError`` with its traceback)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import record

    parser = torchrun.get_args_parser()
    parser.prog = "torsh run"
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    _through_worker(args)
    record(torchrun.run)(args)


def cli(argv: list[str] | None = None) -> int:
    """The ``torsh`` command: ``torsh run [torchrun options] script [args]``."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: torsh run [--on ray] [torchrun options] training_script [args...]\n\n"
              "  run    launch like torchrun; `import deepspeed` in the workers resolves to torsh\n"
              "         (see `torsh run --help` for the options, which are torchrun's)\n"
              "         --on ray: the same job as a Ray Train TorchTrainer\n"
              "         (--ray-address, --ray-storage, --ray-name, --ray-config)")  # fmt: skip
        return 0 if argv else 2
    if argv[0] != "run":
        print(f"torsh: unknown command {argv[0]!r}; the command is `torsh run [torchrun options] script [args]` "
              "(config conversion is `torsh-migrate`)", file=sys.stderr)  # fmt: skip
        return 2
    rest = argv[1:]
    if rest[:1] == ["--on"] or (rest and rest[0].startswith("--on=")):
        where = rest[0].partition("=")[2] if "=" in rest[0] else (rest[1] if len(rest) > 1 else "")
        rest = rest[1:] if "=" in rest[0] else rest[2:]
        if where != "ray":
            print(f"torsh run: --on {where!r}: the one place torsh run hands a job to is ray (without --on it "
                  "runs here, like torchrun)", file=sys.stderr)  # fmt: skip
            return 2
        from torsh.run import ray

        sys.argv = ["torsh run --on ray", *rest]
        return ray.main(rest)
    sys.argv = ["torsh run", *rest]
    main(rest)
    return 0
