"""Launch command lines -> a plain mapping the launch dialect's FIELD_MAP reads.

A command is split into: ``VAR=value`` prefixes (``env``), a wrapper in front of the launcher (``srun``,
``nohup``), the launcher's program tokens (``torchrun``, ``python -m torch.distributed.run``, ``deepspeed``,
``horovodrun``, ``mpirun``, ``tune run``, ``accelerate launch``), its options, the training script with its
arguments, and a trailing shell redirection (``&> log``). Each launcher's options are one table below
(spelling -> destination name, number of values); an option not in the table is a ConfigError with a
did-you-mean, because guessing its arity would misplace the script.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torsh.errors import ConfigError, Problem, did_you_mean

# (destination, number of values); 0 = a switch. Destinations are the launcher's own argparse dests.
_TORCHRUN_FLAGS = {
    "--nnodes": ("nnodes", 1), "--nproc-per-node": ("nproc_per_node", 1), "--rdzv-backend": ("rdzv_backend", 1),
    "--rdzv-endpoint": ("rdzv_endpoint", 1), "--rdzv-id": ("rdzv_id", 1), "--rdzv-conf": ("rdzv_conf", 1),
    "--standalone": ("standalone", 0), "--max-restarts": ("max_restarts", 1),
    "--monitor-interval": ("monitor_interval", 1), "--start-method": ("start_method", 1),
    "--event-log-handler": ("event_log_handler", 1), "--role": ("role", 1), "-m": ("module", 0),
    "--module": ("module", 0), "--no-python": ("no_python", 0), "--run-path": ("run_path", 0),
    "--log-dir": ("log_dir", 1), "-r": ("redirects", 1), "--redirects": ("redirects", 1), "-t": ("tee", 1),
    "--tee": ("tee", 1), "--local-ranks-filter": ("local_ranks_filter", 1),
    "--duplicate-stdout-filters": ("duplicate_stdout_filters", 1),
    "--duplicate-stderr-filters": ("duplicate_stderr_filters", 1), "--node-rank": ("node_rank", 1),
    "--master-addr": ("master_addr", 1), "--master-port": ("master_port", 1), "--local-addr": ("local_addr", 1),
    "--logs-specs": ("logs_specs", 1), "--numa-binding": ("numa_binding", 1),
    "--signals-to-handle": ("signals_to_handle", 1), "--shutdown-timeout": ("shutdown_timeout", 1),
    "--virtual-local-rank": ("virtual_local_rank", 0),
    # torch.distributed.launch only
    "--use-env": ("use_env", 0),
}  # fmt: skip

_DEEPSPEED_FLAGS = {
    "-H": ("hostfile", 1), "--hostfile": ("hostfile", 1), "-i": ("include", 1), "--include": ("include", 1),
    "-e": ("exclude", 1), "--exclude": ("exclude", 1), "--num_nodes": ("num_nodes", 1),
    "--num_gpus": ("num_gpus", 1), "--num_accelerators": ("num_gpus", 1), "--master_port": ("master_port", 1),
    "--master_addr": ("master_addr", 1), "--node_rank": ("node_rank", 1), "--launcher": ("launcher", 1),
    "--launcher_args": ("launcher_args", 1), "--module": ("module", 0), "--no_python": ("no_python", 0),
    "--no_local_rank": ("no_local_rank", 0), "--no_ssh": ("no_ssh", 0), "--no_ssh_check": ("no_ssh_check", 0),
    "--force_multi": ("force_multi", 0), "--save_pid": ("save_pid", 0),
    "--enable_each_rank_log": ("enable_each_rank_log", 1), "--autotuning": ("autotuning", 1),
    "--bind_cores_to_rank": ("bind_cores_to_rank", 0),
    "--bind_core_list": ("bind_core_list", 1), "--ssh_port": ("ssh_port", 1), "--venv_script": ("venv_script", 1),
    "--log_level": ("log_level", 1), "-q": ("quiet", 0), "--quiet": ("quiet", 0),
}  # fmt: skip

_HOROVODRUN_FLAGS = {
    "-np": ("num_proc", 1), "--num-proc": ("num_proc", 1), "--disable-cache": ("disable_cache", 0),
    "--start-timeout": ("start_timeout", 1), "--network-interfaces": ("network_interfaces", 1),
    "--network-interface": ("network_interface", 1), "--output-filename": ("output_filename", 1),
    "--verbose": ("verbose", 0), "--config-file": ("config_file", 1), "-p": ("ssh_port", 1),
    "--ssh-port": ("ssh_port", 1), "-i": ("ssh_identity_file", 1), "--ssh-identity-file": ("ssh_identity_file", 1),
    "--fusion-threshold-mb": ("fusion_threshold_mb", 1), "--cycle-time-ms": ("cycle_time_ms", 1),
    "--cache-capacity": ("cache_capacity", 1), "--hierarchical-allreduce": ("hierarchical_allreduce", 0),
    "--no-hierarchical-allreduce": ("no_hierarchical_allreduce", 0),
    "--hierarchical-allgather": ("hierarchical_allgather", 0),
    "--no-hierarchical-allgather": ("no_hierarchical_allgather", 0), "--torus-allreduce": ("torus_allreduce", 0),
    "--no-torus-allreduce": ("no_torus_allreduce", 0), "--autotune": ("autotune", 0),
    "--autotune-log-file": ("autotune_log_file", 1), "--autotune-warmup-samples": ("autotune_warmup_samples", 1),
    "--autotune-steps-per-sample": ("autotune_steps_per_sample", 1),
    "--autotune-bayes-opt-max-samples": ("autotune_bayes_opt_max_samples", 1),
    "--autotune-gaussian-process-noise": ("autotune_gaussian_process_noise", 1),
    "--min-np": ("min_np", 1), "--min-num-proc": ("min_np", 1), "--max-np": ("max_np", 1),
    "--max-num-proc": ("max_np", 1), "--slots-per-host": ("slots", 1), "--slots": ("slots", 1),
    "--elastic-timeout": ("elastic_timeout", 1), "--reset-limit": ("reset_limit", 1),
    "--blacklist-cooldown-range": ("blacklist_cooldown_range", 2), "--timeline-filename": ("timeline_filename", 1),
    "--timeline-mark-cycles": ("timeline_mark_cycles", 0), "--no-stall-check": ("no_stall_check", 0),
    "--stall-check-warning-time-seconds": ("stall_check_warning_time_seconds", 1),
    "--stall-check-shutdown-time-seconds": ("stall_check_shutdown_time_seconds", 1),
    "--mpi-threads-disable": ("mpi_threads_disable", 0), "--mpi-args": ("mpi_args", 1), "--tcp": ("tcp", 0),
    "--binding-args": ("binding_args", 1), "--num-nccl-streams": ("num_nccl_streams", 1),
    "--thread-affinity": ("thread_affinity", 1), "--gloo-timeout-seconds": ("gloo_timeout_seconds", 1),
    "--log-level": ("log_level", 1), "--log-without-timestamp": ("log_without_timestamp", 0),
    "-prefix-timestamp": ("prefix_output_with_timestamp", 0),
    "--prefix-output-with-timestamp": ("prefix_output_with_timestamp", 0), "-H": ("hosts", 1),
    "--hosts": ("hosts", 1), "-hostfile": ("hostfile", 1), "--hostfile": ("hostfile", 1),
    "--host-discovery-script": ("host_discovery_script", 1), "--gloo": ("gloo", 0), "--mpi": ("mpi", 0),
    "--jsrun": ("jsrun", 0), "--no-autotune": ("no_autotune", 0), "--no-timeline-mark-cycles":
    ("no_timeline_mark_cycles", 0), "--stall-check": ("stall_check", 0), "--no-mpi-threads-disable":
    ("no_mpi_threads_disable", 0), "--log-with-timestamp": ("log_with_timestamp", 0), "--log-hide-timestamp":
    ("log_without_timestamp", 0), "--no-log-hide-timestamp": ("log_with_timestamp", 0), "-cb": ("check_build", 0),
    "--check-build": ("check_build", 0), "-v": ("version", 0), "--version": ("version", 0),
}  # fmt: skip

# Open MPI accepts one or two leading dashes for its long options; both spellings are listed once here.
_MPIRUN_OPTIONS = {
    "np": ("np", 1), "n": ("np", 1), "c": ("np", 1), "H": ("hosts", 1), "host": ("hosts", 1),
    "hostfile": ("hostfile", 1), "machinefile": ("hostfile", 1), "x": ("x", 1), "mca": ("mca", 2),
    "gmca": ("mca", 2), "npernode": ("npernode", 1), "N": ("npernode", 1), "bind-to": ("bind_to", 1),
    "map-by": ("map_by", 1), "rank-by": ("rank_by", 1), "report-bindings": ("report_bindings", 0),
    "display-map": ("display_map", 0), "tag-output": ("tag_output", 0), "timestamp-output": ("timestamp_output", 0),
    "output-filename": ("output_filename", 1), "oversubscribe": ("oversubscribe", 0),
    "allow-run-as-root": ("allow_run_as_root", 0), "wdir": ("wdir", 1), "prefix": ("prefix", 1),
    "q": ("quiet", 0), "quiet": ("quiet", 0), "v": ("verbose", 0), "verbose": ("verbose", 0),
    "mpi-args": ("mpi_args", 1), "launch-agent": ("launch_agent", 1),
}  # fmt: skip
_MPIRUN_FLAGS = {f"-{k}": v for k, v in _MPIRUN_OPTIONS.items()} | {f"--{k}": v for k, v in _MPIRUN_OPTIONS.items()}

#: accelerate launch 1.15's options by destination (tests/test_key_tables.py checks them against its parser, through
#: schemas/keys/accelerate.json): switches, then options taking a value; each is spelt ``--dest`` (``_`` or ``-``).
ACCELERATE_SWITCHES = (
    "quiet cpu multi_gpu tpu enable_cpu_affinity dynamo_use_fullgraph dynamo_use_dynamic "
    "dynamo_use_regional_compilation use_deepspeed use_fsdp use_parallelism_config use_megatron_lm same_network "
    "module no_python tpu_use_sudo downcast_bf16 fp8_use_autocast_during_eval debug").split()  # fmt: skip
ACCELERATE_VALUED = (
    "config_file mixed_precision num_processes num_machines num_cpu_threads_per_process dynamo_backend dynamo_mode "
    "gpu_ids machine_rank main_process_ip main_process_port tee log_dir role rdzv_backend rdzv_conf max_restarts "
    "monitor_interval vm env main_training_function deepspeed_config_file zero_stage offload_optimizer_device "
    "offload_param_device offload_optimizer_nvme_path offload_param_nvme_path gradient_accumulation_steps "
    "gradient_clipping zero3_init_flag zero3_save_16bit_model deepspeed_hostfile deepspeed_exclusion_filter "
    "deepspeed_inclusion_filter deepspeed_multinode_launcher deepspeed_moe_layer_cls_names fsdp_version "
    "fsdp_offload_params fsdp_min_num_params fsdp_sharding_strategy fsdp_reshard_after_forward "
    "fsdp_auto_wrap_policy fsdp_transformer_layer_cls_to_wrap fsdp_backward_prefetch fsdp_state_dict_type "
    "fsdp_forward_prefetch fsdp_use_orig_params fsdp_cpu_ram_efficient_loading fsdp_sync_module_states "
    "fsdp_activation_checkpointing fsdp_activation_checkpointing_offload megatron_lm_tp_degree "
    "megatron_lm_use_custom_fsdp megatron_lm_no_load_optim megatron_lm_eod_mask_loss "
    "megatron_lm_overlap_cpu_optimizer_d2h_h2d megatron_lm_no_save_optim megatron_lm_optimizer_cpu_offload "
    "megatron_lm_use_precision_aware_optimizer megatron_lm_decoder_last_pipeline_num_layers megatron_lm_pp_degree "
    "megatron_lm_num_micro_batches megatron_lm_sequence_parallelism megatron_lm_recompute_activations "
    "megatron_lm_use_distributed_optimizer megatron_lm_gradient_clipping megatron_lm_recompute_granularity "
    "megatron_lm_recompute_method megatron_lm_recompute_num_layers megatron_lm_attention_backend "
    "megatron_lm_expert_model_parallel_size megatron_lm_context_parallel_size megatron_lm_attention_dropout "
    "megatron_lm_hidden_dropout megatron_lm_attention_softmax_in_fp32 megatron_lm_expert_tensor_parallel_size "
    "megatron_lm_calculate_per_token_loss megatron_lm_use_rotary_position_embeddings fp8_backend fp8_margin "
    "fp8_interval fp8_format fp8_amax_history_len fp8_amax_compute_algo fp8_override_linear_precision fp8_opt_level "
    "fp8_enable_fsdp_float8_all_gather fp8_pad_inner_dim aws_access_key_id aws_secret_access_key mpirun_hostfile "
    "parallelism_config_dp_replicate_size parallelism_config_dp_shard_size parallelism_config_tp_size "
    "parallelism_config_cp_size parallelism_config_cp_backend parallelism_config_cp_comm_strategy "
    "parallelism_config_sp_size parallelism_config_sp_backend parallelism_config_sp_seq_length "
    "parallelism_config_sp_seq_length_is_variable parallelism_config_sp_attn_implementation").split()  # fmt: skip
#: accelerate launch options it turns into a variable of the processes' environment (``utils/launch.py``:
#: ``prepare_multi_gpu_env``, ``prepare_deepspeed_cmd_env``); the launch dialect carries them as that variable.
ACCELERATE_OPTION_ENV = {
    "mixed_precision": "ACCELERATE_MIXED_PRECISION", "use_deepspeed": "ACCELERATE_USE_DEEPSPEED",
    "debug": "ACCELERATE_DEBUG_MODE", "enable_cpu_affinity": "ACCELERATE_CPU_AFFINITY",
    "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE", "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
    "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
    "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "deepspeed_moe_layer_cls_names": "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES",
}  # fmt: skip
_ACCELERATE_FLAGS = {
    **{f"--{dest}": (dest, 0) for dest in ACCELERATE_SWITCHES},
    **{f"--{dest}": (dest, 1) for dest in ACCELERATE_VALUED},
    "-q": ("quiet", 0), "-t": ("tee", 1), "-m": ("module", 0),
    "--tpu_cluster": ("tpu_use_cluster", 0), "--no_tpu_cluster": ("no_tpu_cluster", 0),
}  # fmt: skip

#: Launcher -> (option table, normalise "_" to "-" in option names, options end at the first positional).
LAUNCHER_FLAGS: dict[str, dict[str, tuple[str, int]]] = {
    "torchrun": _TORCHRUN_FLAGS, "deepspeed": _DEEPSPEED_FLAGS, "horovodrun": _HOROVODRUN_FLAGS,
    "mpirun": _MPIRUN_FLAGS, "accelerate": _ACCELERATE_FLAGS,
}  # fmt: skip
_REPEATABLE = {("mpirun", "x"), ("mpirun", "mca"), ("horovodrun", "network_interface"), ("accelerate", "vm"),
               ("accelerate", "env")}  # fmt: skip

_PYTHON = re.compile(r"^(.*/)?python(\d+(\.\d+)?)?$")
_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
_REDIRECT = re.compile(r"^(\d*>>?|&>>?|\d*>&\d*|<(?![^<>\s]*>)|\||\|\||&&|;|&)")
_ALL_ARGUMENTS = re.compile(r"^\$(@|\{@[^{}]*\})$")
_SAFE = re.compile(r"^([\w@%+=:,./{}$-]+|<[^<>\s]+>)$")
_PYTHON_OPTS_WITH_VALUE = {"-W", "-X"}


def tokenize(raw: str | Sequence[str]) -> list[str]:
    """A command as argv: a string is split like a POSIX shell (quotes, ``\\`` line continuations)."""
    if isinstance(raw, str):
        try:
            tokens = [t.replace(_SPACE, " ") for t in shlex.split(_protect_substitutions(raw.replace("\\\n", " ")))]
        except ValueError as exc:
            raise ConfigError([Problem("command", raw, f"cannot split it like a shell: {exc}")]) from None
    else:
        tokens = [str(t) for t in raw]
    if not tokens:
        raise ConfigError([Problem("command", raw, "the command is empty")])
    return tokens


_SPACE = "\x00"


def _protect_substitutions(text: str) -> str:
    """Keep ``$(...)`` / ``$((...))`` one word, as the shell does (``--master_port=$((RANDOM + 10000))``)."""
    out, depth, i = [], 0, 0
    while i < len(text):
        if text.startswith("$(", i):
            depth += 1
            out.append("$(")
            i += 2
            continue
        ch = text[i]
        if depth and ch == "(":
            depth += 1
        elif depth and ch == ")":
            depth -= 1
        out.append(_SPACE if depth and ch.isspace() else ch)
        i += 1
    return "".join(out)


def quote(token: str) -> str:
    """Quote one argument for a POSIX shell, leaving ``$VAR`` / ``${VAR}`` expandable and ``<placeholder>`` as is;
    the script's own arguments (``$@``, ``${@:2}``) are written ``"$@"``, which passes each one unsplit."""
    if _ALL_ARGUMENTS.match(token):
        return f'"{token}"'
    if _SAFE.match(token):
        return token
    if "$" in token and not re.search(r'["\\`]', token):
        return f'"{token}"'
    return shlex.quote(token)


def join(tokens: Sequence[str]) -> str:
    """A command line from argv, quoted with :func:`quote`."""
    return " ".join(quote(t) for t in tokens)


#: Launcher programs: executable name -> (launcher, second token it needs or "", program spelling).
_PROGRAMS = {"torchrun": ("torchrun", "", "torchrun"), "deepspeed": ("deepspeed", "", "deepspeed"),
             "horovodrun": ("horovodrun", "", "horovodrun"), "mpirun": ("mpirun", "", "mpirun"),
             "mpiexec": ("mpirun", "", "mpiexec"), "orterun": ("mpirun", "", "orterun"),
             "tune": ("torchrun", "run", "tune run"), "accelerate": ("accelerate", "launch", "accelerate launch")}
#: Launchers run as a Python module: ``python -m <module>``.
_MODULES = {"torch.distributed.run": "torchrun", "torch.distributed.launch": "torchrun",
            "deepspeed.launcher.runner": "deepspeed"}


def _find_launcher(tokens: list[str]) -> tuple[int, int, str, str]:
    """(start, end) of the launcher's program tokens, the launcher name and its program spelling."""
    for i, tok in enumerate(tokens):
        found = _program_at(tokens, i) or (_module_at(tokens, i) if _PYTHON.match(tok) else None)
        if found:
            return (i, *found)
    raise ConfigError([Problem("command", " ".join(tokens), "no launcher found; expected torchrun, python -m "
                               "torch.distributed.run/launch, deepspeed, horovodrun, mpirun or accelerate launch")])


def _program_at(tokens: list[str], i: int) -> tuple[int, str, str] | None:
    """A launcher's executable at ``tokens[i]`` (with its sub-command): (end, launcher, program)."""
    entry = _PROGRAMS.get(tokens[i].rsplit("/", 1)[-1])
    if entry is None:
        return None
    launcher, second, program = entry
    if not second:
        return i + 1, launcher, program
    return (i + 2, launcher, program) if tokens[i + 1:i + 2] == [second] else None


def _module_at(tokens: list[str], i: int) -> tuple[int, str, str] | None:
    """``python [flags] -m <launcher module>`` at ``tokens[i]``: (end, launcher, program)."""
    j = _after_python_flags(tokens, i + 1)
    if tokens[j:j + 1] != ["-m"] or j + 1 >= len(tokens) or tokens[j + 1] not in _MODULES:
        return None
    module = tokens[j + 1]
    return j + 2, _MODULES[module], f"python -m {module}"


def _after_python_flags(tokens: list[str], j: int) -> int:
    """The index after the Python interpreter's own flags (up to ``-m`` or the script)."""
    while j < len(tokens) and tokens[j].startswith("-") and tokens[j] != "-m":
        j += 2 if tokens[j] in _PYTHON_OPTS_WITH_VALUE else 1
    return j


def parse(raw: str | Sequence[str]) -> dict[str, Any]:
    """The command as a mapping: ``{launcher: {dest: value}, script, script_args, env, wrapper, ...}``."""
    tokens = tokenize(raw)
    start, end, launcher, program = _find_launcher(tokens)
    out: dict[str, Any] = {}
    env = {}
    wrapper = []
    for tok in tokens[:start]:
        if _ASSIGNMENT.match(tok) and not wrapper:
            name, _, value = tok.partition("=")
            env[name] = value
        else:
            wrapper.append(tok)
    rest = tokens[end:]
    cut = next((i for i, t in enumerate(rest) if _REDIRECT.match(t)), len(rest))
    rest, redirect = rest[:cut], rest[cut:]
    options, positional = _parse_options(launcher, rest)
    out["launcher"] = launcher
    out[launcher] = options
    if program != launcher:
        out["program"] = program
    _split_script(launcher, options, positional, out)
    if env:
        out["env"] = env
    if wrapper:
        out["wrapper"] = join(wrapper)  # a variable stays one the shell expands
    if redirect:
        out["redirect"] = " ".join(redirect)
    return out


def _parse_options(launcher: str, args: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The launcher's options (by argparse dest) and the positional rest, which starts with the script."""
    table = LAUNCHER_FLAGS[launcher]
    options: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-") or arg in ("-", "--"):
            return options, args[i + 1:] if arg == "--" else args[i:]
        name, eq, inline = arg.partition("=")
        key = _normalise(launcher, name)
        if key not in table:
            raise ConfigError([Problem(f"{launcher} {name}", arg, f"unknown {launcher} option",
                                       did_you_mean(key, sorted(table)))], source="launch")  # fmt: skip
        dest, nargs = table[key]
        value, i = _option_value(args, i, nargs, inline if eq else None, f"{launcher} {name}")
        _store(options, launcher, dest, value, f"{launcher} {name}")
    return options, []


def _option_value(args: list[str], i: int, nargs: int, inline: str | None, where: str) -> tuple[Any, int]:
    """The value of the option at ``args[i]`` (True for a switch) and the index after it."""
    if nargs == 0:
        return True, i + 1
    if inline is not None:
        return inline, i + 1
    if i + nargs >= len(args):
        raise ConfigError([Problem(where, None, f"expects {nargs} value(s)")], source="launch")
    return (args[i + 1] if nargs == 1 else args[i + 1:i + 1 + nargs]), i + 1 + nargs


def _store(options: dict[str, Any], launcher: str, dest: str, value: Any, where: str) -> None:
    """Keep an option's value: a repeatable option collects them; another given twice must agree."""
    if (launcher, dest) in _REPEATABLE:
        options.setdefault(dest, []).append(value)
    elif dest in options and options[dest] != value:
        raise ConfigError([Problem(where, value, f"given twice ({options[dest]!r} and {value!r}); keep one")],
                          source="launch")  # fmt: skip
    else:
        options[dest] = value


def _normalise(launcher: str, name: str) -> str:
    """torchrun accepts ``--foo_bar`` for ``--foo-bar``; accelerate the reverse."""
    if launcher == "torchrun" and name.startswith("--"):
        return "--" + name[2:].replace("_", "-")
    if launcher == "accelerate" and name.startswith("--"):
        return "--" + name[2:].replace("-", "_")
    return name


def _split_script(launcher: str, options: dict[str, Any], positional: list[str], out: dict[str, Any]) -> None:
    """The training script and its arguments; horovodrun and mpirun run a whole command (``python x.py``)."""
    if not positional:
        raise ConfigError([Problem(f"{launcher}", None, "no training script after the launcher's options")],
                          source="launch")  # fmt: skip
    if launcher in ("horovodrun", "mpirun") and not _PYTHON.match(positional[0]):
        options["no_python"] = True
    elif launcher in ("horovodrun", "mpirun"):
        positional = _python_command(launcher, options, positional, out)
    out["script"] = positional[0]
    out["script_args"] = list(positional[1:])


def _python_command(launcher: str, options: dict[str, Any], positional: list[str], out: dict[str, Any]) -> list[str]:
    """``python [flags] [-m] script ...`` run by horovodrun/mpirun: the interpreter and its flags are kept, the
    script and its arguments returned."""
    j = _after_python_flags(positional, 1)
    if j > 1:
        out["python_flags"] = positional[1:j]
    if positional[j:j + 1] == ["-m"]:
        options["module"] = True
        j += 1
    if positional[0] != "python":
        out["python"] = positional[0]
    if not positional[j:]:
        raise ConfigError([Problem(launcher, None, "python is run without a script")], source="launch")
    return positional[j:]


# --------------------------------------------------------------------------------------------------
# Slurm batch scripts

_SBATCH_LINE = re.compile(r"^#SBATCH\s+(.*)$")


def is_pytorchjob(raw: Any) -> bool:
    """A Kubeflow PyTorchJob manifest (YAML text, or the mapping a config loader made of it)."""
    if isinstance(raw, Mapping):
        return raw.get("kind") == "PyTorchJob"
    return isinstance(raw, str) and re.search(r"^kind:\s*[\"']?PyTorchJob\b", raw, re.M) is not None


#: The torchrun options a PyTorchJob's command takes from the training operator's per-pod variables.
_OPERATOR_SET = ("nnodes", "node_rank", "master_addr", "master_port", "rdzv_endpoint", "rdzv_backend")


def parse_pytorchjob(text: str | Mapping[str, Any]) -> dict[str, Any]:
    """A PyTorchJob manifest as the mapping :func:`parse` gives for the command of its pods, with what the training
    operator hands torchrun written in: the node count (the pods, or the elastic range), the rendezvous, restarts,
    processes per node and the container's variables. ``kubernetes``: the image and the job's name."""
    from torsh.formats import parse_text

    job = dict(text) if isinstance(text, Mapping) else parse_text(text, "yaml")
    spec, container, counts = _pytorchjob_parts(job)
    parsed = _pod_command([str(w) for w in [*(container.get("command") or []), *(container.get("args") or [])]])
    options = {k: v for k, v in parsed[parsed["launcher"]].items()
               if not (k in _OPERATOR_SET and "$(" in str(v))}  # fmt: skip
    if parsed["launcher"] == "torchrun":
        options = _operator_options(options, spec, container, counts)
    parsed[parsed["launcher"]] = options
    return _with_pod_settings(parsed, job, container)


def _with_pod_settings(parsed: dict[str, Any], job: dict, container: dict) -> dict[str, Any]:
    """The container's variables (those with a value: ``valueFrom`` ones are the cluster's) as the command's
    environment, and the image and job name kept under ``kubernetes``."""
    env = _valued_env(container.get("env"))
    if env:
        parsed["env"] = {**env, **parsed.get("env", {})}
    metadata = job["metadata"] if isinstance(job.get("metadata"), dict) else {}
    kept = {"name": metadata.get("name"), "image": container.get("image")}
    parsed["kubernetes"] = {k: v for k, v in kept.items() if v is not None}
    return parsed


def _pytorchjob_parts(job: Any) -> tuple[dict, dict, list[int]]:
    """The spec, the container of the Master pod (else the first replica's), and the replica counts."""
    spec = job.get("spec") if isinstance(job, dict) else None
    replicas = spec.get("pytorchReplicaSpecs") if isinstance(spec, dict) else None
    if not isinstance(replicas, dict) or not replicas:
        raise ConfigError([Problem("spec.pytorchReplicaSpecs", None, "a PyTorchJob needs its Master/Worker "
                                   "replica specs")], source="launch")  # fmt: skip
    where, container, counts = _master_container(replicas)
    for key in ("command", "args"):
        if not isinstance(container.get(key) or [], list):
            raise ConfigError([Problem(f"{where}.template.spec.containers[0].{key}", container[key], "a list of "
                                       "words, as Kubernetes takes it")], source="launch")  # fmt: skip
    if not container.get("command") and not container.get("args"):
        raise ConfigError([Problem(f"{where}.template.spec.containers[0].command", None, "the container runs its "
                                   "image's entry point: torsh needs the launch command written in the "
                                   "manifest")], source="launch")  # fmt: skip
    return spec, container, counts


def _valued_env(entries: Any) -> dict[str, str]:
    entries = [e for e in entries or [] if isinstance(e, dict)]
    return {str(e["name"]): str(e["value"]) for e in entries if "name" in e and "value" in e}


def _master_container(replicas: dict) -> tuple[str, dict, list[int]]:
    """Where the Master pod's spec is (else the first replica's), its container named pytorch (else the first),
    and every replica count."""
    kind = "Master" if "Master" in replicas else next(iter(replicas))
    where = f"spec.pytorchReplicaSpecs.{kind}"
    try:
        containers = replicas[kind]["template"]["spec"]["containers"]
        container = next((c for c in containers if c.get("name") == "pytorch"), containers[0])
        counts = [int(r.get("replicas", 1)) for r in replicas.values()]
        if not isinstance(container, dict) or min(counts) < 0:
            raise TypeError
        return where, container, counts
    except (KeyError, IndexError, TypeError, AttributeError, ValueError, OverflowError):
        raise ConfigError([Problem(f"{where}.template.spec.containers", None, "expected a container (named "
                                   "pytorch) with its command and the replicas as numbers")], source="launch") from None


def _pod_command(argv: list[str]) -> dict[str, Any]:
    """A pod's command as :func:`parse` gives it: ``bash -c "<line>"`` is the line; ``python train.py`` is one
    process per pod, placed by the operator's RANK / WORLD_SIZE / MASTER_* as torchrun places one per node."""
    shell = len(argv) == 3 and os.path.basename(argv[0]) in ("sh", "bash") and argv[1] == "-c"
    try:
        return parse(argv[2] if shell else argv)
    except ConfigError:
        if shell or not _PYTHON.match(os.path.basename(argv[0])):
            raise
        return parse(["torchrun", "--nproc-per-node=1", *argv[1:]])


def _operator_options(options: dict[str, Any], spec: dict, container: dict, counts: list[int]) -> dict[str, Any]:
    """torchrun's options with what the training operator gives it: the node count (pods, or the elastic range),
    the elastic policy's rendezvous and restarts, the Master's port, the processes per pod."""
    policy = spec.get("elasticPolicy") if isinstance(spec.get("elasticPolicy"), dict) else None
    if policy is not None:
        options = _elastic_options(options, policy, sum(counts))
    else:
        options |= {"nnodes": str(sum(counts))} if sum(counts) > 1 else {}
        options |= _master_port(container)
    nproc = spec.get("nprocPerNode") or (policy or {}).get("nProcPerNode")
    return options | ({"nproc_per_node": str(nproc)} if nproc is not None and "nproc_per_node" not in options else {})


def _master_port(container: dict) -> dict[str, str]:
    """``master_port`` from the container's port the operator uses for the master (``pytorchjob-port``)."""
    ports = [p for p in container.get("ports") or [] if isinstance(p, dict) and p.get("name") == "pytorchjob-port"]
    return {"master_port": str(ports[0]["containerPort"])} if ports and "containerPort" in ports[0] else {}


def _elastic_options(options: dict[str, Any], policy: dict, pods: int) -> dict[str, Any]:
    """torchrun's options from an elastic policy: the node range, the rendezvous backend and id, the restarts."""
    low, high = policy.get("minReplicas"), policy.get("maxReplicas")
    options["nnodes"] = f"{low}:{high}" if low is not None and high is not None else str(pods)
    options.setdefault("rdzv_backend", str(policy.get("rdzvBackend", "c10d")))
    wanted = (("maxRestarts", "max_restarts"), ("rdzvId", "rdzv_id"))
    return options | {dest: str(policy[key]) for key, dest in wanted if key in policy and dest not in options}


def is_sbatch(raw: Any) -> bool:
    """A Slurm batch script: text with ``#SBATCH`` directives."""
    return isinstance(raw, str) and re.search(r"^#SBATCH\s", raw, re.M) is not None


def _sbatch_directives(lines: list[str]) -> dict[str, Any]:
    """The ``#SBATCH`` options of a script by long name (``-N 4``, ``-N4``, ``--nodes=4``, ``--nodes 4``)."""
    from torsh.concepts.launch import SBATCH_OPTIONS

    short = {v: k for k, v in SBATCH_OPTIONS.items() if v}
    options: dict[str, Any] = {}
    for tokens in (shlex.split(m.group(1), comments=True) for m in map(_SBATCH_LINE.match, map(str.strip, lines))
                   if m):  # fmt: skip
        while tokens:
            token = tokens.pop(0)
            name, _, value = token.lstrip("-").partition("=")
            if not token.startswith("--"):
                name, value = (name[0], name[1:]) if len(name) > 1 and name[0] in short else (name, value)
                name = short.get(name, name)
            if name not in SBATCH_OPTIONS:
                raise ConfigError([Problem(f"#SBATCH {token}", None, "not an sbatch option",
                                           did_you_mean(name, list(SBATCH_OPTIONS)))], source="launch")
            if not value and tokens and not tokens[0].startswith("-"):
                value = tokens.pop(0)
            options[name] = value or True
    return options


#: Words in front of an assignment that declare the variable (their options, ``declare -a``, are skipped).
_DECLARATIONS = frozenset({"export", "local", "declare", "readonly", "typeset"})
_DECLARED = rf"^\s*(?:(?:{'|'.join(sorted(_DECLARATIONS))})(?:\s+-\w+)*\s+)?"
#: ``NAME=(words)`` / ``NAME+=(words)``, a bash array (its words may span lines), after any declaration.
_ARRAY = re.compile(_DECLARED + r"([A-Za-z_]\w*)(\+?)=\((.*)\)\s*(?:#.*)?$", re.S)
_ARRAY_START = re.compile(_DECLARED + r"[A-Za-z_]\w*\+?=\(")
#: One ``NAME=value`` / ``NAME+=value`` word: (name, "+" or "", value).
_ASSIGNMENT_PARTS = re.compile(r"^([A-Za-z_]\w*)(\+?)=(.*)$", re.S)
#: A value known only when the script runs: a command substitution, or a parameter expansion with a default or an
#: edit (``${PORT:-29500}``, ``${X%.*}``). Other variables it names are kept as written (``$1``, ``${OPTS}``).
_RUNTIME_VALUE = re.compile(r"\$\((?!\()|`|\$\{[^}]*[:#%/]")
#: ``$NAME``, ``${NAME}``, ``${NAME[@]}`` / ``${NAME[*]}``; ``"${NAME[@]}"`` quoted is its words, each kept whole.
_REFERENCE = re.compile(r'"\$\{([A-Za-z_]\w*)\[[@*]\]\}"|\$\{([A-Za-z_]\w*)(?:\[[@*]\])?\}|\$([A-Za-z_]\w*)')


@dataclass
class _ScriptVariables:
    """What a script has assigned by the line being read."""

    known: dict[str, str] = field(default_factory=dict)
    """Values certain at this line: set outside any if/case/loop, from what was known there."""
    seen: list[str] = field(default_factory=list)
    """Every value assigned, in order, certain or not: where a launch command nothing runs is looked for."""
    depth: int = 0
    """The if/case/loop blocks around the line: an assignment there may not run (or runs with other values)."""

    def assign(self, name: str, value: str | None, append: bool) -> None:
        """Set (or append to) a variable; a value not known, or set inside a block, makes it unknown."""
        if value is not None and append:
            value = f"{self.known[name]} {value}".strip() if name in self.known else None
        if value is not None:
            self.seen.append(value)
        if value is None or self.depth:
            self.known.pop(name, None)
        else:
            self.known[name] = value


def _note_assignment(line: str, variables: _ScriptVariables) -> bool:
    """Record ``NAME=value``, ``NAME+=value``, ``NAME=(words)`` and their ``export``/``local``/``declare`` forms; True
    when the line only assigns (it runs nothing). ``NAME=value command ...`` sets NAME for that command only: not an
    assignment of the script. A value known only when the script runs is forgotten, never kept from before."""
    array = _ARRAY.match(line)
    if array:
        variables.assign(array.group(1), _array_words(array.group(3), variables.known), bool(array.group(2)))
        return True
    tokens = _assignment_words(line)
    for name, plus, value in (_ASSIGNMENT_PARTS.match(t).groups() for t in tokens or ()):
        known = None if _RUNTIME_VALUE.search(value) else " ".join(_expand_assigned(value, variables.known).split())
        variables.assign(name, known, bool(plus))
    return tokens is not None


#: The words that open a shell block whose body may not run, or runs several times, and the word that closes it.
_BLOCKS = {"if": "fi", "case": "esac", "for": "done", "while": "done", "until": "done", "select": "done"}


def _block_change(line: str) -> int:
    """+1 when the line opens an if/case/loop it does not close, -1 when it closes one, else 0."""
    try:
        words = shlex.split(_protect_substitutions(line), comments=True)
    except ValueError:
        return 0
    first = words[0].rstrip(";") if words else ""
    if first in _BLOCKS:
        return 0 if any(w.rstrip(";") == _BLOCKS[first] for w in words) else 1
    return -1 if first in _BLOCKS.values() else 0


def _assignment_words(line: str) -> list[str] | None:
    """The ``NAME=value`` words of a line that only assigns (after a declaration and its options), else None."""
    try:  # a trailing ";" ends the command, as the next line would
        tokens = [t.replace(_SPACE, " ") for t in shlex.split(_protect_substitutions(line.rstrip().removesuffix(";")),
                                                               comments=True)]  # fmt: skip
    except ValueError:  # an unbalanced quote: not a line this reader understands
        return None
    if tokens[:1] and tokens[0] in _DECLARATIONS:
        tokens = list(itertools.dropwhile(lambda t: t.startswith("-"), tokens[1:]))
    return tokens if tokens and all(_ASSIGNMENT_PARTS.match(t) for t in tokens) else None


def _array_words(body: str, assigned: dict[str, str]) -> str | None:
    """An array's words as one command line, each quoted so that splitting it again gives the same words."""
    if _RUNTIME_VALUE.search(body):
        return None
    try:
        words = shlex.split(_expand_assigned(body, assigned), comments=True)
    except ValueError:
        return None
    return " ".join(quote(w) for w in words)


def _expand_assigned(line: str, assigned: dict[str, str]) -> str:
    """``$NAME`` / ``${NAME}`` / ``"${NAME[@]}"`` replaced by the script's own earlier assignments (others are left
    as written)."""
    def value(m: re.Match) -> str:
        return assigned.get(m.group(1) or m.group(2) or m.group(3), m.group(0))

    return _REFERENCE.sub(value, line)


#: Commands that print their arguments rather than run them: a launch line after them is a message.
_PRINTERS = frozenset({"echo", "printf"})


def _command_of(line: str) -> str | None:
    """The command a script line runs: None for one that prints (``echo $CMD``), the arguments of ``eval`` as the
    line it reads (``eval "$CMD"``), else the line itself."""
    words = tokenize(line)
    if os.path.basename(words[0]) in _PRINTERS:
        return None
    if words[0] == "eval":
        return " ".join(words[1:]) or None
    return line


def _logical_lines(lines: list[str]) -> list[str]:
    """The script's lines without blank and comment lines; a quoted string or an array that spans lines is one."""
    out: list[str] = []
    for line in lines:
        if out and _still_open(out[-1]):
            out[-1] += "\n" + line
        elif line.strip() and not line.lstrip().startswith("#"):
            out.append(line)
    return out


def _still_open(text: str) -> bool:
    """A quote, or an array's parenthesis, that the text opens and does not close."""
    if _ARRAY_START.match(text) and text.count("(") > text.count(")"):
        return True
    try:
        shlex.split(_protect_substitutions(text), comments=True)
    except ValueError:
        return True
    return False


def is_script(raw: Any) -> bool:
    """A shell script rather than one command: a ``#!`` line, several lines once continuations are joined, or a line
    that only assigns variables (``run_cmd="deepspeed ..."``: the command is in the value)."""
    if not isinstance(raw, str):
        return False
    lines = [line for line in re.sub(r"\\\n", " ", raw).splitlines() if line.strip()]
    one_assignment = len(lines) == 1 and (_ARRAY.match(lines[0]) or _assignment_words(lines[0]) is not None)
    return raw.lstrip().startswith("#!") or len(lines) > 1 or bool(one_assignment)


def parse_script(text: str) -> dict[str, Any]:
    """A shell script (or sbatch script) as the mapping :func:`parse` gives for its launch command: the first line
    that runs a launcher (see :func:`_first_launch`); an sbatch script's directives too (:func:`parse_sbatch`)."""
    if is_sbatch(text):
        return parse_sbatch(text)
    return _first_launch(re.sub(r"\\\n", " ", text).splitlines(), "script")


def parse_sbatch(text: str) -> dict[str, Any]:
    """An sbatch script as the mapping :func:`parse` gives for its launch command (the first line that runs a
    launcher, ``srun`` in front kept as the wrapper), plus ``slurm``: its ``#SBATCH`` options by long name.
    ``$SLURM_NNODES`` in the command is the script's ``--nodes`` count when that is a number."""
    lines = re.sub(r"\\\n", " ", text).splitlines()
    options = _sbatch_directives(lines)
    parsed = _first_launch(lines)
    parsed["slurm"] = options
    nodes = str(options.get("nodes", ""))
    if nodes.isdigit():
        parsed[parsed["launcher"]] = {k: nodes if v in ("$SLURM_NNODES", "${SLURM_NNODES}") else v
                                      for k, v in parsed[parsed["launcher"]].items()}  # fmt: skip
    return parsed


def _first_launch(lines: list[str], what: str = "sbatch script") -> dict[str, Any]:
    """The first line of a script that runs a launcher, parsed. set -e, head_node=$(...), module load ...: not the
    launch. It may run what the script set before (``export CMD="$LAUNCHER $SCRIPT"`` ... ``srun $CMD``, as
    Accelerate's Slurm examples do; ``eval ${run_cmd}``; ``"${cmd[@]}"``): those are expanded, except what was set
    inside an if/case/loop, which stays a variable. When no line runs one, a value assigned that is a launch command
    is (it is run by a function, set in a branch, or the text is that assignment). A launch refused is the error, if
    none is found."""
    variables, refused = _ScriptVariables(), []
    for line in _logical_lines(lines):
        variables.depth = max(0, variables.depth + _block_change(line))
        if not _note_assignment(line, variables):
            found = _launch_or_none(_expand_assigned(line, variables.known), refused)
            if found:
                return found
    for value in (*variables.known.values(), *variables.seen):
        found = _launch_or_none(value, refused)
        if found:
            return found
    raise refused[0] if refused else ConfigError([Problem("script", None, f"no launch command in the {what} "
                                                          "(torchrun, deepspeed, horovodrun, mpirun, python -m "
                                                          "torch.distributed.run, ...)")], source="launch")  # fmt: skip


def _launch_or_none(text: str, refused: list[ConfigError]) -> dict[str, Any] | None:
    """The launch command ``text`` runs, parsed; None when it runs none (a refusal of one is kept in ``refused``)."""
    if not text.strip():
        return None
    try:
        command = _command_of(text)
        return parse(command) if command else None
    except ConfigError as exc:
        if not any(p.reason.startswith("no launcher found") for p in exc.problems):
            refused.append(exc)
        return None
