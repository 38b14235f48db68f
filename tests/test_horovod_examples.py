"""migration_examples/horovod: the Horovod script runs under torchrun with only its import line changed."""

from __future__ import annotations

import difflib
import os
import re
import socket
import subprocess
import sys

import pytest


def test_after_differs_from_before_only_in_the_import_line(examples):
    before = (examples / "horovod" / "train_horovod.py").read_text().splitlines()
    after = (examples / "horovod" / "train_torsh.py").read_text().splitlines()
    changed = [line for line in difflib.unified_diff(before, after, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]  # fmt: skip
    assert changed == ["-import horovod.torch as hvd", "+import torsh.horovod as hvd"]


@pytest.mark.slow
def test_after_script_trains_with_torchrun_on_two_processes(examples):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                      "HOROVOD_", "TORCHELASTIC", "GROUP_"))}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(port), str(examples / "horovod" / "train_torsh.py"), "--epochs", "1"],
                          env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"epoch 1: test loss [\d.]+, accuracy [\d.]+%", proc.stdout)
    # both ranks write to one pipe: a line may run into the next, so the checksum is matched as a number
    checksums = dict(re.findall(r"rank (\d) of 2: parameter checksum (-?\d+\.\d+)", proc.stdout))
    assert set(checksums) == {"0", "1"} and checksums["0"] == checksums["1"], proc.stdout
