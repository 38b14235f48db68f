"""Rank discovery: every launcher's variables, the declared precedence, and clear errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from torsh.errors import ConfigError
from torsh.ranks import LAUNCHERS, PRECEDENCE, RankInfo, discover, local_rank_from_argv

# What each launcher really exports for one worker (rank 5 of 8, 4 per node, second node).
TORCHRUN = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
            "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "5", "MASTER_ADDR": "node0", "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0"}  # fmt: skip
DEEPSPEED = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_SIZE": "4", "CROSS_RANK": "1",
             "CROSS_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}  # fmt: skip
HOROVOD = {"HOROVOD_RANK": "5", "HOROVOD_SIZE": "8", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "4",
           "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2", "HOROVOD_HOSTNAME": "node1",
           "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.9", "HOROVOD_GLOO_RENDEZVOUS_PORT": "41234",
           "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo"}  # fmt: skip
OPENMPI = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_NODE_RANK": "1"}  # fmt: skip
MPICH = {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}
MVAPICH = {"MV2_COMM_WORLD_RANK": "5", "MV2_COMM_WORLD_SIZE": "8", "MV2_COMM_WORLD_LOCAL_RANK": "1",
           "MV2_COMM_WORLD_LOCAL_SIZE": "4"}  # fmt: skip
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
         "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[003-004]", "SLURM_JOB_ID": "77"}  # fmt: skip

EXPECTED = dict(rank=5, local_rank=1, world_size=8, local_world_size=4, node_rank=1, num_nodes=2)


@pytest.mark.parametrize(
    ("environ", "launcher", "addr", "port"),
    [
        (TORCHRUN, "torchrun", "node0", 29500),
        (DEEPSPEED, "deepspeed", "10.0.0.1", 29500),
        (HOROVOD, "horovodrun", "10.0.0.9", 41234),
        (OPENMPI, "openmpi", None, None),
        (MPICH, "mpich", None, None),
        (MVAPICH, "mvapich", None, None),
        (SLURM, "slurm", "gpu003", None),
    ],
)
def test_each_launcher_vocabulary_gives_the_same_place_in_the_job(environ, launcher, addr, port):
    info = discover(environ, ["train.py"])
    assert info.launcher == launcher
    assert {k: getattr(info, k) for k in EXPECTED} == EXPECTED
    assert (info.master_addr, info.master_port) == (addr, port)


def test_single_process_without_any_launcher():
    info = discover({"PATH": "/usr/bin"}, ["train.py"])
    assert info == RankInfo(0, 0, 1, 1, 0, 1, None, None, "none")
    assert not info.is_distributed


def test_deepspeed_local_rank_comes_from_argv_when_the_environment_lacks_it():
    env = {k: v for k, v in DEEPSPEED.items() if k != "LOCAL_RANK"}
    info = discover(env, ["train.py", "--local_rank=1", "--deepspeed_config", "ds.json"])
    assert info.local_rank == 1
    assert info.sources["local_rank"] == "argv --local_rank"


def test_argv_and_environment_local_rank_must_agree():
    with pytest.raises(ConfigError) as err:
        discover(DEEPSPEED, ["train.py", "--local_rank=3"])
    assert "LOCAL_RANK" in str(err.value) and "--local_rank" in str(err.value)


def test_torch_distributed_launch_is_told_apart_by_its_local_rank_argument():
    assert discover(TORCHRUN, ["train.py", "--local-rank=1"]).launcher == "torch.distributed.launch"
    assert discover(TORCHRUN, ["train.py", "--local-rank", "1"]).launcher == "torch.distributed.launch"
    assert discover(TORCHRUN, ["train.py"]).launcher == "torchrun"


def test_plain_env_variables_without_a_launcher_marker():
    info = discover({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, [])
    assert (info.launcher, info.rank, info.local_world_size, info.node_rank) == ("env", 1, None, None)


def test_deepspeed_cpu_device_count_alone_is_not_the_deepspeed_launcher():
    """LOCAL_SIZE is also what DeepSpeed's CPU accelerator reads as its device count (users export it by hand, and
    DeepSpeed's own serial tests run with it beside WORLD_SIZE=1): with no CROSS_* it says nothing of the job."""
    info = discover({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "2"}, ["x"])
    assert (info.launcher, info.world_size, info.rank) == ("env", 1, 0)


def test_missing_variables_are_named():
    with pytest.raises(ConfigError) as err:
        discover({"RANK": "0"}, ["train.py"])
    text = str(err.value)
    assert "WORLD_SIZE" in text and "LOCAL_RANK" in text and "RANK=0" in text


def test_malformed_values_are_named():
    with pytest.raises(ConfigError) as err:
        discover({**OPENMPI, "OMPI_COMM_WORLD_SIZE": "eight"}, [])
    assert "OMPI_COMM_WORLD_SIZE" in str(err.value) and "eight" in str(err.value)


@pytest.mark.parametrize(
    ("environ", "names"),
    [
        ({**TORCHRUN, "RANK": "8"}, ("RANK", "WORLD_SIZE")),
        ({**DEEPSPEED, "LOCAL_RANK": "4"}, ("LOCAL_RANK", "LOCAL_SIZE")),
        ({**HOROVOD, "HOROVOD_CROSS_RANK": "2"}, ("HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")),
        ({**SLURM, "SLURM_NNODES": "9"}, ("SLURM_NNODES", "SLURM_NTASKS")),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, ("MASTER_PORT",)),
    ],
)
def test_contradictory_values_name_both_variables(environ, names):
    with pytest.raises(ConfigError) as err:
        discover(environ, [])
    for name in names:
        assert name in str(err.value)


def test_precedence_is_the_table_order():
    assert PRECEDENCE == ("torchrun", "deepspeed", "env", "horovodrun", "openmpi", "mvapich", "mpich", "slurm")
    assert PRECEDENCE == tuple(row.name for row in LAUNCHERS)


@pytest.mark.parametrize("higher", range(len(PRECEDENCE)))
def test_each_launcher_beats_every_one_below_it(higher):
    """Nested launchers (srun torchrun, mpirun in sbatch): the higher row wins, the lower is not consulted."""
    by_name = {"torchrun": TORCHRUN, "deepspeed": DEEPSPEED, "horovodrun": HOROVOD, "openmpi": OPENMPI,
               "mvapich": MVAPICH, "mpich": MPICH, "slurm": SLURM,
               "env": {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}}  # fmt: skip
    # A lower launcher describing a different job (one task per node), so a wrong winner is visible.
    lower_job = {"torchrun": {}, "deepspeed": {}, "env": {}, "horovodrun": {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2",
                 "HOROVOD_LOCAL_RANK": "0"}, "openmpi": {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
                 "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, "mvapich": {"MV2_COMM_WORLD_RANK": "0", "MV2_COMM_WORLD_SIZE": "2",
                 "MV2_COMM_WORLD_LOCAL_RANK": "0"}, "mpich": {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0"},
                 "slurm": {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}}  # fmt: skip
    name = PRECEDENCE[higher]
    for lower in PRECEDENCE[higher + 1:]:
        environ = {**lower_job[lower], **by_name[name]}
        info = discover(environ, [])
        assert (info.launcher, info.world_size, info.rank) == (name, 8, 5), (name, lower)


def test_srun_torchrun_nesting():
    environ = {**SLURM, "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
               "SLURM_TASKS_PER_NODE": "1(x2)", **TORCHRUN}  # fmt: skip
    assert discover(environ, []).launcher == "torchrun"


def test_slurm_heterogeneous_tasks_per_node():
    environ = {"SLURM_PROCID": "9", "SLURM_NTASKS": "11", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
               "SLURM_NNODES": "3", "SLURM_TASKS_PER_NODE": "4(x2),3", "SLURM_STEP_NODELIST": "a1,b2"}  # fmt: skip
    info = discover(environ, [])
    assert (info.local_world_size, info.master_addr) == (3, "a1")


def test_mpi_node_rank_is_left_unknown_when_nodes_differ_in_size():
    info = discover({**OPENMPI, "OMPI_COMM_WORLD_SIZE": "7", "OMPI_COMM_WORLD_RANK": "5"}, [])
    assert (info.node_rank, info.num_nodes) == (None, None)


def test_horovod_explicit_master_overrides_the_gloo_rendezvous_server():
    info = discover({**HOROVOD, "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}, [])
    assert (info.master_addr, info.master_port) == ("node0", 29500)
    assert not info.master_is_horovod_rendezvous and info.torch_env()["MASTER_PORT"] == "29500"
    gloo = discover(HOROVOD, [])
    assert gloo.sources["master_port"] == "HOROVOD_GLOO_RENDEZVOUS_PORT" and gloo.master_is_horovod_rendezvous
    assert "MASTER_PORT" not in gloo.torch_env()  # rank 0 cannot bind horovodrun's own server port


def test_torch_env_is_what_init_process_group_reads():
    env = discover(DEEPSPEED, []).torch_env()
    assert env == {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                   "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}  # fmt: skip


def test_local_rank_argv_spellings():
    assert local_rank_from_argv(["x", "--local_rank=2"]) == (2, "--local_rank")
    assert local_rank_from_argv(["x", "--local_rank", "3"]) == (3, "--local_rank")
    assert local_rank_from_argv(["x", "--local-rank=0"]) == (0, "--local-rank")
    assert local_rank_from_argv(["--local_rank=2"]) is None  # argv[0] is the program
    with pytest.raises(ConfigError):
        local_rank_from_argv(["x", "--local_rank=a"])


def test_a_lone_nonzero_local_rank_without_launcher_is_an_error():
    with pytest.raises(ConfigError):
        discover({}, ["train.py", "--local_rank=2"])


def test_discovery_does_not_import_torch():
    code = "import sys, torsh.ranks as r; r.discover({}, []); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
