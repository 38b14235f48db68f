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
    """Install the alias and run the target; a target that finishes (or exits) ends the process as described in
    :func:`_finish`."""
    from torsh.compat import install_deepspeed_alias

    local_rank, as_module, target, rest = _split(list(argv))
    install_deepspeed_alias()
    sys.argv = [target, *local_rank, *rest]
    try:
        if as_module:
            sys.path[0] = os.getcwd()  # as `python -m`
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py`
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        if _in_multiprocessing_child():
            raise
        _finish(exc.code)
    if not _in_multiprocessing_child():
        _finish(0)


def _in_multiprocessing_child() -> bool:
    """torchrun --run-path runs each worker as a multiprocessing child, which must return to report its result."""
    import multiprocessing

    return multiprocessing.parent_process() is not None


def _finish(code: object) -> None:
    """End the worker once its Python work is done, without the C++ teardown that follows interpreter exit.

    A finished job's worker could still die of SIGABRT there ("terminate called without an active exception": a
    thread of torch's distributed runtime destroyed while still running), and torchrun then reports the job
    failed and stops the other ranks mid-way. So, in the order Python's own exit takes: wait for the script's
    non-daemon threads, run the ``atexit`` handlers (torsh's distributed shutdown, logging's flush, the user's),
    flush every open file, and leave with the script's exit status.
    """
    import atexit
    import gc
    import io
    import threading

    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): printed, status 1, as Python does
        print(code, file=sys.stderr)
        status = 1
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    gc.collect()
    for obj in gc.get_objects():
        if isinstance(obj, io.IOBase):
            try:
                if not obj.closed:
                    obj.flush()
            except Exception:  # noqa: BLE001 - a file that cannot be flushed would lose its data at exit too
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(status & 0xFF)


if __name__ == "__main__":
    main(sys.argv[1:])
