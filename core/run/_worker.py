"""The worker bootstrap ``torsh run`` starts instead of the script: install the ``deepspeed`` alias, then run the
script (or module) as ``__main__`` with the ``sys.argv`` and ``sys.path[0]`` Python would have given it.

Arguments: ``[--local-rank=N] [--torsh-module] TARGET [ARGS...]`` (torchrun puts its ``--local-rank`` before
the script's arguments; it is moved back to where torchrun would pass it: right after the script name).
"""

from __future__ import annotations

import os
import runpy
import sys

MODULE_FLAG = "--torsh-module"  # torsh.run.MODULE_FLAG; not imported, so that --run-path needs no package state


def _split(argv: list[str]) -> tuple[list[str], bool, str, list[str]]:
    local_rank = []
    while argv and argv[0].startswith(("--local-rank=", "--local_rank=")):
        local_rank.append(argv.pop(0))
    as_module = bool(argv) and argv[0] == MODULE_FLAG
    if as_module:
        argv.pop(0)
    if not argv:
        raise SystemExit("torsh run: no training script given (usage: torsh run [torchrun options] script [args])")
    return local_rank, as_module, argv[0], argv[1:]


def main(argv: list[str]) -> None:
    """Install the alias and run the target."""
    from torsh.compat import install_deepspeed_alias

    local_rank, as_module, target, rest = _split(list(argv))
    install_deepspeed_alias()
    sys.argv = [target, *local_rank, *rest]
    if as_module:
        sys.path[0] = os.getcwd()  # as `python -m`
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py`
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
