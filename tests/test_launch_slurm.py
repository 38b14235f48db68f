"""Slurm: ``torsh-migrate launch "<line>" --to slurm`` writes an sbatch script (one task per node, each running
torchrun with a c10d rendezvous on the first node); the launch dialect reads such scripts back."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from torsh import adapters
from torsh.adapters import launch
from torsh.concepts.launch import SBATCH_OPTIONS
from torsh.errors import ConfigError
from torsh.translate import Fidelity

LINES = [
    "torchrun --nnodes 4 --nproc-per-node 8 train.py --lr 1e-4",
    "deepspeed --num_nodes 2 --num_gpus 4 train.py --deepspeed ds.json",
    "NCCL_DEBUG=INFO torchrun --nnodes=2 --nproc_per_node=2 -m pkg.train --epochs 3",
    "torchrun --standalone --nproc-per-node 2 train.py",
]


def slurm(line: str):
    return adapters.write(launch.read(line).result, "launch", version="slurm")


def _directives(script: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=?(.*)$", script, re.M))


@pytest.mark.parametrize("line", LINES)
def test_every_directive_is_an_sbatch_option_and_the_placeholders_are_named(line):
    written = slurm(line)
    directives = _directives(written.result)
    assert set(directives) <= set(SBATCH_OPTIONS)
    assert directives["ntasks-per-node"] == "1"
    deferred = {n.target_path for n in written.notes if n.fidelity is Fidelity.DEFERRED}
    assert {"#SBATCH --time", "#SBATCH --partition"} <= deferred
    assert "srun torchrun" in written.result and "--rdzv-backend=c10d" in written.result


@pytest.mark.parametrize("line", LINES)
def test_a_written_script_reads_back_to_the_same_job(line):
    source = launch.read(line).result.launch
    again = launch.read(slurm(line).result).result.launch
    for field in ("nproc_per_node", "script", "script_args", "module", "env"):
        assert getattr(again, field) == getattr(source, field), field
    assert again.nnodes == (source.nnodes or 1)


def test_a_script_as_people_write_it_is_read_with_its_directives_kept():
    script = """#!/bin/bash
#SBATCH -J llama -N 2
#SBATCH --gres=gpu:8 --cpus-per-task=32
#SBATCH --time 24:00:00   # a day
set -euo pipefail
module load cuda/12.4
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun python -m torch.distributed.run --nnodes $SLURM_NNODES --nproc_per_node 8 \\
    --rdzv_backend c10d --rdzv_endpoint "$head_node:29500" train.py --config cfg.yaml
"""
    read = launch.read(script)
    cfg = read.result
    assert (cfg.launch.nnodes, cfg.launch.nproc_per_node, cfg.launch.script) == (2, 8, "train.py")
    kept = {n.source_path: n for n in read.notes if n.source_path.startswith("slurm.")}
    assert set(kept) == {"slurm.job-name", "slurm.nodes", "slurm.gres", "slurm.cpus-per-task", "slurm.time"}
    again = _directives(adapters.write(cfg, "launch", version="slurm").result)
    assert (again["job-name"], again["gres"], again["time"]) == ("llama", "gpu:8", "24:00:00")


def test_an_unknown_directive_is_refused_with_a_suggestion():
    with pytest.raises(ConfigError) as exc:
        launch.read("#!/bin/bash\n#SBATCH --nodez=2\nsrun torchrun train.py\n")
    assert exc.value.problems[0].suggestion == "nodes"
    with pytest.raises(ConfigError, match="no launch command"):
        launch.read("#!/bin/bash\n#SBATCH --nodes=2\necho hello\n")


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="Slurm's sbatch is not installed here (a cluster "
                    "scheduler, not a Python package); the option table is checked against it where it is")
def test_the_option_table_is_sbatchs():
    help_text = subprocess.run(["sbatch", "--help"], capture_output=True, text=True, check=False).stdout
    offered = set(re.findall(r"--([a-z][\w-]+)", help_text))
    assert {"nodes", "ntasks-per-node", "time", "partition", "job-name"} <= offered
    assert not {"nodes", "ntasks-per-node", "time", "partition", "job-name"} - set(SBATCH_OPTIONS)


def test_the_cli_reads_an_sbatch_script_file_and_writes_one(tmp_path, capsys):
    from torsh.cli import main

    script = tmp_path / "job.sbatch"
    assert main(["launch", "torchrun --nnodes 2 --nproc-per-node 4 train.py", "--to", "slurm"]) == 0
    script.write_text(capsys.readouterr().out.split("\n", 1)[1], encoding="utf-8")  # after the "# ---- slurm" line
    assert main(["launch", str(script), "--to", "torchrun"]) == 0
    assert "torchrun --nnodes=2 --nproc-per-node=4" in capsys.readouterr().out
