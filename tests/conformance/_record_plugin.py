"""pytest plugin loaded into each DeepSpeed test session by ``run_deepspeed.py`` (``-p _record_plugin``).

It changes nothing in DeepSpeed's tests; it only writes down what happens and picks which tests run:

* every test's start and outcome, one JSON line each, to the file named by ``TORSH_CONFORMANCE_EVENTS``, as soon
  as they are known (so that a session DeepSpeed's harness ends on a hang, ``pytest.exit("Test hanged")``, or that
  the runner kills, still leaves the outcomes before it and the test that started last);
* a file that does not import: one ``error`` line with the file's path as its node id;
* with ``TORSH_CONFORMANCE_ONLY`` (a file of node ids, one a line), only those tests run: the runner's restart
  after a hang;
* with ``TORSH_CONFORMANCE_PRELOAD`` (module names, comma-separated), the ``forkserver`` that DeepSpeed's
  ``DistributedTest`` starts its ranks from imports them once, so that each rank is forked with torch and the
  engine already imported instead of importing them again (seconds per rank per test on a small machine). The
  ranks run the same code; only where its import time is spent changes.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time

import pytest

_EVENTS = os.environ.get("TORSH_CONFORMANCE_EVENTS")
_ONLY = os.environ.get("TORSH_CONFORMANCE_ONLY")
_PRELOAD = os.environ.get("TORSH_CONFORMANCE_PRELOAD")
_outcomes: dict[str, tuple[str, str]] = {}
_started: dict[str, float] = {}


def _write(record: dict) -> None:
    if _EVENTS:
        with open(_EVENTS, "a") as fh:
            fh.write(json.dumps(record) + "\n")


def _message(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    text = str(getattr(report, "longreprtext", "") or "")
    lines = [ln for ln in text.splitlines() if ln.startswith("E ")] or text.splitlines()
    return "\n".join(lines[-8:])[-1500:]


def pytest_configure(config):
    if _PRELOAD:
        multiprocessing.set_forkserver_preload([m for m in _PRELOAD.split(",") if m])


def pytest_collectreport(report):
    if report.failed:
        _write({"event": "end", "test": report.nodeid, "outcome": "error", "message": _message(report),
                "seconds": 0.0})  # fmt: skip


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    if _ONLY:
        with open(_ONLY) as fh:
            wanted = {line.rstrip("\n") for line in fh if line.strip()}
        selected = [item for item in items if item.nodeid in wanted]
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in wanted])
        items[:] = selected
    _write({"event": "collected", "tests": [item.nodeid for item in items]})


def pytest_runtest_logstart(nodeid, location):
    _started[nodeid] = time.monotonic()
    _outcomes.pop(nodeid, None)
    _write({"event": "start", "test": nodeid})


def pytest_runtest_logreport(report):
    # The worst phase wins: a failed setup or teardown fails the test; a skip in setup or call is a skip.
    if report.failed:
        outcome = "failed"
    elif report.skipped:
        outcome = "skipped"
    else:
        outcome = "passed"
    previous = _outcomes.get(report.nodeid)
    rank = ("passed", "skipped", "failed")
    if previous is None or rank.index(outcome) > rank.index(previous[0]):
        _outcomes[report.nodeid] = (outcome, _message(report) if outcome != "passed" else "")


def pytest_runtest_logfinish(nodeid, location):
    outcome, message = _outcomes.pop(nodeid, ("failed", "no report"))
    seconds = time.monotonic() - _started.pop(nodeid, time.monotonic())
    _write({"event": "end", "test": nodeid, "outcome": outcome, "message": message, "seconds": round(seconds, 1)})
