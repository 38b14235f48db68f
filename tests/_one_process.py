"""Many ``torsh.initialize`` cases in one Python process, each on a fresh process group as a fresh process would
have it: a test module's torch cases cost one interpreter start and one torch import instead of one each.

The test side calls :func:`records` with a script; the script defines the case function and ends with
``run_cases(fn)``, which reads the cases (JSON lists of arguments) from stdin and prints one record per case, a
case that raises recorded as its error (its own test reports it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable


def run_cases(fn: Callable[..., dict]) -> None:
    """In the script: ``fn(*case)`` for each case read from stdin, then the records as one JSON line."""
    import os
    import socket
    import traceback

    from torsh.engine.distributed import shutdown

    out = []
    for case in json.loads(sys.stdin.read()):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        try:
            out.append(fn(*case))
        except Exception as exc:
            out.append({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        shutdown()
    print(json.dumps(out))


def records(script: str, cases: list, *, env: dict[str, str], timeout: float) -> list[dict[str, Any]]:
    """Run ``script`` (which ends with ``run_cases(...)``) on ``cases`` in one process; a record per case."""
    proc = subprocess.run([sys.executable, "-c", script], input=json.dumps(cases), capture_output=True, text=True,
                          env=env, cwd=Path(__file__).parent, timeout=timeout)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
