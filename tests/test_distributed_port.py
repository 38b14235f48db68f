"""``distributed_port`` (``deepspeed.initialize`` / ``init_distributed``) is the rendezvous port when no launcher
set MASTER_PORT, and the launcher's port wins when it did (DeepSpeed's rule)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

PROBE = """
import os, sys
import torch.distributed as dist
from torsh.engine.distributed import init_distributed
init_distributed(distributed_port=int(sys.argv[1]))
print(os.environ["MASTER_PORT"], dist.get_world_size())
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(port: int, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK")
             and not k.startswith(("OMPI_", "PMI_", "SLURM_", "HOROVOD_", "TORCHELASTIC_"))}  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", PROBE, str(port)], env={**clean, **env}, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()[0]


def test_distributed_port_is_used_without_a_launcher():
    port = _free_port()
    assert _run(port) == str(port)


def test_a_launchers_master_port_wins():
    launcher_port, ignored = _free_port(), _free_port()
    assert _run(ignored, MASTER_PORT=str(launcher_port)) == str(launcher_port)
