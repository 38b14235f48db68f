"""Launch lines held in shell variables: ``run_cmd="... deepspeed ..."`` then ``eval ${run_cmd}``, ``CMD="torchrun
..."`` then ``$CMD``, ``cmd=(torchrun ...)`` then ``"${cmd[@]}"``, options gathered with ``OPTS+=...``. The scripts
here are written for these tests in the shapes public training scripts use (real ones are in
tests/fixtures/corpus/launch/scripts/, read by test_launch_scripts_corpus.py)."""

from __future__ import annotations

import contextlib
import io

import pytest

from torsh.adapters import launch
from torsh.errors import ConfigError

#: The line GLM's pretraining scripts build (THUDM/GLM scripts/ds_pretrain_*.sh), alone.
GLM_LINE = ('run_cmd="${OPTIONS_NCCL} deepspeed --master_port ${MASTER_PORT} --hostfile ${HOST_FILE_PATH} '
            'pretrain_glm.py ${gpt_options} --deepspeed_config ${config_json}"')  # fmt: skip

GLM_SCRIPT = f"""#! /bin/bash
NUM_WORKERS=2
OPTIONS_NCCL="NCCL_DEBUG=info NCCL_IB_DISABLE=0 NCCL_NET_GDR_LEVEL=2"
HOST_FILE_PATH="/workspace/hostfile"
config_json="$script_dir/config_tasks/config_blocklm_10B.json"
{GLM_LINE}
echo ${{run_cmd}}
eval ${{run_cmd}}
set +x
"""


def cli(*argv: str) -> tuple[int, str]:
    from torsh.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(list(argv))
    return code, out.getvalue()


def test_the_glm_line_alone_is_read_from_the_value_it_assigns():
    cfg = launch.read(GLM_LINE).result
    L = cfg.launch
    assert (L.script, L.master_port, L.hostfile) == ("pretrain_glm.py", "${MASTER_PORT}", "${HOST_FILE_PATH}")
    assert L.script_args == ["${gpt_options}", "--deepspeed_config", "${config_json}"]
    assert cfg.extensions["launch"]["wrapper"] == "${OPTIONS_NCCL}"  # unknown here: kept in front, as written


def test_the_glm_script_runs_its_variable_through_eval_with_the_nccl_variables_as_its_environment():
    read = launch.read(GLM_SCRIPT)
    L, kept = read.result.launch, read.result.extensions["launch"]
    assert L.env == {"NCCL_DEBUG": "info", "NCCL_IB_DISABLE": "0", "NCCL_NET_GDR_LEVEL": "2"}
    assert "wrapper" not in kept  # neither the echo that prints the line nor the eval that runs it
    assert L.script_args[-2:] == ["--deepspeed_config", "$script_dir/config_tasks/config_blocklm_10B.json"]
    deferred = {n.source_path: n.reason for n in read.notes if n.fidelity.value == "deferred"}
    assert "${MASTER_PORT}" in deferred["deepspeed.master_port"]


@pytest.mark.parametrize("text", [GLM_LINE, GLM_SCRIPT], ids=["line", "script"])
def test_the_glm_shape_translates_with_the_cli(text, tmp_path):
    path = tmp_path / "ds_pretrain.sh"
    path.write_text(text)
    code, out = cli("launch", str(path), "--to", "torchrun")
    assert code == 0
    command = next(line for line in out.splitlines() if line.startswith(("torchrun", "NCCL_DEBUG")))
    assert "torchrun" in command and "pretrain_glm.py" in command and "--master-port=${MASTER_PORT}" in command


@pytest.mark.parametrize("run", ["$CMD", "${CMD}", 'eval "$CMD"', "eval ${CMD}", "exec $CMD"])
def test_a_command_in_a_variable_is_found_where_it_is_run(run):
    script = f'#!/bin/bash\nGPUS=8\nCMD="torchrun --nproc_per_node $GPUS train.py --lr 1e-4"\necho "$CMD"\n{run}\n'
    L = launch.read(script).result.launch
    assert (L.nproc_per_node, L.script, L.script_args) == (8, "train.py", ["--lr", "1e-4"])


def test_options_appended_with_plus_equals_reach_the_script():
    script = ('#!/bin/bash\nOPTS=""\nOPTS+=" --batch-size 4"\nOPTS+=" --lr 0.25"\n'
              'CMD="torchrun --nproc_per_node 2 pretrain.py ${OPTS}"\n${CMD} | tee log.txt\n')  # fmt: skip
    read = launch.read(script)
    assert read.result.launch.script_args == ["--batch-size", "4", "--lr", "0.25"]
    assert read.result.extensions["launch"]["redirect"] == "| tee log.txt"


ARRAY_SCRIPT = """#!/usr/bin/env bash
NPROC=4
SCRIPT="scripts/train.py"
cmd=(torchrun --nproc_per_node="$NPROC" "$SCRIPT"
  task="a b"   # one word with a space
  +exp=train
)
cmd+=(--resume --tag "run 1")
echo ">>> ${cmd[*]}"; "${cmd[@]}"
"""


def test_a_command_array_keeps_each_word():
    L = launch.read(ARRAY_SCRIPT).result.launch
    assert (L.nproc_per_node, L.script) == (4, "scripts/train.py")
    assert L.script_args == ["task=a b", "+exp=train", "--resume", "--tag", "run 1"]


def test_a_command_array_run_by_exec_is_found():
    script = 'NPROC=2\nCMD=(torchrun --standalone --nproc_per_node="${NPROC}" train.py)\nexec "${CMD[@]}"\n'
    L = launch.read(script).result.launch
    assert (L.standalone, L.nproc_per_node, L.script) == (True, 2, "train.py")


def test_a_variable_run_inside_a_function_is_still_found():
    """The line that runs it names a function: the assigned value is the launch command."""
    script = ('#!/bin/bash\nrun() {\n  eval "$1"\n}\n'
              'run_cmd="deepspeed --num_gpus 2 --master_port 29700 train.py --deepspeed_config ds.json"\n'
              'run "$run_cmd"\n')  # fmt: skip
    L = launch.read(script).result.launch
    assert (L.nproc_per_node, L.master_port, L.script) == (2, 29700, "train.py")


def test_a_launcher_head_and_a_script_in_two_variables_are_joined():
    script = ('#!/bin/bash\nDISTRIBUTED_ARGS="deepspeed --num_nodes 1 --num_gpus 8"\n'
              'run_cmd="${DISTRIBUTED_ARGS} finetune.py --fp16"\neval ${run_cmd}\n')  # fmt: skip
    L = launch.read(script).result.launch
    assert (L.nnodes, L.nproc_per_node, L.script, L.script_args) == (1, 8, "finetune.py", ["--fp16"])


def test_a_variable_given_a_substitution_later_is_not_expanded_with_its_old_value():
    script = 'PORT=29500\nPORT=$(shuf -n 1 -i 10000-65535)\nCMD="torchrun --master_port $PORT x.py"\n$CMD\n'
    assert launch.read(script).result.launch.master_port == "$PORT"


def test_a_refused_launch_in_a_variable_is_the_error():
    script = 'CMD="torchrun --nproc_per_node 2 --no-such-option x.py"\neval $CMD\n'
    with pytest.raises(ConfigError, match="unknown torchrun option"):
        launch.read(script)


def test_variables_without_a_launch_command_are_no_launch():
    with pytest.raises(ConfigError, match="no launch command in the script"):
        launch.read('OPTS="--lr 1"\nCMD="python train.py $OPTS"\necho $CMD\n')


def test_a_value_set_inside_an_if_stays_the_variable_the_shell_expands():
    """Which branch runs is known only when the script runs: the value before the block is not the answer either."""
    script = ('#!/bin/bash\nLAYERS=24\nif [[ $DEBUG == 1 ]]; then\n  LAYERS=4\nfi\nNGPU=8\n'
              'CMD="torchrun --nproc_per_node $NGPU train.py --num-layers $LAYERS"\n$CMD\n')  # fmt: skip
    L = launch.read(script).result.launch
    assert (L.nproc_per_node, L.script_args) == (8, ["--num-layers", "$LAYERS"])


def test_a_launch_command_set_in_a_branch_is_found_when_nothing_else_runs_one():
    script = ('#!/bin/bash\nif [[ $NGPUS -gt 1 ]]; then\n  CMD=(torchrun --standalone --nproc_per_node=4 train.py)\n'
              'else\n  CMD=(python train.py)\nfi\n"${CMD[@]}" --epochs 3\n')  # fmt: skip
    L = launch.read(script).result.launch
    assert (L.standalone, L.nproc_per_node, L.script) == (True, 4, "train.py")


def test_a_quoted_value_over_several_lines_is_one_value():
    script = 'OPTS="--lr 1\n  --epochs 2\n"\nCMD="torchrun --nproc_per_node 2 train.py $OPTS"\n$CMD\n'
    assert launch.read(script).result.launch.script_args == ["--lr", "1", "--epochs", "2"]
