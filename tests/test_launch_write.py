"""Writing a job for each launcher: the commands, the notes on what a launcher cannot say, the worker variables."""

from __future__ import annotations

import shlex

import pytest
from adapter_validator import Lossy, validate_all

from torsh.adapters import launch
from torsh.config import TorshConfig
from torsh.errors import ConfigError
from torsh.ranks import discover
from torsh.translate import Fidelity

HOSTFILE = "worker-0 slots=4\nworker-1 slots=4\n"


def cfg_of(command: str, hostfile: str | None = None) -> TorshConfig:
    return launch.read(command, hostfile=hostfile).result


def fidelity(translation, path: str) -> set[Fidelity]:
    return {n.fidelity for n in translation.notes if n.source_path == path}


def test_deepspeed_hostfile_job_becomes_one_torchrun_per_node():
    cfg = cfg_of("deepspeed --hostfile=hostfile --master_port=29600 train.py --deepspeed_config ds.json", HOSTFILE)
    out = launch.write(cfg, version="torchrun")
    assert [c.host for c in out.result.commands] == ["worker-0", "worker-1"]
    assert [list(c.argv) for c in out.result.commands] == [
        ["torchrun", "--nnodes=2", "--nproc-per-node=4", f"--node-rank={i}", "--master-addr=worker-0",
         "--master-port=29600", "train.py", "--deepspeed_config", "ds.json"] for i in range(2)]  # fmt: skip
    assert Fidelity.APPROXIMATE in fidelity(out, "launch.local_rank_argv")  # the script lost --local_rank
    assert "torsh.launch_args" in next(n.reason for n in out.notes if n.source_path == "launch.local_rank_argv")


def test_device_filters_become_cuda_visible_devices_for_torchrun():
    cfg = cfg_of("deepspeed --hostfile=hostfile --include=worker-0:1,3@worker-1 train.py", HOSTFILE)
    out = launch.write(cfg, version="torchrun")
    first, second = out.result.commands
    assert first.env == {"CUDA_VISIBLE_DEVICES": "1,3"} and "--nproc-per-node=2" in first.argv
    assert second.env == {} and "--nproc-per-node=4" in second.argv
    assert fidelity(out, "launch.include") == {Fidelity.APPROXIMATE}
    validate_all(cfg, write={"launch": Lossy({"launch.include": "approximate"})})


def test_device_filters_horovodrun_cannot_express_per_host():
    cfg = cfg_of("deepspeed --hostfile=hostfile --include=worker-0:1,3@worker-1 train.py", HOSTFILE)
    out = launch.write(cfg, version="horovodrun")
    assert fidelity(out, "launch.include") == {Fidelity.UNSUPPORTED}
    same = cfg_of("deepspeed --hostfile=hostfile --include=worker-0:1,3@worker-1:1,3 train.py", HOSTFILE)
    out = launch.write(same, version="horovodrun")
    assert out.result.commands[0].env == {"CUDA_VISIBLE_DEVICES": "1,3"}
    assert "-H worker-0:2,worker-1:2" in out.result


def test_elastic_range_only_torchrun_can_express():
    cfg = cfg_of("torchrun --nnodes=2:4 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=h:29400 train.py")
    assert "--nnodes=2:4" in launch.write(cfg, version="torchrun").result
    for target in ("horovodrun", "deepspeed", "mpirun"):
        out = launch.write(cfg, version=target)
        assert fidelity(out, "launch.max_nnodes") == {Fidelity.UNSUPPORTED}, target
    hvd = launch.write(cfg, version="horovodrun")
    assert "--host-discovery-script" in next(n.reason for n in hvd.notes if n.source_path == "launch.max_nnodes")


def test_torchrun_script_under_deepspeed_gets_no_local_rank_argument():
    out = launch.write(cfg_of("torchrun --nproc-per-node=2 train.py"), version="deepspeed")
    # LOCAL_WORLD_SIZE: torchrun's workers had it, deepspeed sets only LOCAL_SIZE (tests/test_consumer_launch.py)
    assert str(out.result) == "LOCAL_WORLD_SIZE=2 deepspeed --num_gpus=2 --no_local_rank train.py"
    assert fidelity(out, "launch.local_rank_argv") == {Fidelity.EXACT}
    again = launch.read(str(out.result))  # read back, it is the process count again, not a user variable
    assert "LOCAL_WORLD_SIZE" not in again.result.launch.env and again.result.launch.nproc_per_node == 2


def test_c10d_endpoint_becomes_deepspeed_master_address():
    cfg = cfg_of("torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=h0:29400 train.py")
    out = launch.write(cfg, version="deepspeed")
    assert "--master_addr=h0" in out.result and "--master_port=29400" in out.result
    assert out.result.files["hostfile"] == "<host-0> slots=8\n<host-1> slots=8\n"
    assert fidelity(out, "launch.rdzv_endpoint") == {Fidelity.APPROXIMATE}


def test_multi_node_deepspeed_exports_environment_through_deepspeed_env():
    cfg = cfg_of("mpirun -np 8 -H a:4,b:4 -x NCCL_DEBUG=INFO -x MY_FLAG=1 -x LD_LIBRARY_PATH python train.py")
    out = launch.write(cfg, version="deepspeed")
    assert out.result.files[".deepspeed_env"] == "NCCL_DEBUG=INFO\nMY_FLAG=1\nLD_LIBRARY_PATH=${LD_LIBRARY_PATH}\n"
    assert out.result.files["hostfile"] == "a slots=4\nb slots=4\n"
    assert fidelity(out, "launch.forward_env") >= {Fidelity.APPROXIMATE}


def test_fewer_processes_than_slots_selects_the_first_slots():
    cfg = cfg_of("horovodrun -np 6 -H a:4,b:4 python train.py")
    out = launch.write(cfg, version="deepspeed")
    assert "--include=a:0,1,2,3@b:0,1" in out.result
    torchrun = launch.write(cfg, version="torchrun").result
    assert [c.argv[2] for c in torchrun.commands] == ["--nproc-per-node=4", "--nproc-per-node=2"]


def test_horovod_tunables_survive_only_to_horovodrun():
    cfg = cfg_of("horovodrun -np 2 --fusion-threshold-mb 32 --cycle-time-ms 3 --hierarchical-allreduce python t.py")
    out = launch.write(cfg, version="horovodrun")
    argv = out.result.commands[0].argv
    assert {"--fusion-threshold-mb=32", "--cycle-time-ms=3", "--hierarchical-allreduce"} <= set(argv)
    assert not out.lossy
    torchrun = launch.write(cfg, version="torchrun")
    assert fidelity(torchrun, "communication.fusion_threshold_bytes") == {Fidelity.UNSUPPORTED}


def test_unknown_hosts_give_one_command_per_node_with_node_rank_to_fill_in():
    cfg = cfg_of("deepspeed --num_nodes=2 --num_gpus=8 train.py")
    out = launch.write(cfg, version="torchrun")
    assert "--node-rank=$NODE_RANK" in out.result and "--master-addr=$MASTER_ADDR" in out.result
    assert Fidelity.APPROXIMATE in fidelity(out, "launch.nnodes")


def test_horovodrun_and_mpirun_run_python_themselves():
    cfg = cfg_of("torchrun --nproc-per-node=2 -m pkg.train --x 1")
    assert shlex.split(launch.write(cfg, version="horovodrun").result) == [
        "horovodrun", "-np", "2", "python", "-m", "pkg.train", "--x", "1"]  # fmt: skip
    mpi = shlex.split(launch.write(cfg, version="mpirun").result)
    assert mpi[:3] == ["mpirun", "-np", "2"] and "MASTER_ADDR=127.0.0.1" in mpi and mpi[-4:] == [
        "-m", "pkg.train", "--x", "1"]  # fmt: skip


def test_a_config_without_a_script_cannot_be_a_command():
    with pytest.raises(ConfigError, match="launch.script"):
        launch.write(TorshConfig(), version="torchrun")


def test_unknown_target_is_an_error():
    with pytest.raises(ConfigError, match="torchrun"):
        launch.write(cfg_of("torchrun train.py"), version="pbs")


@pytest.mark.parametrize("target", launch.VERSIONS)
def test_every_worker_environment_is_understood_by_rank_discovery(target):
    """What each launcher would export, fed to torsh.ranks.discover, gives every worker its own place."""
    cfg = cfg_of("deepspeed --hostfile=hostfile --master_port=29600 train.py", HOSTFILE)
    envs = launch.worker_environments(cfg, target)
    assert len(envs) == 8
    for rank, env in enumerate(envs):
        argv = ["train.py", f"--local_rank={env['LOCAL_RANK']}"] if target == "deepspeed" else ["train.py"]
        info = discover(env, argv)
        assert (info.rank, info.world_size, info.local_rank) == (rank, 8, rank % 4)
        assert (info.node_rank, info.num_nodes, info.local_world_size) == (rank // 4, 2, 4)
        if target != "horovodrun":
            assert (info.master_addr, info.master_port) == ("worker-0", 29600)


def test_worker_environment_needs_a_known_process_count():
    with pytest.raises(ConfigError, match="not known"):
        launch.worker_environments(cfg_of("torchrun --nproc-per-node=gpu train.py"))
