"""Drop-in modules DeepSpeed's unit tests import: the communication logger and ``trim_mean``, the monitors, the
multi-node runners' command lines, the pipeline engine's reentrant-checkpointing question, the fp16 section's
integer fields, and DeepSpeed-Ulysses' ``DistributedAttention``; each checked against real DeepSpeed where that is
cheap."""

from __future__ import annotations

import pytest
import torch

import torsh.compat.deepspeed.comm as ours_comm


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-process gloo group for the test, stopped after it."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def real_deepspeed(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    return pytest.importorskip("deepspeed")


# ---- the communication logger (test_comms_logger.py) -------------------------------------------------------------


def _log_some_collectives(comm, configure) -> dict:
    """The same calls through a ``deepspeed.comm``: what its logger records (by name, size -> count)."""
    configure({"train_batch_size": 1, "comms_logger": {"enabled": True, "prof_all": False,
                                                       "prof_ops": ["all_reduce"]}})  # fmt: skip
    try:
        t = torch.ones(256)
        comm.all_reduce(t)
        comm.all_reduce(t, log_name="custom")  # not in prof_ops: not recorded
        comm.broadcast(t, 0)
        comm.broadcast(t, 0, prof=True)  # this one call is
        comm.inference_all_reduce(t)  # recorded as all_reduce, as DeepSpeed names it
        comm.configure(prof_all=True)
        comm.all_reduce_coalesced([t, t])  # one record of both tensors' bytes
        comm.reduce_scatter_tensor(torch.empty(256), t)
        comm.barrier()
        raw = comm.comms_logger.get_raw_data()
        return {name: {size: record[0] for size, record in sizes.items()} for name, sizes in raw.items()}
    finally:
        comm.configure(enabled=False, prof_all=True, prof_ops=[])
        comm.comms_logger.reset_data()


def test_comms_logger_records_the_collectives_deepspeed_records(one_rank_group, real_deepspeed):
    import deepspeed.comm as theirs_comm
    from deepspeed.runtime.config import DeepSpeedConfig

    theirs_comm.init_distributed(dist_backend="gloo")  # its backend object over the running group
    ours = _log_some_collectives(ours_comm, lambda config: ours_comm.configure(deepspeed_config=config))
    theirs = _log_some_collectives(theirs_comm,
                                   lambda config: theirs_comm.configure(deepspeed_config=DeepSpeedConfig(config)))
    assert ours == theirs == {"all_reduce": {1024: 2, 2048: 1}, "broadcast": {1024: 1},
                              "reduce_scatter_tensor": {1024: 1}, "barrier": {0: 1}}  # fmt: skip


def test_comms_logger_is_off_by_default_and_summarises_without_reordering(one_rank_group, capsys):
    from torsh.compat.deepspeed.utils.comms_logging import CommsLogger, calc_bw_log
    from torsh.compat.deepspeed.utils.timer import trim_mean

    ours_comm.all_reduce(torch.ones(4))
    assert not ours_comm.comms_logger.has_data()
    logger = CommsLogger()
    latencies = [3.0, 1.0, 2.0]
    logger.comms_dict = {"all_reduce": {1024: [3, list(latencies), [10 / x for x in latencies], [1.0, 2.0, 3.0]]}}
    assert logger.get_operation_summary("all_reduce")[1024]["avg_latency_ms"] == 2.0
    assert logger.comms_dict["all_reduce"][1024][1] == latencies
    data = [5.0, 1.0, 9.0, 3.0]
    assert trim_mean(data, 0.25) == 4.0 and data == [5.0, 1.0, 9.0, 3.0]
    summary = logger.log_all(print_log=True, return_dict=True)
    assert summary["summary"]["all_reduce"][1024]["count"] == 3 and "all_reduce" in capsys.readouterr().out
    # 1 MB all-reduced in 1 ms on one rank: 16 Gbit/s of algorithm bandwidth, no bus traffic
    assert calc_bw_log("all_reduce", 1_000_000, 1.0) == (16.0, 0.0)
    with pytest.raises(ValueError, match="no bandwidth formula"):
        calc_bw_log("all_reduce_magic", 1, 1.0)


def test_comms_straggler_refuses_records_that_differ_across_ranks(one_rank_group, monkeypatch):
    import torch.distributed as dist

    from torsh.compat.deepspeed.utils.comms_logging import _stragglers

    snapshot = {"all_reduce": {1024: [2, [1.0, 2.0], [1.0, 1.0], [1.0, 1.0]]}}
    assert _stragglers(snapshot, print_log=False)["all_reduce"][1024]["count"] == 2

    def other_rank_has_more(out, obj, group=None):  # as if a second rank had logged one more call
        out[:] = [obj, [(name, size, count + 1) for name, size, count in obj]]

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object", other_rank_has_more)
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pytest.fail("all-reduce reached with differing records"))
    with pytest.raises(ValueError, match=r"ranks \[1\] differ from rank 0"):
        _stragglers(snapshot, print_log=False)


# ---- fp16 section (test_precision_config_dynamic_scale.py) -------------------------------------------------------


@pytest.mark.parametrize("field", ["loss_scale_window", "min_loss_scale"])
def test_fp16_scale_fields_refuse_a_bool_as_deepspeed_does(field, real_deepspeed):
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config as Theirs
    from pydantic import ValidationError

    from torsh.compat.deepspeed.runtime.precision_config import DeepSpeedFP16Config as Ours

    for cls in (Ours, Theirs):
        for kwargs in ({"enabled": True, "loss_scale": 0}, {"enabled": False, "loss_scale": 128}):
            with pytest.raises(ValidationError, match="not bool"):
                cls(**kwargs, **{field: True})
        assert getattr(cls(enabled=True, loss_scale=0, **{field: 2.0}), field) == 2


# ---- the pipeline engine (test_pipe_module.py) -------------------------------------------------------------------


def test_pipeline_engine_answers_whether_its_checkpoints_are_reentrant(monkeypatch, tmp_path):
    """``engine._reentrant_activation_checkpointing()`` follows the module (its interval, ``set_checkpoint_interval``,
    its function) and ``pipeline.use_reentrant: false`` gives the module DeepSpeed's non-reentrant function."""
    import torsh.compat.deepspeed as deepspeed
    from torsh.compat.deepspeed.pipe import PipelineModule
    from torsh.engine.distributed import shutdown

    from conftest import _free_port

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(_free_port())}.items():  # fmt: skip
        monkeypatch.setenv(key, value)

    def recompute(function, *args):  # a script's own checkpoint function (DeepSpeed's counts as reentrant)
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)

    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "pipeline": {"activation_checkpoint_interval": 0}}
    layers = [torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4)]
    try:
        model = PipelineModule(layers=layers, num_stages=1, activation_checkpoint_func=recompute)
        engine, *_ = deepspeed.initialize(config=config, model=model, model_parameters=list(model.parameters()))
        assert not engine._reentrant_activation_checkpointing()
        engine.module.set_checkpoint_interval(2)
        assert engine._reentrant_activation_checkpointing()
        shutdown()
        config["pipeline"]["use_reentrant"] = False
        model = PipelineModule(layers=layers, num_stages=1, activation_checkpoint_func=recompute)
        engine, *_ = deepspeed.initialize(config=config, model=model, model_parameters=list(model.parameters()))
        engine.module.set_checkpoint_interval(1)
        assert engine.module.activation_checkpoint_func is deepspeed.checkpointing.non_reentrant_checkpoint
        assert not engine._reentrant_activation_checkpointing()
    finally:
        shutdown()


# ---- the monitors (test_monitor.py) ------------------------------------------------------------------------------


def test_monitor_config_and_csv_monitor_as_deepspeeds(tmp_path, real_deepspeed):
    """The four sections read with DeepSpeed's fields and defaults; ``MonitorMaster`` writes DeepSpeed's CSV files
    (through the engine's writer); a writer whose package is missing says what to install."""
    from deepspeed.monitor.config import get_monitor_config as theirs

    from torsh.compat.deepspeed.monitor.config import DeepSpeedMonitorConfig, get_monitor_config
    from torsh.compat.deepspeed.monitor.monitor import MonitorMaster

    config = {"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "run"},
              "wandb": {"group": "g", "team": "t"}, "comet": {"samples_log_interval": 7}}  # fmt: skip
    ours = get_monitor_config(config)
    assert ours.model_dump() == theirs(config).model_dump() and ours.enabled
    from deepspeed.runtime.config import DeepSpeedConfig as TheirConfig

    from torsh.compat.deepspeed.runtime.config import DeepSpeedConfig

    full = {"train_batch_size": 2, **config}  # the config object carries it, as DeepSpeed's (the CSV tests read it)
    assert DeepSpeedConfig(full).monitor_config.model_dump() == TheirConfig(full).monitor_config.model_dump()
    assert not DeepSpeedMonitorConfig().enabled and DeepSpeedMonitorConfig().wandb.project == "deepspeed"
    master = MonitorMaster(ours)
    master.write_events([("Train/Samples/loss", 1.5, 2), ("lr", 0.1, 2)])
    master.write_events([("Train/Samples/loss", 1.25, 4)])
    assert (tmp_path / "run" / "Train_Samples_loss.csv").read_text().split() == ["step,loss", "2,1.5", "4,1.25"]
    assert master.csv_monitor.filenames == ["Train_Samples_loss", "lr"]
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        from torsh.compat.deepspeed.monitor.tensorboard import TensorBoardMonitor

        with pytest.raises(ImportError, match="pip install tensorboard"):
            TensorBoardMonitor(ours.tensorboard)


# ---- the launcher (test_user_args.py, test_run.py) ---------------------------------------------------------------

_LAUNCHES = [("--launcher pdsh --venv_script v.sh --module train.py --prompt 'a b' --q", "PDSHRunner"),
             ("--launcher pdsh --no_local_rank --ssh_port 2222 train.py --x 1", "PDSHRunner"),
             ("--launcher openmpi --launcher_args '--mca btl_tcp_if_include ib0' train.py --x", "OpenMPIRunner"),
             ("--launcher openmpi --no_python run.sh", "OpenMPIRunner"),
             ("--launcher impi train.py --a", "IMPIRunner"),
             ("--launcher slurm -i w1 --launcher_args '-p q' train.py", "SlurmRunner"),
             ("--launcher slurm --num_nodes 2 --num_gpus 2 train.py", "SlurmRunner")]  # fmt: skip


def _commands(runners, runner_module) -> list:
    import os
    import shlex

    out = []
    for argv, name in _LAUNCHES:
        args = runner_module.parse_args(shlex.split(argv))
        args.master_addr = "10.0.0.1"
        cls = getattr(runners, name)
        runner = cls(args, "WORLD") if name == "PDSHRunner" else cls(args, "WORLD", {"w1": 2, "w2": 2})
        runner.add_export("PYTHONPATH", "/usr/lib/python3/site-packages")
        runner.add_export("SLURM_JOB_CPUS_PER_NODE", "64(x2)")
        active = {"w1": [0, 1]} if " -i " in argv else {"w1": [0, 1], "w2": [0, 1]}
        command = runner.get_cmd({}, active)
        if name == "PDSHRunner":  # (command, kill command, environment): the ssh options' spacing differs
            command = [*command[:2], " ".join(command[2].get("PDSH_SSH_ARGS_APPEND", "").split())]
        out.append(repr(command).replace(os.path.dirname(runners.__file__), "<launcher dir>"))
    return out


def test_multinode_runners_build_deepspeeds_command_lines(real_deepspeed, capsys):
    from deepspeed.launcher import multinode_runner as theirs
    from deepspeed.launcher import runner as their_runner

    from torsh.compat.deepspeed.launcher import multinode_runner as ours
    from torsh.compat.deepspeed.launcher import runner as our_runner

    assert _commands(ours, our_runner) == _commands(theirs, their_runner)
    args = our_runner.parse_args(["--launcher", "openmpi", "--num_gpus", "1", "t.py"])
    with pytest.raises(ValueError, match="openmpi backend does not support limiting num nodes/gpus"):
        ours.OpenMPIRunner(args, "WORLD", {"w1": 2})
    with pytest.raises(ValueError, match="slurm backend cannot select specific device ids"):
        ours.SlurmRunner.validate_active_resources({"w1": [1]})


def test_mpich_runner_refuses_and_mvapich_runner_writes_no_file(tmp_path, monkeypatch):
    from torsh.compat.deepspeed.launcher import multinode_runner as ours
    from torsh.compat.deepspeed.launcher import runner as our_runner

    args = our_runner.parse_args(["--launcher", "mpich", "--module", "pkg.train", "--a"])
    args.master_addr = "10.0.0.1"
    with pytest.raises(NotImplementedError, match="torsh run"):
        ours.MPICHRunner(args, "WORLD", {"w1": 2, "w2": 2}).get_cmd({}, {"w1": [0, 1], "w2": [0, 1]})
    args = our_runner.parse_args(["--launcher", "mvapich", "train.py"])
    args.master_addr = "10.0.0.1"
    runner = ours.MVAPICHRunner(args, "WORLD", {"w1": 2, "w2": 2})
    runner.hostfile_path = str(tmp_path / "hosts")
    opened = []
    monkeypatch.setattr("builtins.open", lambda *a, **k: opened.append(a))
    command = runner.get_cmd({}, {"w1": [0, 1], "w2": [0, 1]})
    monkeypatch.undo()
    assert opened == [] and not (tmp_path / "hosts").exists()
    assert command[command.index("--hostfile") + 1] == str(tmp_path / "hosts")
    assert runner.hostfile_lines() == ["w1\n", "w2\n"]


def test_deepspeed_command_refuses_counts_with_filters_then_points_to_torsh_run():
    from torsh.compat.deepspeed.launcher import runner

    for argv in ("--num_nodes 1 -i localhost foo.py", "--num_gpus 1 -e localhost foo.py"):
        with pytest.raises(ValueError, match="Cannot specify num_nodes/gpus with include/exclude"):
            runner.main(argv.split())
    with pytest.raises(SystemExit, match="torsh-migrate launch 'deepspeed --num_gpus 2 foo.py --lr 1'"):
        runner.main("--num_gpus 2 foo.py --lr 1".split())
    with pytest.raises(SystemExit, match="not the deepspeed command's"):
        runner.main(["--no-such-flag"])


# ---- DeepSpeed-Ulysses (test_ulysses.py) -------------------------------------------------------------------------

ULYSSES_WORKER = r'''
import json, os
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
from torsh.compat.deepspeed.sequence.layer import DistributedAttention as Ours
try:
    from deepspeed.sequence.layer import DistributedAttention as Theirs
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
except ImportError:
    Theirs = None


def attention(q, k, v, batch_dim_idx):  # causal attention, key/value heads repeated for grouped queries
    if batch_dim_idx == 1:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                                           is_causal=True).transpose(1, 2)
    return out.transpose(0, 1) if batch_dim_idx == 1 else out


results = {}
cases = {"even": (4, 4, 0), "seq_first": (4, 4, 1), "gqa": (4, 2, 0), "uneven": (3, 3, 0), "uneven_gqa": (6, 3, 1)}
for name, (heads, kv_heads, bdi) in cases.items():
    torch.manual_seed(0)
    lead = (2, 8) if bdi == 0 else (8, 2)
    q, k, v = torch.randn(*lead, heads, 4), torch.randn(*lead, kv_heads, 4), torch.randn(*lead, kv_heads, 4)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*whole, bdi)
    out.sum().backward()
    block = lambda t: t.chunk(world, dim=1 - bdi)[rank]
    reference = [block(out).detach()] + [block(t.grad) for t in whole]
    record = {}
    for label, cls in (("ours", Ours), ("theirs", Theirs)):
        if cls is None or (label == "theirs" and kv_heads % world):  # DeepSpeed's uneven split needs its mpu
            continue
        local = [block(t).clone().requires_grad_() for t in (q, k, v)]
        got = cls(lambda a, b, c: attention(a, b, c, bdi), dist.group.WORLD)(*local, bdi)
        got.sum().backward()
        record[label] = [got.detach()] + [t.grad for t in local]
    results[name] = {label: all(torch.allclose(a, r, atol=1e-5) for a, r in zip(values, reference))
                     for label, values in record.items()}
    if "theirs" in record:
        results[name]["equal_to_deepspeed"] = all(torch.equal(a, b) for a, b in zip(record["ours"], record["theirs"]))
if rank == 0:
    with open(os.environ["OUT"], "w") as handle:
        json.dump(results, handle)
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_ulysses_distributed_attention_equals_one_rank_attention_and_deepspeeds(tmp_path):
    """On 2 ranks: output and input gradients equal causal attention over the whole sequence on one rank (even,
    sequence-first, grouped-query and uneven head counts), and bitwise DeepSpeed's DistributedAttention where
    DeepSpeed runs it without its mpu."""
    import json
    import os
    import subprocess
    import sys

    from conftest import _free_port

    script = tmp_path / "ulysses.py"
    script.write_text(ULYSSES_WORKER)
    env = {**os.environ, "OUT": str(tmp_path / "out.json"), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           # DeepSpeed's prebuilt CPU communication op (two ranks building it at once can collide)
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(sys.prefix,
                                                                                         "torch_extensions")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(_free_port()), str(script)], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((tmp_path / "out.json").read_text())
    assert all(case["ours"] for case in results.values()), results
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return
    assert {name for name, case in results.items() if case.get("equal_to_deepspeed")} == {"even", "seq_first", "gqa"}
    assert all(case.get("theirs", True) for case in results.values()), results


def test_ulysses_head_split_groups_and_refusals(one_rank_group):
    from torsh.compat.deepspeed.runtime.sequence_parallel import parallel_state_sp as sp
    from torsh.compat.deepspeed.sequence import fpdt_layer
    from torsh.compat.deepspeed.sequence.layer import DistributedAttention, head_counts

    assert head_counts(7, 4) == [2, 2, 2, 1] and head_counts(14, 4, num_kv_heads=7) == [4, 4, 4, 2]
    assert head_counts(8, 2, num_kv_heads=2) == [4, 4]
    with pytest.raises(ValueError, match="sequence_parallel_size must be greater than 1"):
        sp.initialize_sequence_parallel(1)
    with pytest.raises(RuntimeError, match="less than sequence_parallel_size"):
        sp.initialize_sequence_parallel(2)
    with pytest.raises(RuntimeError, match="not initialized"):
        sp.get_sequence_parallel_group()
    one = DistributedAttention(lambda q, k, v: q + k + v, torch.distributed.group.WORLD)
    x = torch.randn(2, 3, 2, 4)
    assert torch.equal(one(x, x, x, 0), 3 * x)  # one rank: the local attention itself
    with pytest.raises(ValueError, match="4-D tensors"):
        one(x[0], x[0], x[0], 0)
    with pytest.raises(ValueError, match="batch_dim_idx must be 0"):
        one(x, x, x, 2)
    with pytest.raises(fpdt_layer.NotSupportedByTorsh, match="DistributedAttention"):
        fpdt_layer._FPDTGPUOffloadingAttentionImpl_.apply(x)


def test_initialize_sets_the_communication_logger_from_the_config(one_rank_group, monkeypatch):
    """DeepSpeed's engine reads ``comms_logger`` when it is built: collectives after ``initialize`` are recorded."""
    from torsh.compat import deepspeed as drop_in

    monkeypatch.setattr(ours_comm.comms_logger, "enabled", False)
    model = torch.nn.Linear(2, 2)
    drop_in.initialize(model=model, model_parameters=model.parameters(),
                       config={"train_batch_size": 1, "comms_logger": {"enabled": True}})  # fmt: skip
    assert ours_comm.comms_logger.enabled
