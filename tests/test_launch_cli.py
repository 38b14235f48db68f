"""``torsh-migrate launch``: the translated commands and the report, without importing torch."""

from __future__ import annotations

import json
import subprocess
import sys

from torsh.cli import main

DS_LINE = "deepspeed --hostfile=hostfile --include=worker-0:1,3@worker-1 train.py --deepspeed_config ds.json"


def test_issue_example_to_every_launcher(capsys):
    line = ("torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=h:29400 train.py "
            "--lr 1e-4")
    for target in ("deepspeed", "horovodrun", "mpirun", "torchrun"):
        assert main(["launch", line, "--to", target]) == 0
        out = capsys.readouterr().out
        assert f"# ---- {target}" in out and "train.py --lr 1e-4" in out
    assert main(["launch", line, "--to", "deepspeed"]) == 0
    out = capsys.readouterr().out
    assert "--master_addr=h --master_port=29400" in out and "# ---- file hostfile:" in out


def test_hostfile_option_and_worker_environments(tmp_path, capsys):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nworker-0 slots=4\n\nworker-1 slots=4\n")
    assert main(["launch", DS_LINE, "--to", "torchrun", "--hostfile", str(hostfile), "--show-env"]) == 0
    out = capsys.readouterr().out
    assert "CUDA_VISIBLE_DEVICES=1,3 torchrun --nnodes=2 --nproc-per-node=2 --node-rank=0" in out
    assert "# worker: RANK=5 LOCAL_RANK=3 WORLD_SIZE=6" in out


def test_argv_after_double_dash_and_json_report(capsys):
    assert main(["launch", "--to", "all", "--report", "json", "--", "horovodrun", "-np", "2", "python", "t.py"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["write"]) == {"torchrun", "deepspeed", "horovodrun", "mpirun"}
    assert data["write"]["torchrun"]["argv"] == [["torchrun", "--nproc-per-node=2", "t.py"]]
    assert data["write"]["horovodrun"]["worker_env"][1]["HOROVOD_RANK"] == "1"


def test_strict_fails_on_a_lossy_translation(capsys):
    assert main(["launch", "deepspeed --num_gpus 2 train.py", "--to", "torchrun", "--strict"]) == 1
    assert "local_rank" in capsys.readouterr().err


def test_user_errors_are_messages_not_tracebacks(capsys):
    assert main(["launch", "torchrun --nproc-per-nod=2 train.py"]) == 2
    err = capsys.readouterr().err
    assert "did you mean '--nproc-per-node'" in err and "Traceback" not in err
    assert main(["launch", "torchrun train.py", "--to", "slurmm"]) == 2
    assert main(["launch", DS_LINE, "--hostfile", "/nonexistent/hostfile"]) == 2


def test_launch_command_does_not_import_torch():
    code = ("import sys; from torsh.cli import main; "
            "main(['launch', 'deepspeed --num_gpus 2 train.py', '--to', 'all']); "
            "print('torch' in sys.modules, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stderr.strip().endswith("False")
