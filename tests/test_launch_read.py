"""Reading launch commands: every launcher's options land in the core model, mistakes are clear errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from adapter_validator import assert_accounted

from torsh import adapters
from torsh.adapters import _cmdline, launch
from torsh.errors import ConfigError
from torsh.launch_args import add_local_rank_argument
from torsh.translate import Fidelity


def read(command, **kw):
    translation = launch.read(command, **kw)
    assert_accounted(_cmdline.parse(command), translation)
    return translation


def test_torchrun_flags_and_both_spellings():
    t = read("torchrun --nnodes=2:4 --nproc_per_node 8 --rdzv-backend=c10d --rdzv_endpoint=h:29400 --rdzv-id=job7 "
             "--rdzv-conf=timeout=900,join_timeout=60 --max-restarts=3 train.py --lr 1e-4")
    L = t.result.launch
    assert (L.nnodes, L.max_nnodes, L.nproc_per_node) == (2, 4, 8)
    assert (L.rdzv_backend, L.rdzv_endpoint, L.rdzv_id) == ("c10d", "h:29400", "job7")
    assert L.rdzv_conf == {"timeout": "900", "join_timeout": "60"} and L.max_restarts == 3
    assert (L.script, L.script_args, L.local_rank_argv) == ("train.py", ["--lr", "1e-4"], None)


def test_argv_list_and_string_read_the_same():
    text = "torchrun --nproc-per-node=2 --master-port 29600 train.py --epochs 3"
    assert launch.read(text).result == launch.read(text.split()).result


def test_python_module_spellings_of_torchrun():
    run = launch.read("python3 -u -m torch.distributed.run --standalone --nproc-per-node=4 -m pkg.train x").result
    assert (run.launch.standalone, run.launch.module, run.launch.script) == (True, True, "pkg.train")
    legacy = launch.read("python -m torch.distributed.launch --nproc_per_node=2 train.py").result
    assert legacy.launch.local_rank_argv == "--local-rank"
    use_env = launch.read("python -m torch.distributed.launch --nproc_per_node=2 --use_env train.py").result
    assert use_env.launch.local_rank_argv is None


def test_deepspeed_flags_and_its_local_rank_argument():
    t = read("deepspeed --hostfile=hf --num_nodes 2 --num_gpus=4 --master_addr=10.0.0.1 --master_port 29700 "
             "--launcher openmpi train.py --deepspeed_config ds.json")
    L = t.result.launch
    assert (L.hostfile, L.nnodes, L.nproc_per_node, L.master_addr, L.master_port) == ("hf", 2, 4, "10.0.0.1", 29700)
    assert L.local_rank_argv == "--local_rank"
    assert t.result.extensions["launch"]["deepspeed.launcher"] == "openmpi"
    no_arg = launch.read("deepspeed --no_local_rank --num_accelerators=2 train.py").result.launch
    assert (no_arg.local_rank_argv, no_arg.nproc_per_node) == (None, 2)


def test_deepspeed_without_a_process_count_uses_every_gpu():
    t = launch.read("deepspeed train.py")
    assert t.result.launch.nproc_per_node == "gpu"
    assert any(n.fidelity is Fidelity.DEFAULTED and n.target_path == "launch.nproc_per_node" for n in t.notes)


def test_deepspeed_no_ssh_needs_node_rank():
    assert launch.read("deepspeed --no_ssh --node_rank=1 --hostfile=h train.py").result.launch.node_rank == 1
    with pytest.raises(ConfigError, match="--node_rank"):
        launch.read("deepspeed --no_ssh --hostfile=h train.py")


def test_deepspeed_hostfile_text_gives_the_hosts():
    text = "# cluster\n\nworker-0 slots=8   # first\nworker-1 slots=8\n"
    L = launch.read("deepspeed --hostfile=/job/hostfile train.py", hostfile=text).result.launch
    assert [(h.name, h.slots) for h in L.hosts] == [("worker-0", 8), ("worker-1", 8)]
    assert L.nproc_per_node is None  # the slots decide, not "every GPU"


def test_horovodrun_flags_and_tunables():
    t = read("horovodrun -np 8 -H a:4,b:4 --gloo --fusion-threshold-mb 32 --cycle-time-ms 2.5 "
             "--hierarchical-allreduce --timeline-filename /tmp/tl.json --gloo-timeout-seconds 60 python train.py")
    cfg = t.result
    assert (cfg.launch.world_size, [h.name for h in cfg.launch.hosts]) == (8, ["a", "b"])
    assert cfg.communication.fusion_threshold_bytes == 32 * 1024 * 1024
    assert (cfg.communication.cycle_time_ms, cfg.communication.hierarchical_allreduce) == (2.5, True)
    assert cfg.monitoring.timeline.filename == "/tmp/tl.json" and cfg.communication.timeout_s == 60
    approximate = {n.source_path for n in t.notes if n.fidelity is Fidelity.APPROXIMATE}
    assert "horovodrun.gloo_timeout_seconds" in approximate


def test_horovodrun_elastic_flags_are_reported_unsupported():
    t = launch.read("horovodrun -np 4 --min-np 2 --max-np 8 --host-discovery-script ./hosts.sh python train.py")
    unsupported = {n.source_path for n in t.notes if n.fidelity is Fidelity.UNSUPPORTED}
    assert {"horovodrun.min_np", "horovodrun.max_np", "horovodrun.host_discovery_script"} <= unsupported


def test_mpirun_exports_and_forwards():
    t = read("mpirun -np 4 -H a:2,b:2 -x NCCL_DEBUG=INFO -x PATH -x MASTER_ADDR=a -x MASTER_PORT=29555 "
             "-bind-to none -map-by slot -mca pml ob1 python -u train.py --x 1")
    L = t.result.launch
    assert L.env == {"NCCL_DEBUG": "INFO"} and L.forward_env == ["PATH"]
    assert (L.master_addr, L.master_port, L.world_size) == ("a", 29555, 4)
    assert (L.script, L.script_args) == ("train.py", ["--x", "1"])
    assert t.result.extensions["launch"]["python_flags"] == ["-u"]


def test_mpirun_round_robin_placement_is_unsupported():
    t = launch.read("mpirun -np 4 --map-by node python train.py")
    assert any(n.source_path == "mpirun.map_by" and n.fidelity is Fidelity.UNSUPPORTED for n in t.notes)


def test_environment_prefix_wrapper_and_redirection_are_kept():
    t = read("NCCL_DEBUG=WARN srun --ntasks-per-node=1 torchrun --nnodes=2 --nproc-per-node=4 train.py > log 2>&1")
    assert t.result.launch.env == {"NCCL_DEBUG": "WARN"}
    ext = t.result.extensions["launch"]
    assert (ext["wrapper"], ext["redirect"]) == ("srun --ntasks-per-node=1", "> log 2>&1")


def test_shell_variables_and_placeholders_are_kept_verbatim():
    L = launch.read("torchrun --nnodes=$NNODES --nproc-per-node=${NGPU} --node-rank=<n> train.py").result.launch
    assert (L.nnodes, L.nproc_per_node, L.node_rank) == ("$NNODES", "${NGPU}", "<n>")


def test_accelerate_launch_topology_is_read_and_training_keys_reported():
    t = read("accelerate launch --config_file fsdp.yaml --num_processes 16 --num_machines 2 --machine_rank 0 "
             "--main_process_ip 10.0.0.1 --main_process_port 29500 --mixed_precision bf16 train.py")
    L = t.result.launch
    assert (L.world_size, L.nnodes, L.node_rank, L.master_addr, L.master_port) == (16, 2, 0, "10.0.0.1", 29500)
    unsupported = {n.source_path for n in t.notes if n.fidelity is Fidelity.UNSUPPORTED}
    assert {"accelerate.config_file", "accelerate.mixed_precision"} <= unsupported


@pytest.mark.parametrize(
    ("command", "message"),
    [
        ("torchrun --nproc-per-nod=2 train.py", "--nproc-per-node"),
        ("deepspeed --num-gpus=2 train.py", "--num_gpus"),
        ("horovodrun -np 2 --fusion-threshold 64 python train.py", "--fusion-threshold-mb"),
        ("torchrun --nproc-per-node=2", "no training script"),
        ("python train.py", "no launcher found"),
        ("torchrun --nproc-per-node='2 train.py", "cannot split"),
        ("torchrun --nproc-per-node=two train.py", "nproc_per_node"),
        ("horovodrun -np 2 -H a:2,a:2 python train.py", "listed twice"),
        ("torchrun --nnodes=4:2 train.py", "smaller than"),
        ("deepspeed --include=a --exclude=b train.py", "cannot both"),
        ("torchrun --nproc-per-node=2 --nproc_per_node=4 train.py", "given twice"),
    ],
)
def test_mistakes_are_one_clear_error(command, message):
    with pytest.raises(ConfigError) as err:
        launch.read(command)
    assert message in str(err.value)


def test_detection_by_content():
    assert launch.sniff("deepspeed --num_gpus 2 train.py") == 1.0
    assert launch.sniff({"train_batch_size": 8}) == 0.0  # a mapping is a config file, never a command
    assert launch.sniff("python train.py") == 0.0
    assert adapters.sniff("horovodrun -np 2 python train.py") == "launch"


@pytest.mark.parametrize("argv", [["--local_rank=3"], ["--local-rank=3"], ["--local_rank", "3"], []])
def test_scripts_accept_every_local_rank_spelling(argv):
    parser = argparse.ArgumentParser()
    add_local_rank_argument(parser, environ={"LOCAL_RANK": "3"} if not argv else {})
    assert parser.parse_args(argv).local_rank == 3


def test_local_rank_helper_falls_back_to_other_launchers():
    parser = argparse.ArgumentParser()
    add_local_rank_argument(parser, environ={"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
                                             "OMPI_COMM_WORLD_LOCAL_RANK": "1"})  # fmt: skip
    assert parser.parse_args([]).local_rank == 1
    parser = argparse.ArgumentParser()
    add_local_rank_argument(parser, environ={})
    assert parser.parse_args([]).local_rank == 0


def test_command_substitutions_stay_one_word_like_in_the_shell():
    t = launch.read('torchrun --nproc_per_node=$NGPUS --master_port=$((RANDOM + 10000)) train.py --tag "$(date +%F)"')
    assert t.result.launch.master_port == "$((RANDOM + 10000))"
    assert t.result.launch.script_args == ["--tag", "$(date +%F)"]
    again = launch.read(str(launch.write(t.result, version="torchrun").result)).result
    assert again.launch == t.result.launch


SCRIPT_LINES = {x["id"]: x["command"] for x in json.loads(
    (Path(__file__).parent / "fixtures" / "corpus" / "launch" / "script_lines.json").read_text(encoding="utf-8"))}


@pytest.mark.parametrize(("line", "variable", "written"), [
    ("aws-dlm-mpirun-1", "${NUM_GPU}", {"mpirun": "-np ${NUM_GPU} -H localhost:${NUM_GPU}",
                                        "horovodrun": "-np ${NUM_GPU} -H localhost:${NUM_GPU}",
                                        "torchrun": "--nproc-per-node=${NUM_GPU}",
                                        "deepspeed": "--num_gpus=${NUM_GPU}"}),
    ("nvidia-dle-horovodrun-1", "${NUM_CORE}", {"horovodrun": "-np ${NUM_CORE} -H localhost:${NUM_CORE}",
                                                "torchrun": "--nproc-per-node=${NUM_CORE}"}),
])  # fmt: skip
def test_a_process_count_in_a_shell_variable_is_deferred_and_written_back_with_the_variable(line, variable, written):
    """`mpirun -np ${NUM_GPU} -H localhost:${NUM_GPU}` as scripts write it: read, the variable named in deferred notes
    (never a number made up), and every launcher gets the variable back where the count goes."""
    t = read(SCRIPT_LINES[line])
    deferred = {n.source_path: n.reason for n in t.notes if n.fidelity is Fidelity.DEFERRED}
    count = next(k for k in deferred if k.endswith((".np", ".num_proc")))
    hosts = next(k for k in deferred if k.endswith(".hosts"))
    assert variable in deferred[count] and variable in deferred[hosts]
    assert t.result.launch.world_size == variable and [h.name for h in t.result.launch.hosts] == ["localhost"]
    for target, expected in written.items():
        out = launch.write(t.result, version=target)
        assert expected in str(out.result), target
        assert not {n.source_path for n in out.lossy} & {"launch.world_size", "launch.hosts"}, target
        again = launch.read(str(out.result).splitlines()[-1]).result.launch
        assert again.world_size == variable or again.nproc_per_node == variable, target


def test_an_entry_point_in_a_shell_variable_is_deferred_and_kept_in_its_place():
    t = read("torchrun --nproc_per_node 8 $ENTRY --arg")
    note = next(n for n in t.notes if n.source_path == "script")
    assert note.fidelity is Fidelity.DEFERRED and "$ENTRY" in note.reason and "entry point" in note.reason
    for target in launch.VERSIONS:
        assert "$ENTRY --arg" in str(launch.write(t.result, version=target).result), target
    verl = read(SCRIPT_LINES["verl-torchrun-3"])
    assert verl.result.launch.script == "${ENTRYPOINT}"
    assert str(launch.write(verl.result, version="torchrun").result).startswith(
        "torchrun --nproc-per-node=${NUM_TRAINERS:-8} --standalone ${ENTRYPOINT} ")


def test_hosts_held_in_a_shell_variable_are_not_turned_into_a_host_name():
    t = read("horovodrun -np $NP -H $HOSTS python train.py")
    assert "$HOSTS" in next(n.reason for n in t.notes if n.source_path == "horovodrun.hosts")
    assert "horovodrun -np $NP -H $HOSTS python train.py" in str(launch.write(t.result, version="horovodrun").result)
    assert "mpirun -np $NP -H $HOSTS " in str(launch.write(t.result, version="mpirun").result)
    for target in ("torchrun", "deepspeed"):
        out = launch.write(t.result, version=target)
        assert {"launch.hosts", "launch.world_size"} <= {n.source_path for n in out.lossy}, target
        assert "hostfile" not in out.result.files


def test_the_scripts_own_arguments_are_written_back_quoted():
    """`"$@"` (torchtitan's run_train.sh) passes each argument of the script unsplit: every launcher writes it so,
    and the note names it."""
    t = read('torchrun --nproc_per_node=${NGPU} -m torchtitan.train --config ${CONFIG} "$@"')
    note = next(n for n in t.notes if n.source_path == "script_args")
    assert note.fidelity is Fidelity.DEFERRED and "$@" in note.reason and "${CONFIG}" in note.reason
    for target in launch.VERSIONS:
        line = str(launch.write(t.result, version=target).result)
        assert line.endswith('--config ${CONFIG} "$@"') or (target in launch.SCHEDULERS and
                                                           '--config ${CONFIG} "$@"' in line), target
        assert launch.read(line).result.launch.script_args == ["--config", "${CONFIG}", "$@"], target
    assert _cmdline.quote("${@:3}") == '"${@:3}"' and _cmdline.quote("$NGPU") == "$NGPU"


def test_the_map_says_where_each_converted_option_goes():
    """Options whose value is converted (numbers, host lists, key=value pairs) still name their core paths; the
    hooks left are keys that set no core field (notes only)."""
    from torsh.translate import Hook

    for key, rule in launch.FIELD_MAP.items():
        if isinstance(rule, Hook) and key not in ("deepspeed.no_ssh", "mpirun.map_by", "accelerate.config_file"):
            assert rule.to and all(p.startswith(("launch.", "communication.", "monitoring.")) for p in rule.to), key
    assert launch.FIELD_MAP["torchrun.nnodes"].to == ("launch.nnodes", "launch.max_nnodes")


def test_horovodrun_log_level_is_horovods_log_level_as_the_horovod_dialect_reads_it():
    """``--log-level`` is HOROVOD_LOG_LEVEL, the ``logging.level`` of Horovod's config file: both dialects give
    ``monitoring.log_level``; horovodrun's argparse takes only the upper-case choices."""
    line = read("horovodrun -np 2 --log-level DEBUG python train.py").result
    config = adapters.read({"logging": {"level": "DEBUG"}}, "horovod").result
    assert line.monitoring.log_level == config.monitoring.log_level == "DEBUG"
    with pytest.raises(ConfigError, match="log-level choices"):
        read("horovodrun -np 2 --log-level debug python train.py")
    written = adapters.write(line, "launch", version="horovodrun").result
    assert "--log-level=DEBUG" in str(written)
