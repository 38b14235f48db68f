"""The real check: a torchrun command translated from a deepspeed line starts 2 workers on this machine."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from torsh.adapters import launch

WORKER = textwrap.dedent("""
    import json, os, sys
    import torch.distributed as dist
    from torsh.ranks import discover

    info = discover()
    dist.init_process_group("gloo", rank=info.rank, world_size=info.world_size)
    import torch
    t = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(t)
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
             "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE")
    record = {"env": {k: os.environ.get(k) for k in names}, "argv": sys.argv[1:], "sum": t.item(),
              "info": [info.rank, info.local_rank, info.world_size, info.local_world_size, info.node_rank,
                       info.master_port, info.launcher]}
    with open(os.path.join(os.environ["OUT_DIR"], f"rank{info.rank}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_torchrun_translated_from_deepspeed_starts_two_workers(tmp_path):
    pytest.importorskip("torch", reason="runs torchrun")
    script = tmp_path / "tiny.py"
    script.write_text(WORKER)
    port = _free_port()
    cfg = launch.read(f"deepspeed --num_gpus=2 --master_port={port} {script} --epochs 1").result
    command = launch.write(cfg, version="torchrun").result
    assert len(command.commands) == 1
    argv = list(command.commands[0].argv)
    assert argv[:3] == ["torchrun", "--nproc-per-node=2", f"--master-port={port}"]
    argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    env = {**os.environ, **command.commands[0].env, "OUT_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, record in enumerate(records):
        assert record["env"] == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                                 "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                                 "MASTER_PORT": str(port), "CROSS_RANK": None, "CROSS_SIZE": None,
                                 "LOCAL_SIZE": None}  # fmt: skip
        assert record["argv"] == ["--epochs", "1"]  # no --local_rank: torchrun passes none
        assert record["info"] == [rank, rank, 2, 2, 0, port, "torchrun"]
        assert record["sum"] == 3.0  # the rendezvous works: 1 + 2 across both workers


@pytest.mark.slow
def test_deepspeed_translated_from_torchrun_starts_two_workers(tmp_path):
    """Where the deepspeed launcher is installed: its workers get its variables and, thanks to --no_local_rank,
    the same arguments the torchrun script got."""
    pytest.importorskip("deepspeed", reason="runs the deepspeed launcher")
    script = tmp_path / "tiny.py"
    script.write_text(WORKER)
    port = _free_port()
    cfg = launch.read(f"torchrun --nproc-per-node=2 --master-port={port} {script} --epochs 1").result
    command = launch.write(cfg, version="deepspeed").result
    argv = list(command.commands[0].argv)
    assert argv[:4] == ["deepspeed", "--num_gpus=2", f"--master_port={port}", "--no_local_rank"]
    argv = [sys.executable, "-m", "deepspeed.launcher.runner", *argv[1:]]
    env = {**os.environ, "OUT_DIR": str(tmp_path), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, record in enumerate(records):
        assert {k: record["env"][k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE",
                                              "LOCAL_SIZE", "MASTER_PORT")} == {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "CROSS_RANK": "0", "CROSS_SIZE": "1",
            "LOCAL_SIZE": "2", "MASTER_PORT": str(port)}  # fmt: skip
        assert record["argv"] == ["--epochs", "1"]
        assert record["info"] == [rank, rank, 2, 2, 0, port, "deepspeed"]
        assert record["sum"] == 3.0
