"""The ``launch`` dialect: torchrun, the deepspeed launcher, horovodrun and mpirun command lines.

Reading: a command (a string, split like a shell, or an argv list) becomes a mapping (``_cmdline.parse``:
``{"torchrun": {"nnodes": "2", ...}, "script": ..., "script_args": [...], "env": {...}}``) that ``FIELD_MAP``
translates into the core model's ``launch`` and ``communication`` sections, one note per option. Accepted:
``torchrun``, ``python -m torch.distributed.run`` / ``.launch``, ``tune run``, ``deepspeed``, ``horovodrun``,
``mpirun``/``mpiexec`` (Open MPI) and ``accelerate launch`` (its launch options; the config file it names is
another dialect). ``VAR=value`` prefixes, a wrapper such as ``srun`` and a trailing redirection are kept.

Writing: ``write(cfg, version="torchrun" | "deepspeed" | "horovodrun" | "mpirun")`` returns a Translation whose
result is a :class:`~torsh.adapters._launch_writers.LaunchCommand` - a ``str`` (one line per node when every
node runs its own command) that also carries each node's argv, files to create (hostfile, ``.deepspeed_env``)
and, through :func:`worker_environments`, the environment every worker gets. What a launcher cannot express is a
note naming the closest equivalent.

Reading is pure: a hostfile named by the command is read only when its text is passed (``hostfile=``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torsh.adapters import _cmdline
from torsh.adapters._hostfile import parse_host_list, parse_hostfile
from torsh.adapters._launch_writers import SCHEDULERS, WRITERS, LaunchCommand, worker_environments
from torsh.concepts.launch import DEFAULT_LOCAL_RANK_ARGV, HOROVOD_LOG_LEVELS, LOCAL_RANK_VARIABLE, shell_references
from torsh.config import TorshConfig
from torsh.dialect import Dialect, Prepared
from torsh.errors import ConfigError
from torsh.translate import (
    Fidelity,
    Hook,
    Ignored,
    Note,
    ReadContext,
    Translation,
    Unsupported,
    check_version,
)

NAME = "launch"
VERSIONS = tuple(WRITERS)
"""Write targets; the first is the default. Reading accepts every launcher (the version is not needed)."""
WRITE_TARGETS = VERSIONS
"""FIELD_MAP is sectioned by launcher; each section's reverse map is checked on its own."""

__all__ = ["NAME", "FIELD_MAP", "VALUE_MAPS", "ALIASES", "LaunchCommand", "SCHEDULERS", "read", "write", "sniff",
           "worker_environments"]  # fmt: skip


# --------------------------------------------------------------------------------------------------
# hooks: what a one-to-one map cannot say


def _number(text: Any) -> Any:
    """``"8"`` -> 8; shell variables and placeholders stay strings (the core model keeps them verbatim)."""
    if isinstance(text, str) and text.strip().isdigit():
        return int(text)
    if isinstance(text, str):
        try:
            return float(text)
        except ValueError:
            return text
    return text


@dataclass(frozen=True)
class Via(Hook):
    """A map entry whose value is converted on its way to the core paths ``to`` (a number from text, a host list,
    ``key=value`` pairs): the map still says where the key goes."""

    to: tuple[str, ...] = ()


def via(read: Callable[[Any, ReadContext, str], None], *to: str) -> Via:
    return Via(read=read, to=to)


def Int(path: str, fidelity: Fidelity = Fidelity.EXACT, reason: str = "") -> Via:  # noqa: N802 - a map value
    """A numeric option: digits become a number, ``$VAR`` stays verbatim."""
    return via(lambda value, ctx, src: ctx.set(path, _number(value), src, fidelity, reason), path)


def _nnodes(value: Any, ctx: ReadContext, path: str) -> None:
    low, sep, high = str(value).partition(":")
    ctx.set("launch.nnodes", _number(low), path)
    if sep and high != low:
        ctx.set("launch.max_nnodes", _number(high), path, note=False)


def _rdzv_conf(value: Any, ctx: ReadContext, path: str) -> None:
    conf = {}
    for item in filter(None, str(value).split(",")):
        key, eq, val = item.partition("=")
        if not eq:
            ctx.problem(path, value, f"cannot read {item!r}; expected key=value[,key=value]")
            return
        conf[key.strip()] = val.strip()
    ctx.set("launch.rdzv_conf", conf, path)


def _hosts(value: Any, ctx: ReadContext, path: str) -> None:
    """``-H host:N,...``; slots held in a shell variable are left to the launcher (the writers give a single host
    the process count again, ``-H localhost:$N`` with ``-np $N``), and the note names the variable."""
    hosts = parse_host_list(str(value), source=path)
    in_names = shell_references([h for h, _ in hosts])
    in_slots = [s for _, s in hosts if isinstance(s, str)]
    why = [f"holds {', '.join(in_names)}: expanded by the shell that runs the command; kept verbatim"
           ] if in_names else []  # fmt: skip
    why += [f"slots in {', '.join(dict.fromkeys(in_slots))}, known when the shell runs the command: left to the "
            "launcher (a single host's are written back as the process count)"] if in_slots else []
    ctx.set("launch.hosts", [{"name": h, "slots": s if isinstance(s, int) else None} for h, s in hosts], path,
            Fidelity.DEFERRED if why else Fidelity.EXACT, "; ".join(why))


def _hostfile_hosts(value: Any, ctx: ReadContext, path: str) -> None:
    ctx.set("launch.hosts", value, path, reason="read from the hostfile's text")


def _env(value: Any, ctx: ReadContext, path: str) -> None:
    ds = ctx.raw.get("deepspeed")
    if path == "env.LOCAL_WORLD_SIZE" and isinstance(ds, Mapping) and str(ds.get("num_gpus")) == str(value):
        # what a torchrun job's workers had, set in front of deepspeed (which sets only LOCAL_SIZE) by the deepspeed
        # writer: every launcher torsh writes for provides it, so it is the process count, not a user variable
        ctx.note(path, Fidelity.EXACT, "LOCAL_WORLD_SIZE equal to --num_gpus: the processes per node", value)
        return
    ctx.set(f"launch.env.{path.split('.', 1)[1]}", str(value), path, reason="exported to every worker")


def _mpirun_x(value: Any, ctx: ReadContext, path: str) -> None:
    forward = []
    for item in value:
        name, eq, val = item.partition("=")
        if eq and name in ("MASTER_ADDR", "MASTER_PORT"):  # the rendezvous torch's env:// reads under mpirun
            ctx.set(f"launch.{name.lower()}", _number(val), path, note=False)
        elif eq:
            ctx.set(f"launch.env.{name}", val, path, note=False)
        else:
            forward.append(name)
    if forward:
        ctx.set("launch.forward_env", forward, path, note=False)
    ctx.note(path, Fidelity.EXACT, "NAME=value -> launch.env, NAME -> launch.forward_env", value, "launch.env")


def _mpirun_map_by(value: Any, ctx: ReadContext, path: str) -> None:
    ctx.keep(path, value)
    if str(value).split(":")[0].lower() == "node":
        ctx.note(path, Fidelity.UNSUPPORTED, "round-robin placement (rank i on node i mod N); the other launchers "
                 "place ranks node by node", value)  # fmt: skip
    else:
        ctx.note(path, Fidelity.IGNORED, "process placement within the block-by-node order the other launchers use",
                 value)  # fmt: skip


def _switch(path: str, value: bool, reason: str = "") -> Via:
    return via(lambda v, ctx, src: ctx.set(path, value, src, reason=reason), path)


def _horovod_log_level(value: Any, ctx: ReadContext, path: str) -> None:
    """HOROVOD_LOG_LEVEL, as the horovod dialect reads ``logging.level``; horovodrun refuses other levels."""
    if shell_references(str(value)) or value in HOROVOD_LOG_LEVELS:
        ctx.set("monitoring.log_level", value, path, reason="HOROVOD_LOG_LEVEL")
    else:
        ctx.problem(path, value, f"horovodrun's --log-level choices are {', '.join(HOROVOD_LOG_LEVELS)} (upper "
                    "case: horovodrun refuses any other spelling)")


def _fusion_mb(value: Any, ctx: ReadContext, path: str) -> None:
    try:
        mb = float(value)
    except (TypeError, ValueError):
        mb = math.nan
    if not math.isfinite(mb) or not 0 <= mb <= 2**20:  # up to 1 TiB, the model's bound on byte sizes
        ctx.problem(path, value, "a fusion buffer size in MB: a number from 0 to 1048576")
        return
    ctx.set("communication.fusion_threshold_bytes", int(mb * 1024 * 1024), path,
            reason="MB x 1048576 (HOROVOD_FUSION_THRESHOLD)")  # fmt: skip


def _gpu_ids(value: Any, ctx: ReadContext, path: str) -> None:
    if str(value) == "all":
        ctx.note(path, Fidelity.EXACT, "all devices: the default", value)
        return
    ctx.set("launch.env.CUDA_VISIBLE_DEVICES", str(value), path, Fidelity.APPROXIMATE,
            "accelerate sets CUDA_VISIBLE_DEVICES from --gpu_ids")  # fmt: skip


def _no_ssh(value: Any, ctx: ReadContext, path: str) -> None:
    if "node_rank" not in ctx.raw.get("deepspeed", {}):
        ctx.problem(path, value, "--no_ssh runs the command on every node and needs --node_rank")
        return
    ctx.note(path, Fidelity.EXACT, "each node runs the command itself: implied by launch.node_rank", value,
             "launch.node_rank")  # fmt: skip


def _local_rank_argv(flag: str | None, reason: str) -> Via:
    path = "launch.local_rank_argv"
    return via(lambda v, ctx, src: ctx.set(path, flag, src, reason=reason), path)


_KEEP = "no effect on what runs where; kept for a round trip to the same launcher"
_ELASTIC_HVD = "elastic Horovod (host discovery); torchrun's elastic range is per node: --nnodes=MIN:MAX"
_TRAINING = "a training setting, not a launch one: convert the accelerate config with `torsh-migrate convert`"
#: accelerate launch options that carry a training setting (what the accelerate config dialect reads), by prefix.
_ACCELERATE_TRAINING = ("mixed_precision", "dynamo_", "use_", "deepspeed_config_file", "zero", "offload_",
                        "gradient_", "deepspeed_moe", "fsdp_", "megatron_lm_", "fp8_", "parallelism_config_",
                        "downcast_bf16")  # fmt: skip

#: Source path (``launcher.option_dest``) -> core path or status. Unlisted options are rejected when parsing.
FIELD_MAP = {
    # ---- every launcher
    "script": "launch.script",
    "script_args": "launch.script_args",
    "env.*": via(_env, "launch.env"),
    "launcher": Ignored("the launcher the command was written for; its own options are written back only to it"),
    "program": Ignored("the launcher's spelling; written back for the same launcher"),
    "wrapper": Ignored("a wrapper in front of the launcher (srun, nohup); written back for the same launcher"),
    "redirect": Ignored("a shell redirection; written back after every translated command"),
    "python": Ignored("the Python executable; written back where the launcher runs a command"),
    "python_flags": Ignored("flags of the Python interpreter; written back where the launcher runs a command"),
    "hostfile_hosts": via(_hostfile_hosts, "launch.hosts"),
    # ---- torchrun / python -m torch.distributed.run / .launch / tune run
    "torchrun.nnodes": via(_nnodes, "launch.nnodes", "launch.max_nnodes"),
    "torchrun.nproc_per_node": Int("launch.nproc_per_node"),
    "torchrun.node_rank": Int("launch.node_rank"),
    "torchrun.master_addr": "launch.master_addr",
    "torchrun.master_port": Int("launch.master_port"),
    "torchrun.rdzv_backend": "launch.rdzv_backend",
    "torchrun.rdzv_endpoint": "launch.rdzv_endpoint",
    "torchrun.rdzv_id": "launch.rdzv_id",
    "torchrun.rdzv_conf": via(_rdzv_conf, "launch.rdzv_conf"),
    "torchrun.standalone": "launch.standalone",
    "torchrun.max_restarts": Int("launch.max_restarts"),
    "torchrun.module": "launch.module",
    "torchrun.no_python": "launch.no_python",
    "torchrun.use_env": _local_rank_argv(None, "--use-env: the script reads LOCAL_RANK, no --local-rank argument"),
    "torchrun.run_path": Unsupported("runs the script in the agent's interpreter (runpy); others start Python"),
    "torchrun.virtual_local_rank": Unsupported("every worker sees LOCAL_RANK=0 and one device; no other launcher "
                                               "does this"),
    "torchrun.numa_binding": Unsupported("NUMA binding of workers; deepspeed --bind_cores_to_rank is the closest"),
    **{f"torchrun.{k}": Ignored(_KEEP) for k in (
        "monitor_interval", "start_method", "event_log_handler", "role", "log_dir", "redirects", "tee",
        "local_ranks_filter", "duplicate_stdout_filters", "duplicate_stderr_filters", "local_addr", "logs_specs",
        "signals_to_handle", "shutdown_timeout")},
    # ---- deepspeed
    "deepspeed.hostfile": "launch.hostfile",
    "deepspeed.include": "launch.include",
    "deepspeed.exclude": "launch.exclude",
    "deepspeed.num_nodes": Int("launch.nnodes", reason="the first N hosts of the hostfile"),
    "deepspeed.num_gpus": Int("launch.nproc_per_node", reason="slots 0..N-1 on every node"),
    "deepspeed.master_addr": "launch.master_addr",
    "deepspeed.master_port": Int("launch.master_port"),
    "deepspeed.node_rank": Int("launch.node_rank"),
    "deepspeed.no_ssh": Hook(read=_no_ssh),
    "deepspeed.module": "launch.module",
    "deepspeed.no_python": "launch.no_python",
    "deepspeed.no_local_rank": _local_rank_argv(None, "the script reads LOCAL_RANK, no --local_rank argument"),
    "deepspeed.launcher": Ignored("how deepspeed reaches the other nodes (pdsh, openmpi, slurm, ...)"),
    "deepspeed.launcher_args": Unsupported("arguments for deepspeed's multi-node backend (pdsh/mpirun/srun)"),
    "deepspeed.autotuning": Unsupported("DeepSpeed's autotuner runs experiments before training"),
    "deepspeed.bind_cores_to_rank": Unsupported("CPU core binding (sets OMP_NUM_THREADS); torchrun "
                                                "--numa-binding is the closest"),
    "deepspeed.bind_core_list": Unsupported("CPU cores to bind to"),
    **{f"deepspeed.{k}": Ignored(_KEEP) for k in (
        "no_ssh_check", "force_multi", "save_pid", "enable_each_rank_log", "ssh_port", "venv_script", "log_level",
        "quiet")},
    # ---- horovodrun
    "horovodrun.num_proc": Int("launch.world_size"),
    "horovodrun.hosts": via(_hosts, "launch.hosts"),
    "horovodrun.hostfile": "launch.hostfile",
    "horovodrun.fusion_threshold_mb": via(_fusion_mb, "communication.fusion_threshold_bytes"),
    "horovodrun.cycle_time_ms": Int("communication.cycle_time_ms"),
    "horovodrun.hierarchical_allreduce": "communication.hierarchical_allreduce",
    "horovodrun.no_hierarchical_allreduce": _switch("communication.hierarchical_allreduce", False),
    "horovodrun.hierarchical_allgather": "communication.hierarchical_allgather",
    "horovodrun.no_hierarchical_allgather": _switch("communication.hierarchical_allgather", False),
    "horovodrun.timeline_filename": "monitoring.timeline.filename",
    "horovodrun.timeline_mark_cycles": "monitoring.timeline.mark_cycles",
    "horovodrun.gloo_timeout_seconds": Int("communication.timeout_s", Fidelity.APPROXIMATE,
                                           "Horovod's Gloo context timeout; the process-group timeout is closest"),
    "horovodrun.tcp": via(lambda v, ctx, src: ctx.set("launch.env.NCCL_IB_DISABLE", "1", src, Fidelity.APPROXIMATE,
                                                      "NCCL_IB_DISABLE=1; horovodrun also limits MPI to TCP"),
                          "launch.env.NCCL_IB_DISABLE"),
    "horovodrun.config_file": Unsupported("Horovod tunables in YAML: convert it with `torsh-migrate convert`"),
    **{f"horovodrun.{k}": Unsupported(_ELASTIC_HVD) for k in (
        "min_np", "max_np", "slots", "elastic_timeout", "reset_limit", "blacklist_cooldown_range",
        "host_discovery_script")},
    **{f"horovodrun.{k}": Ignored("Horovod's controller: how horovodrun starts processes; torch.distributed "
                                  "takes its backend from communication.backend") for k in ("gloo", "mpi", "jsrun")},
    **{f"horovodrun.{k}": Ignored(_KEEP) for k in (
        "disable_cache", "start_timeout", "network_interfaces", "network_interface", "output_filename", "verbose",
        "ssh_port", "ssh_identity_file", "cache_capacity", "torus_allreduce", "no_torus_allreduce", "autotune",
        "autotune_log_file", "autotune_warmup_samples", "autotune_steps_per_sample",
        "autotune_bayes_opt_max_samples", "autotune_gaussian_process_noise", "no_stall_check",
        "stall_check_warning_time_seconds", "stall_check_shutdown_time_seconds", "mpi_threads_disable",
        "mpi_args", "binding_args", "num_nccl_streams", "thread_affinity", "log_without_timestamp",
        "prefix_output_with_timestamp", "no_autotune", "stall_check", "no_mpi_threads_disable", "log_with_timestamp")},
    "horovodrun.no_timeline_mark_cycles": _switch("monitoring.timeline.mark_cycles", False),
    **{f"horovodrun.{k}": Unsupported(f"horovodrun --{k.replace('_', '-')} prints Horovod's "
                                      f"{'build' if k == 'check_build' else 'version'} and exits: no job runs")
       for k in ("check_build", "version")},
    "horovodrun.log_level": via(_horovod_log_level, "monitoring.log_level"),
    "horovodrun.module": "launch.module",
    # ---- an sbatch script's directives (the launch command inside it is read as above)
    "slurm.nodes": Ignored("the job's node count: torchrun's --nnodes reads it ($SLURM_NNODES)"),
    "slurm.*": Ignored("a Slurm scheduling setting (sbatch); kept for a Slurm script"),
    # ---- a Kubeflow PyTorchJob manifest (its pods' command is read as above)
    "kubernetes.*": Ignored("the PyTorchJob's container image or name; kept for a manifest"),
    "horovodrun.no_python": "launch.no_python",
    # ---- mpirun (Open MPI)
    "mpirun.np": Int("launch.world_size"),
    "mpirun.hosts": via(_hosts, "launch.hosts"),
    "mpirun.hostfile": "launch.hostfile",
    "mpirun.x": via(_mpirun_x, "launch.env", "launch.forward_env", "launch.master_addr", "launch.master_port"),
    "mpirun.npernode": Int("launch.nproc_per_node"),
    "mpirun.map_by": Hook(read=_mpirun_map_by),
    "mpirun.mca": Ignored("an Open MPI transport setting; NCCL and Gloo do not use MPI's transports"),
    **{f"mpirun.{k}": Ignored(_KEEP) for k in (
        "bind_to", "rank_by", "report_bindings", "display_map", "tag_output", "timestamp_output",
        "output_filename", "oversubscribe", "allow_run_as_root", "wdir", "prefix", "quiet", "verbose", "mpi_args",
        "launch_agent")},
    "mpirun.module": "launch.module",
    "mpirun.no_python": "launch.no_python",
    # ---- accelerate launch (its launch options; the rest belongs to the accelerate config dialect)
    "accelerate.num_processes": Int("launch.world_size", reason="accelerate counts processes on all machines"),
    "accelerate.num_machines": Int("launch.nnodes"),
    "accelerate.machine_rank": Int("launch.node_rank"),
    "accelerate.main_process_ip": "launch.master_addr",
    "accelerate.main_process_port": Int("launch.master_port"),
    "accelerate.rdzv_backend": "launch.rdzv_backend",
    "accelerate.max_restarts": Int("launch.max_restarts"),
    "accelerate.module": "launch.module",
    "accelerate.no_python": "launch.no_python",
    "accelerate.gpu_ids": via(_gpu_ids, "launch.env.CUDA_VISIBLE_DEVICES"),
    "accelerate.config_file": Hook(read=lambda v, c, p: c.note(p, Fidelity.EXACT, "read: its process and machine "
                                   "counts, its master address and the environment accelerate launch gives the "
                                   "processes are carried (the file is opened from the working directory, as "
                                   "accelerate launch does)", v)),
    "accelerate.rdzv_conf": via(_rdzv_conf, "launch.rdzv_conf"),
    "accelerate.deepspeed_hostfile": "launch.hostfile",
    "accelerate.mpirun_hostfile": "launch.hostfile",
    "accelerate.deepspeed_inclusion_filter": "launch.include",
    "accelerate.deepspeed_exclusion_filter": "launch.exclude",
    "accelerate.deepspeed_multinode_launcher": Ignored("how deepspeed reaches the other nodes (pdsh, openmpi, ...)"),
    **{f"accelerate.{k}": Unsupported(_TRAINING) for k in _cmdline.ACCELERATE_SWITCHES + _cmdline.ACCELERATE_VALUED
       if k.startswith(_ACCELERATE_TRAINING)},
    **{f"accelerate.{k}": Ignored(_KEEP) for k in (
        "multi_gpu", "cpu", "same_network", "monitor_interval", "num_cpu_threads_per_process", "quiet", "debug",
        "tee", "log_dir", "role", "main_training_function", "enable_cpu_affinity", "aws_access_key_id",
        "aws_secret_access_key")},
    **{f"accelerate.{k}": Ignored("a TPU setting; kept for a round trip to accelerate launch") for k in (
        "tpu", "tpu_use_cluster", "no_tpu_cluster", "tpu_use_sudo", "vm", "env")},
}  # fmt: skip
VALUE_MAPS: dict[str, dict[Any, Any]] = {}
ALIASES: dict[str, str] = {}  # option spellings are resolved by the parser tables (_cmdline)

#: What accelerate launch (1.15) exports for an FSDP job, from each fsdp_config key, and the launcher's default for a
#: key the file leaves out (``accelerate/commands/launch.py`` argument defaults, ``utils/launch.py`` environment).
_FSDP_ENV = {"fsdp_sharding_strategy": ("FSDP_SHARDING_STRATEGY", "FULL_SHARD"),
             "fsdp_reshard_after_forward": ("FSDP_RESHARD_AFTER_FORWARD", "true"),
             "fsdp_offload_params": ("FSDP_OFFLOAD_PARAMS", "false"),
             "fsdp_min_num_params": ("FSDP_MIN_NUM_PARAMS", "100000000"),
             "fsdp_auto_wrap_policy": ("FSDP_AUTO_WRAP_POLICY", None),
             "fsdp_transformer_layer_cls_to_wrap": ("FSDP_TRANSFORMER_CLS_TO_WRAP", None),
             "fsdp_backward_prefetch": ("FSDP_BACKWARD_PREFETCH", None),
             "fsdp_state_dict_type": ("FSDP_STATE_DICT_TYPE", None),
             "fsdp_forward_prefetch": ("FSDP_FORWARD_PREFETCH", "false"),
             "fsdp_use_orig_params": ("FSDP_USE_ORIG_PARAMS", "true"),
             "fsdp_cpu_ram_efficient_loading": ("FSDP_CPU_RAM_EFFICIENT_LOADING", "true"),
             "fsdp_sync_module_states": ("FSDP_SYNC_MODULE_STATES", "true"),
             "fsdp_activation_checkpointing": ("FSDP_ACTIVATION_CHECKPOINTING", "false"),
             "fsdp_activation_checkpointing_offload": ("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "false")}  # fmt: skip
#: The accelerate config's launch keys and the core fields they set (unless the command line gives them).
_ACCELERATE_LAUNCH_KEYS = {"num_processes": "launch.world_size", "num_machines": "launch.nnodes",
                           "machine_rank": "launch.node_rank", "main_process_ip": "launch.master_addr",
                           "main_process_port": "launch.master_port", "rdzv_backend": "launch.rdzv_backend"}


def _from_config_file(key: str, value: Any, options: Mapping[str, Any]) -> bool:
    """A launch key of the accelerate config applies unless the command line gives it (num_processes -1 or 0:
    accelerate counts the devices)."""
    return key not in options and value is not None and not (key == "num_processes" and value in (-1, 0))


def _accelerate_config_file(name: str, options: dict, ctx: ReadContext) -> dict | None:
    """``accelerate launch --config_file X``: the launch settings the file gives; returns the file's content (None
    when it cannot be read)."""
    from pathlib import Path

    from torsh.formats import is_regular_file, load_file

    if not is_regular_file(name):
        ctx.notes[:] = [n for n in ctx.notes if n.source_path != "accelerate.config_file"]
        ctx.note("accelerate.config_file", Fidelity.UNSUPPORTED, "not found from the working directory (accelerate "
                 "launch opens it from there): its process count, machines and the environment it gives the "
                 "processes are not carried; translate from the folder that holds it", name)  # fmt: skip
        return None
    try:
        data, _ = load_file(Path(name).expanduser())
    except ConfigError as exc:
        ctx.problems.extend(exc.with_prefix("accelerate.config_file").problems)
        return None
    if not isinstance(data, dict) or "distributed_type" not in data:
        ctx.problem("accelerate.config_file", name, "not an accelerate config (no distributed_type)")
        return None
    for key, core in _ACCELERATE_LAUNCH_KEYS.items():
        if _from_config_file(key, data.get(key), options):
            ctx.set(core, data[key], f"{name}:{key}", Fidelity.EXACT, "from the accelerate config file")
    return data


def _accelerate_environment(name: str | None, data: dict | None, options: dict, ctx: ReadContext) -> None:
    """The variables accelerate launch exports to the processes (its Accelerator reads them), from the config file
    ``name`` (``data``) and the command line, which wins over the file."""
    env = _accelerate_env(data or {}, options)
    carried = {dest for _, dest in env.values() if dest}
    # an option accelerate turns into a variable is carried by it (not the "training setting" note of the map)
    ctx.notes[:] = [n for n in ctx.notes if n.source_path.removeprefix("accelerate.") not in carried]
    for var, (value, dest) in env.items():
        source = f"accelerate.{dest}" if dest else f"{name}:{var}"
        ctx.set(f"launch.env.{var}", value, source, Fidelity.EXACT, "exported by accelerate launch: the script's "
                "Accelerator reads it")  # fmt: skip
    if env.get("ACCELERATE_MIXED_PRECISION", ("", None))[0] == "fp8":
        ctx.note("accelerate.mixed_precision", Fidelity.UNSUPPORTED, "fp8: accelerate launch also exports its "
                 "ACCELERATE_FP8_* settings, which are not carried", "fp8")  # fmt: skip


#: accelerate launch's DeepSpeed settings (an option, or a key of the config file's deepspeed_config) that
#: ``prepare_deepspeed_cmd_env`` (accelerate 1.15 ``utils/launch.py``) exports when set; True: lower-cased.
_DEEPSPEED_LOWER = {"zero_stage": False, "gradient_accumulation_steps": False, "gradient_clipping": True,
                    "offload_optimizer_device": True, "offload_param_device": True, "zero3_init_flag": True,
                    "zero3_save_16bit_model": True, "deepspeed_config_file": False,
                    "deepspeed_moe_layer_cls_names": False}  # fmt: skip
#: accelerate launch's switches that choose the kind of job (the config file's distributed_type applies without).
_MODE_SWITCHES = ("multi_gpu", "tpu", "tpu_use_cluster", "use_deepspeed", "use_fsdp", "use_megatron_lm")


def _is_deepspeed_job(data: dict, options: Mapping[str, Any]) -> bool:
    """accelerate launch runs its DeepSpeed launcher: --use_deepspeed, or a DEEPSPEED config file and no other mode
    switch; not with --cpu (``launch_command``)."""
    if options.get("cpu"):
        return False
    if options.get("use_deepspeed"):
        return True
    kind = str(data.get("distributed_type", "NO")).upper()
    return kind == "DEEPSPEED" and not any(options.get(k) for k in _MODE_SWITCHES)


def _text(value: Any, lower: bool = False) -> str:
    """A value as accelerate launch writes it into the environment (booleans lower-cased, as str(value).lower())."""
    return str(value).lower() if lower or isinstance(value, bool) else str(value)


def _given(key: str, options: Mapping[str, Any], section: Mapping[str, Any],
           lower: bool) -> tuple[str, str | None] | None:  # fmt: skip
    """A setting the command line gives (it wins) or the config file's section does: (text, the option or None)."""
    if options.get(key) is not None:
        return _text(options[key], lower), key
    if section.get(key) is not None:
        return _text(section[key], lower), None
    return None


def _switched(key: str, var: str, on: str, data: dict,
              options: Mapping[str, Any]) -> dict[str, tuple[str, str | None]]:  # fmt: skip
    """A switch exported as ``var`` when the command line or the file sets it truthy."""
    if options.get(key) or data.get(key):
        return {var: (on, key if options.get(key) else None)}
    return {}


def _precision_env(data: dict, options: Mapping[str, Any], lower: bool) -> tuple[str, str | None]:
    """ACCELERATE_MIXED_PRECISION: the command line wins over the file (prepare_multi_gpu_env), "no" without."""
    if options.get("mixed_precision"):
        return _text(options["mixed_precision"], lower), "mixed_precision"
    return _text(data.get("mixed_precision") or "no", lower), None


def _accelerate_env(data: dict, options: Mapping[str, Any]) -> dict[str, tuple[str, str | None]]:
    """The ACCELERATE_* / FSDP_* variables accelerate launch exports for this config and command line (FSDP,
    DeepSpeed and precision): variable -> (value, the option that gave it, None for the config file)."""
    kind = str(data.get("distributed_type", "NO")).upper()
    if _is_deepspeed_job(data, options):
        return _deepspeed_env(data, options, kind)
    env = {"ACCELERATE_MIXED_PRECISION": _precision_env(data, options, lower=False)}
    return {**env, **_fsdp_env(data)} if kind == "FSDP" else env


def _deepspeed_env(data: dict, options: Mapping[str, Any], kind: str) -> dict[str, tuple[str, str | None]]:
    """launch_command / _validate_launch_command: the file's deepspeed_config keys become the options unless the
    command line gives them; the precision too, and ACCELERATE_CONFIG_DS_FIELDS lists what came from the file."""
    ds = dict(data.get("deepspeed_config") or {}) if kind == "DEEPSPEED" or data else {}
    from_file = not options.get("mixed_precision") and data.get("mixed_precision") is not None
    env = {"ACCELERATE_MIXED_PRECISION": _precision_env(data, options, lower=True),
           **_switched("debug", "ACCELERATE_DEBUG_MODE", "true", data, options),
           "ACCELERATE_CONFIG_DS_FIELDS": (",".join([*ds, *["mixed_precision"] * from_file]).lower(), None),
           "ACCELERATE_USE_DEEPSPEED": ("true", "use_deepspeed" if options.get("use_deepspeed") else None)}
    for key, lower in _DEEPSPEED_LOWER.items():
        found = _given(key, options, ds, lower)
        if found is not None:
            env[_cmdline.ACCELERATE_OPTION_ENV[key]] = found
    return {**env, **_switched("enable_cpu_affinity", "ACCELERATE_CPU_AFFINITY", "1", data, options)}


def _fsdp_env(data: dict) -> dict[str, tuple[str, str | None]]:
    """The FSDP plugin's variables from the file's fsdp_config (with or without the fsdp_ prefix)."""
    fsdp = {k if k.startswith("fsdp_") else f"fsdp_{k}": v for k, v in (data.get("fsdp_config") or {}).items()}
    env = {"ACCELERATE_USE_FSDP": ("true", None), "FSDP_VERSION": (_text(fsdp.get("fsdp_version", 1)), None)}
    for key, (var, default) in _FSDP_ENV.items():
        value = fsdp.get(key, default)
        if value is not None:
            env[var] = (_text(value), None)
    return env


class Launch(Dialect):
    """Launch command lines. Its input is text: the shape stage parses the command (``_cmdline.parse``) into a
    mapping ``{launcher: {dest: value}, script, script_args, env, ...}`` that the map walks."""

    NAME = NAME
    VERSIONS = VERSIONS
    FIELD_MAP = FIELD_MAP
    VALUE_MAPS = VALUE_MAPS
    ALIASES = ALIASES

    def read(self, raw: str | Sequence[str], *, version: str | None = None, hostfile: str | None = None,
             base_dir: Any = None) -> Translation[TorshConfig]:  # fmt: skip
        """Read a launch command (a string split like a shell, or argv) into the core model.

        ``hostfile`` is the *text* of the hostfile the command names (or of one to use), read with both grammars.
        ``version`` is accepted for the registry's signature; any launcher is read.
        """
        if version is not None:
            check_version(NAME, version, VERSIONS)
        parsed = self.shape(raw)
        if hostfile is not None:
            named = parsed[parsed["launcher"]].get("hostfile", "hostfile")
            parsed["hostfile_hosts"] = [{"name": h, "slots": s} for h, s in parse_hostfile(hostfile, source=named)]
        return super().read(parsed)

    def check_version(self, version: str | None) -> str | None:
        return version  # reading takes every launcher; the version names a write target

    def shape(self, raw: Any) -> Any:
        if _cmdline.is_pytorchjob(raw):
            return _cmdline.parse_pytorchjob(raw)
        if isinstance(raw, Mapping):
            return raw
        return _cmdline.parse_script(raw) if _cmdline.is_script(raw) else _cmdline.parse(raw)

    def check_schema(self, raw: Any) -> None:
        """The command-line parser has checked the text (the launch schema describes the text, not its parse)."""

    def finalize(self, ctx: ReadContext, prepared: Prepared) -> None:
        launcher = ctx.raw["launcher"]
        options = ctx.raw[launcher]
        if launcher == "accelerate" and options.get("config_file"):
            name = str(options["config_file"])
            data = _accelerate_config_file(name, options, ctx)
            if data is not None:
                _accelerate_environment(name, data, options, ctx)
        elif launcher == "accelerate" and _is_deepspeed_job({}, options):
            _accelerate_environment(None, None, options, ctx)
        if launcher == "accelerate":
            _free_port(ctx)
        _default_process_count(launcher, options, ctx)
        _local_rank_argument(launcher, ctx.raw.get("program", launcher), options, ctx)

    def finish(self, translation: Translation[TorshConfig], prepared: Prepared) -> Translation[TorshConfig]:
        translation.notes[:] = [_deferred_if_shell(note) for note in translation.notes]
        return translation

    def write(self, cfg: TorshConfig, *, version: str | None = None) -> Translation[LaunchCommand]:
        """The job as a command for one launcher (default torchrun), with a note for everything it cannot express."""
        target = check_version(NAME, version, VERSIONS)
        command, notes = WRITERS[target](cfg)
        return Translation(command, notes, "torsh", target)

    def sniff(self, raw: Any) -> float:
        """A command string or argv naming a launcher, a shell or sbatch script running one, or a Kubeflow
        PyTorchJob manifest; no other mapping (those are config files)."""
        if _cmdline.is_pytorchjob(raw) or _cmdline.is_sbatch(raw):
            return 1.0
        if isinstance(raw, str) or (isinstance(raw, (list, tuple)) and raw and all(isinstance(t, str) for t in raw)):
            try:
                _cmdline.parse_script(raw) if _cmdline.is_script(raw) else _cmdline.parse(raw)
            except Exception:  # noqa: BLE001 - sniffing must never raise
                return 0.0
            return 1.0
        return 0.0


def _free_port(ctx: ReadContext) -> None:
    """accelerate's main_process_port 0 (the file's or the option's) means "a free port" (``get_free_port``); a
    torchrun port 0 would reach the processes as MASTER_PORT=0. On one machine that is torchrun's --standalone
    (its own free port); on several there is no free-port equivalent (accelerate would pick one per machine)."""
    launch_core = ctx.core.get("launch", {})
    if launch_core.get("master_port") != 0:
        return
    source = ctx.origin.get("launch.master_port", "accelerate.main_process_port")
    del launch_core["master_port"]
    ctx.notes[:] = [n for n in ctx.notes if n.target_path != "launch.master_port"]
    if launch_core.get("nnodes", 1) in (1, None):
        ctx.set("launch.standalone", True, source, Fidelity.EXACT, "main_process_port 0: a free port on this "
                "machine, as torchrun --standalone picks one")  # fmt: skip
    else:
        ctx.note(source, Fidelity.UNSUPPORTED, "main_process_port 0 picks a free port on each machine; give the "
                 "nodes one port", 0)  # fmt: skip


def _default_process_count(launcher: str, options: Mapping[str, Any], ctx: ReadContext) -> None:
    """The count a launcher uses when the command gives none (deepspeed: every visible accelerator; torchrun: 1)."""
    if launcher == "deepspeed" and not ({"num_gpus", "include", "exclude"} & set(options)) and not (
            "hostfile_hosts" in ctx.raw):
        ctx.set("launch.nproc_per_node", "gpu", "deepspeed.num_gpus", Fidelity.DEFAULTED,
                "not set: deepspeed starts one process per visible accelerator on each node")
    if launcher == "torchrun" and "nproc_per_node" not in options:
        ctx.set("launch.nproc_per_node", 1, "torchrun.nproc_per_node", Fidelity.DEFAULTED,
                "not set: torchrun starts one process per node")


def _local_rank_argument(launcher: str, program: str, options: Mapping[str, Any], ctx: ReadContext) -> None:
    """Whether the launcher appends a local-rank argument to the script's, or the script reads a variable."""
    flag = DEFAULT_LOCAL_RANK_ARGV.get(program)
    if flag and not options.get("no_local_rank") and not options.get("use_env"):
        ctx.set("launch.local_rank_argv", flag, program, reason=f"{program} appends {flag}=N to the script's "
                "arguments: the script must accept it (torsh.launch_args.add_local_rank_argument)")
    elif not flag:
        ctx.note(program, Fidelity.EXACT, f"{program} passes no local-rank argument: the script reads "
                 f"{LOCAL_RANK_VARIABLE[launcher]}", None, "launch.local_rank_argv")


def _deferred_if_shell(note: Note) -> Note:
    """A value that holds a shell variable or substitution is only known when the script runs: its note says
    which variables (DEFERRED when it was carried exactly; a lossy note keeps its fidelity)."""
    names = shell_references(note.value)
    if not names:
        return note
    why = f"holds {', '.join(names)}: expanded by the shell that runs the command; kept verbatim"
    if note.source_path == "script" and names == [note.value]:
        why += " (in the entry point's place: the script or module, perhaps with launcher options; written back there)"
    reason = f"{note.reason}; {why}" if note.reason else why
    fidelity = Fidelity.DEFERRED if note.fidelity is Fidelity.EXACT else note.fidelity
    return replace(note, fidelity=fidelity, reason=reason)



DIALECT = Launch()
globals().update(DIALECT.exports())
