"""One rank of the Horovod conformance run: Horovod's own ``test_torch.py`` under pytest, against torsh.horovod.

Started by torchrun from ``tests/test_horovod_conformance.py`` as
``horovod_conformance_rank.py <branch> <source dir> <results dir> <per-test seconds> [test names...]``.

* ``<branch>`` is the environment Horovod's CI gives each rank: ``gloo`` (``horovodrun --gloo``: ``HOROVOD_RANK``,
  ``HOROVOD_SIZE``, ... ; the file then shuts Horovod down after every test and runs its re-init tests) or ``mpi``
  (``mpirun``: ``OMPI_COMM_WORLD_RANK`` / ``_SIZE``; no ``HOROVOD_RANK``). Both come from torchrun's own variables.
* ``import horovod.torch`` (and its submodules) resolves to ``torsh.horovod``; the other ``horovod`` modules the
  test helpers import (``horovod.runner.util.threads``) come from Horovod's source in ``<source dir>``.
* Each test's outcome is appended, as one JSON line, to ``<results dir>/rank<N>.jsonl`` as soon as it is known,
  with a ``start`` line before it runs. A test still running after ``<per-test seconds>`` is recorded as ``hang``
  and the process exits at once (torchrun then stops the other rank; the caller restarts after that test).
"""

from __future__ import annotations

import faulthandler
import importlib
import importlib.abc
import importlib.util
import json
import os
import sys
import threading

from _pytest.runner import runtestprotocol


class _HorovodTorchAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``horovod.torch`` and ``horovod.torch.<x>`` are ``torsh.horovod``; everything else is looked up normally."""

    def find_spec(self, name, path=None, target=None):
        if name == "horovod.torch" or name.startswith("horovod.torch."):
            return importlib.util.spec_from_loader(name, self, is_package=name == "horovod.torch")
        return None

    def create_module(self, spec):
        return importlib.import_module("torsh.horovod")

    def exec_module(self, module):
        pass


def _install_aliases(source: str) -> None:
    sys.path.insert(0, source)  # Horovod's pure-Python helpers (horovod/runner/util/threads.py)
    sys.meta_path.insert(0, _HorovodTorchAlias())
    # test/utils/common.py imports these two for helpers test_torch.py never calls; the standalone ``mock`` is
    # ``unittest.mock``; cloudpickle only serialises functions for a spawn helper.
    for name, fallback in (("mock", "unittest.mock"), ("cloudpickle", "pickle")):
        try:
            importlib.import_module(name)
        except ImportError:
            sys.modules[name] = importlib.import_module(fallback)


def _branch_env(branch: str) -> None:
    rank, size = os.environ["RANK"], os.environ["WORLD_SIZE"]
    local_rank, local_size = os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]
    if branch == "gloo":  # what horovodrun --gloo exports
        os.environ.update(HOROVOD_RANK=rank, HOROVOD_SIZE=size, HOROVOD_LOCAL_RANK=local_rank,
                          HOROVOD_LOCAL_SIZE=local_size, HOROVOD_CROSS_RANK="0", HOROVOD_CROSS_SIZE="1",
                          HOROVOD_HOSTNAME="localhost", HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo")
    else:  # what Open MPI's mpirun exports
        os.environ.update(OMPI_COMM_WORLD_RANK=rank, OMPI_COMM_WORLD_SIZE=size,
                          OMPI_COMM_WORLD_LOCAL_RANK=local_rank, OMPI_COMM_WORLD_LOCAL_SIZE=local_size)


class _Recorder:
    """A pytest plugin: one JSON line per test outcome, and a watchdog per test."""

    def __init__(self, path: str, limit: float):
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the whole run
        self.limit = limit
        self.reported: set = set()

    def write(self, **record) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def pytest_runtest_logstart(self, nodeid, location):
        self.write(event="start", test=nodeid.rsplit("::", 1)[-1])

    def pytest_runtest_protocol(self, item, nextitem):
        name = item.name

        def expired():
            self.write(event="end", test=name, outcome="hang", message=f"still running after {self.limit:g} s")
            with open(self.file.name.replace(".jsonl", "-stacks.txt"), "w") as stacks:  # where it hangs
                faulthandler.dump_traceback(stacks, all_threads=True)
                state = getattr(sys.modules.get("torsh.horovod._basics"), "_state", None)
                ctl = getattr(state, "controller", None)
                if ctl is not None:  # what this rank waits for, and what the others asked for
                    stacks.write(f"\npending here: {sorted(ctl.local)}\nmatching table: "
                                 f"{ {k: sorted(v) for k, v in ctl.table.items()} }\n")
            os._exit(3)

        timer = threading.Timer(self.limit, expired)
        timer.daemon = True
        timer.start()
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        reports = runtestprotocol(item, nextitem=nextitem, log=True)
        timer.cancel()
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        outcome, message = "pass", ""
        for report in reports:
            if report.failed:
                outcome, message = "fail", _message(report)
                break
            if report.skipped:
                outcome, message = "skip", _message(report)
        self.write(event="end", test=name, outcome=outcome, message=message)
        return True


def _message(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    text = str(getattr(report, "longreprtext", "") or report.longrepr)
    lines = [ln for ln in text.splitlines() if ln.startswith("E ")] or text.splitlines()[-3:]
    return "\n".join(lines[:6])[:1500]


def main() -> None:
    branch, source, results, limit, *tests = sys.argv[1:]
    _branch_env(branch)
    _install_aliases(source)
    import pytest

    test_file = os.path.join(source, "test", "parallel", "test_torch.py")
    targets = [f"{test_file}::TorchTests::{t}" for t in tests] or [test_file]
    recorder = _Recorder(os.path.join(results, f"rank{os.environ['RANK']}.jsonl"), float(limit))
    junit = os.path.join(results, f"junit-{branch}-rank{os.environ['RANK']}.xml")
    code = pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:randomly", "--rootdir", source,
                        f"--junitxml={junit}", *targets],
                       plugins=[recorder])  # fmt: skip
    recorder.file.close()
    sys.stdout.flush()
    os._exit(0 if code in (0, 1) else int(code))


if __name__ == "__main__":
    main()
