"""Whole shell and sbatch scripts and Kubeflow PyTorchJob manifests from public repositories (tests/fixtures/corpus/launch/
scripts/, sources in SOURCES.md): each is read with the layout it describes, and written for every launcher and
scheduler without an error; the manifests written are valid PyTorchJobs."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from torsh import adapters
from torsh.adapters import launch
from torsh.errors import ConfigError

from test_launch_kubernetes import pytorchjob_problems

SCRIPTS = Path(__file__).parent / "fixtures" / "corpus" / "launch" / "scripts"
#: file -> what the refusal names: options their launcher no longer has (accelerate 1.15 refuses them too)
REFUSED = {"accelerate-submit-multicpu.sh": "unknown accelerate option (got '--mpirun_ccl')"}
FILES = sorted(f for f in SCRIPTS.iterdir() if f.name not in REFUSED)

#: file -> (script, nnodes, max_nnodes, processes per node, world size) as the file says them
LAYOUT = {
    "pytorch-examples-sbatch-run.sh": ("/shared/examples/multinode_torchrun.py", 4, None, 1, None),  # rdzv id 2024
    "accelerate-submit-multinode.sh": ("$PYTHON_FILE", 4, None, None, "$((SLURM_NNODES * GPUS_PER_NODE))"),
    "accelerate-submit-multigpu.sh": ("/accelerate/examples/complete_nlp_example.py", None, None, None, 4),
    "kubeflow-simple.yaml": ("/opt/mnist/src/mnist.py", 2, None, 1, None),
    "kubeflow-elastic-imagenet.yaml": ("/workspace/examples/imagenet.py", 1, 3, 1, None),
    "kubeflow-deepspeed-demo.yaml": ("/train_bert_ds.py", 2, None, 1, None),
    "kubeflow-cpu-demo.yaml": ("demo.py", 2, None, 2, None),
    "torchtitan-run-train.sh": ("torchtitan.train", None, None, "${NGPU}", None),
    # the launch line in a variable: run_cmd="... deepspeed ..." / CMD="python -m torch.distributed.launch ..."
    "glm-ds-pretrain-nvidia.sh": ("pretrain_glm.py", 32, None, 8, None),
    "glm-ds-finetune-superglue.sh": ("finetune_glm.py", 1, None, 8, None),
    "modelcenter-pretrain-cpm2.sh": ("/mnt/sfs_turbo/ModelCenter/examples/cpm2/pretrain_cpm2.py", 1, None, 8, None),
    "megatron-deepspeed-run-bf16.sh": ("${DIR}/pretrain_gpt.py", 1, None, "$((TP*PP*DP*SP))", None),
}


def test_every_file_has_its_expected_layout():
    assert sorted(LAYOUT) == [f.name for f in FILES]


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_file_its_own_launcher_refuses_is_a_clear_error(name):
    with pytest.raises(ConfigError, match=re.escape(REFUSED[name])):
        launch.read((SCRIPTS / name).read_text())


@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_each_file_reads_as_the_job_it_describes(path):
    L = launch.read(path.read_text()).result.launch
    assert (L.script, L.nnodes, L.max_nnodes, L.nproc_per_node, L.world_size) == LAYOUT[path.name]


@pytest.mark.parametrize("target", launch.VERSIONS)
@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_each_file_is_written_for_every_launcher(path, target):
    read = launch.read(path.read_text()).result
    written = launch.write(read, version=target)
    assert written.result.commands
    if target == "kubernetes":
        assert pytorchjob_problems(yaml.safe_load(str(written.result))) == []
        return
    text = str(written.result)
    syntax = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert syntax.returncode == 0, (text, syntax.stderr)  # what a shell (or sbatch) runs is shell
    for command in written.result.commands:
        if command.argv[0] == "torchrun":  # torchrun's own parser takes each node's line
            pytest.importorskip("torch")
            from torch.distributed import run as torchrun

            args = torchrun.get_args_parser().parse_args([_as_the_shell_gives_it(w) for w in command.argv[1:]])
            assert args.training_script == _as_the_shell_gives_it(read.launch.script)


def _as_the_shell_gives_it(word: str) -> str:
    """A word with its shell variables and arithmetic replaced by a value (1), as torchrun receives it."""
    return re.sub(r"\$\(\(.*?\)\)|\$\{[^}]*\}|\$\w+", "1", word)


@pytest.mark.parametrize("path", [f for f in FILES if f.suffix == ".yaml"], ids=lambda f: f.name)
def test_a_manifest_file_is_recognised_as_a_launch_by_validate(path):
    """As a file (loaded as YAML, then sniffed), a PyTorchJob manifest is the launch dialect, read the same way."""
    from torsh.cli import main

    assert main(["validate", str(path)]) == 0
    from_file = adapters.load(path)
    assert from_file.source == "launch"
    assert from_file.result.launch == launch.read(path.read_text()).result.launch


@pytest.mark.parametrize("path", [f for f in FILES if f.suffix == ".sh"], ids=lambda f: f.name)
def test_a_script_file_is_read_by_validate_and_convert_as_by_launch(path, capsys):
    """validate and convert take an sbatch (or shell) script file as the launch command inside it, as launch does."""
    from torsh.cli import main

    assert main(["validate", str(path)]) == 0
    from_file = adapters.load(path)
    assert from_file.source == "launch"
    assert from_file.result.launch == launch.read(path.read_text()).result.launch
    capsys.readouterr()
    assert main(["convert", str(path), "--to", "launch", "--variant", "torchrun"]) == 0
    # torchrun's spelling kept: `python -m torch.distributed.launch` stays that for the same launcher
    assert re.search(r"(^|\s)(torchrun|python -m torch\.distributed\.(run|launch)) ", capsys.readouterr().out)


def test_a_shell_script_is_read_as_its_launch_line_not_as_one_command():
    """torchtitan's run_train.sh: its earlier lines (shebang, set -ex, variable defaults, a dry-run branch whose
    command sets NGPU for itself) are the script's, not a wrapper of the command nor a value of ${NGPU}."""
    cfg = adapters.load(SCRIPTS / "torchtitan-run-train.sh").result
    assert (cfg.launch.nproc_per_node, cfg.launch.module, cfg.launch.env["PYTORCH_ALLOC_CONF"]) == (
        "${NGPU}", True, "expandable_segments:True")
    assert "wrapper" not in cfg.extensions.get("launch", {})


def test_a_shell_script_without_a_launch_command_is_a_clear_error(tmp_path, capsys):
    from torsh.cli import main

    script = tmp_path / "run.sh"
    script.write_text("#!/bin/bash\necho hello\n")
    assert main(["validate", str(script)]) == 2
    assert "text with no launch command in it" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="no launch command in the script"):
        launch.read(script.read_text())


def test_a_launch_line_held_in_a_variable_is_read_where_the_script_runs_it():
    """GLM's scripts build run_cmd="${OPTIONS_NCCL} deepspeed ..." and run it with eval after echoing it: the NCCL
    variables are the command's environment (echo is not a wrapper); ModelCenter's gathers its options with
    OPTS+=" ..." and runs ${CMD} | tee; Megatron-DeepSpeed's options are appended inside an if, so they stay the
    variable the shell expands."""
    glm = launch.read((SCRIPTS / "glm-ds-pretrain-nvidia.sh").read_text()).result
    assert glm.launch.env == {"NCCL_DEBUG": "info", "NCCL_IB_DISABLE": "0", "NCCL_NET_GDR_LEVEL": "2"}
    assert (glm.launch.hostfile, glm.launch.master_port) == ("/workspace/hostfile", "${MASTER_PORT}")
    assert "wrapper" not in glm.extensions["launch"]
    cpm = launch.read((SCRIPTS / "modelcenter-pretrain-cpm2.sh").read_text()).result
    assert cpm.launch.script_args[-6:] == ["--clip-grad", "1.0", "--loss-scale", "1048576", "--start-step", "110000"]
    assert cpm.extensions["launch"]["redirect"] == "| tee /mnt/sfs_turbo/ModelCenter/logs/cpm2.log"
    megatron = launch.read((SCRIPTS / "megatron-deepspeed-run-bf16.sh").read_text()).result.launch
    assert (megatron.master_port, megatron.script_args) == (29700, ["$@", "${options}"])
