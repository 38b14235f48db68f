"""The main job (``make run``): convert every config in ``migration_examples/`` and print its report, then
convert a DeepSpeed config and train a small built-in model with it on two CPU processes.

Run from a checkout: ``python -m torsh.demo [DIR]`` (with DIR: only the conversions).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from torsh import adapters
from torsh.errors import ConfigError
from torsh.formats import format_for

EXAMPLES = Path(__file__).resolve().parent.parent / "migration_examples"


def convert_examples(root: Path = EXAMPLES) -> int:
    """Read every example config (sniffing its dialect) and print its translation report; returns failures."""
    from torsh.cli._common import print_report

    failures = 0
    files = sorted(p for p in root.rglob("*") if format_for(p) and ".expected" not in p.name)
    for path in files:
        try:
            translation = adapters.load(path)
        except ConfigError as exc:
            print(f"FAILED {path.relative_to(root)}: {exc}")
            failures += 1
            continue
        print_report(translation, "table", sys.stdout, title=f"{path.relative_to(root)} ({translation.source})")
    print(f"\n{len(files) - failures}/{len(files)} example configs converted")
    return failures


TRAIN_SCRIPT = EXAMPLES / "deepspeed" / "train_torsh.py"
TRAIN_CONFIG = EXAMPLES / "deepspeed" / "train_config.json"


def train(config: Path = TRAIN_CONFIG, *, steps: int = 30, nproc: int = 2, stream=sys.stdout) -> int:
    """Convert ``config`` to the native dialect, then train the example script on ``nproc`` CPU processes
    with the converted file; prints the conversion report and the loss-curve summary. Returns the exit code."""
    from torsh.cli._common import print_report

    translation = adapters.load(config)
    print_report(translation, "table", stream, title=f"{config.name} ({translation.source}) -> torsh")
    native = translation.result.model_dump(mode="json", exclude_defaults=True)
    with tempfile.TemporaryDirectory() as tmp:
        converted = Path(tmp, "train_config.torsh.json")
        converted.write_text(json.dumps(native, indent=2))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                   f"--master-port={port}", str(TRAIN_SCRIPT), "--deepspeed_config", str(converted),
                   "--steps", str(steps)]  # fmt: skip
        print(f"\ntraining with the converted config: {' '.join(command[2:5])} train_torsh.py "
              f"--steps {steps}", file=stream)  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        done = subprocess.run(command, env=env, capture_output=True, text=True)
    summary = [line for line in done.stdout.splitlines() if line.startswith("loss")]
    for line in summary:
        print(line, file=stream)
    if done.returncode or not summary:
        print(f"training failed (exit code {done.returncode}):\n{done.stderr[-3000:]}", file=stream)
        return done.returncode or 1
    return 0


def main() -> int:
    if len(sys.argv) > 1:
        return 1 if convert_examples(Path(sys.argv[1])) else 0
    failures = convert_examples(EXAMPLES)
    if "deepspeed" not in adapters.names():
        print("\nthe DeepSpeed adapter is not installed: skipping the training run")
        return 1
    try:
        import torch  # noqa: F401
    except ImportError:
        print("\ntraining needs torch (pip install 'torsh-distributed[engine]'): skipping the training run")
        return 1
    return 1 if train() or failures else 0


if __name__ == "__main__":
    sys.exit(main())
