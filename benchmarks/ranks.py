"""Launching a benchmark's worker on several ranks with torchrun, the memory a rank reads about itself, and
collecting what the ranks measured."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(module: str, worker_args: list[str], nproc: int, out: str, env: dict[str, str] | None = None,
           timeout: float = 900) -> list[dict] | str:  # fmt: skip
    """``python -m <module> --worker <worker_args...>`` on ``nproc`` ranks (freed memory returned to the system
    early, one thread a rank); every rank's numbers, as the worker wrote them to ``out``, or the error text."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           **(env or {})}  # fmt: skip
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               f"--master-port={free_port()}", "-m", module, "--worker", *worker_args]  # fmt: skip
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    if done.returncode != 0 or not Path(out).exists():
        return (done.stdout + done.stderr)[-2000:]
    return json.loads(Path(out).read_text())


def worst(ranks: list[dict], key: str) -> float:
    """The worst rank's value (the largest)."""
    return max(r[key] for r in ranks)


def status_mib(field: str) -> float:
    """A memory figure of this process from ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in MiB (NaN elsewhere)."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return float("nan")
    for line in lines:
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def reset_peak() -> None:
    """Start ``VmHWM`` (the peak resident memory) again from the current figure (Linux; elsewhere nothing)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def options_or_worker(prog: str, doc: str, worker: Any, argv: list[str] | None,
                      **defaults: str) -> argparse.Namespace | None:  # fmt: skip
    """The benchmark's options (``--NAME`` for each default), or None after running ``worker(*args)`` for
    ``--worker ARG ARG`` (how :func:`launch` starts each rank)."""
    parser = argparse.ArgumentParser(prog=prog, description=doc)
    for name, default in defaults.items():
        parser.add_argument(f"--{name}", default=default)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return None
    return args
