"""Launch translations run by the real launchers: the rank environment a probe script sees under the source
launcher and under the translated command is the same (ranks, world size, master; for ``accelerate launch
--config_file``, the process count of the file and the variables the script's Accelerator reads)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from torsh.adapters import launch

pytest.importorskip("accelerate", reason="the source launcher of this check is accelerate launch")

PROBE = """
import json, os, sys
keep = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "GROUP_RANK")
env = {k: v for k, v in os.environ.items() if k in keep or k.startswith(("FSDP_", "ACCELERATE_MIXED_PRECISION",
                                                                           "ACCELERATE_USE_"))}
with open(os.path.join(sys.argv[1], f"{sys.argv[2]}-{os.environ['RANK']}.json"), "w") as f:
    json.dump(env, f)
"""

CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: Block
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
mixed_precision: bf16
num_machines: 1
num_processes: 2
main_process_port: 0
"""


def run(argv: list[str], cwd: Path, env_extra: dict | None = None) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_accelerate_launch_and_its_torchrun_translation_give_the_same_process_environment(tmp_path):
    (tmp_path / "acc.yaml").write_text(CONFIG)
    (tmp_path / "probe.py").write_text(PROBE)
    source = "accelerate launch --config_file acc.yaml probe.py ."
    cwd = os.getcwd()
    os.chdir(tmp_path)  # accelerate launch opens the config from the working directory; so does the reader
    try:
        read = launch.read(source)
        command = launch.write(read.result, version="torchrun").result
    finally:
        os.chdir(cwd)
    assert read.result.launch.world_size == 2 and read.result.launch.env["ACCELERATE_USE_FSDP"] == "true"
    run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "acc.yaml", "probe.py", ".", "source"],
        tmp_path)  # fmt: skip
    argv = list(command.commands[0].argv)
    assert argv[0] == "torchrun"
    free = [a for a in argv if not a.startswith("--master-port")]
    run([sys.executable, "-m", "torch.distributed.run", "--master-port=0", *free[1:], "target"], tmp_path,
        dict(command.commands[0].env))  # fmt: skip
    for rank in range(2):
        source_env = json.loads((tmp_path / f"source-{rank}.json").read_text())
        target_env = json.loads((tmp_path / f"target-{rank}.json").read_text())
        source_env.pop("MASTER_ADDR", None), target_env.pop("MASTER_ADDR", None)
        assert target_env == source_env, (shlex.join(argv), source_env, target_env)
