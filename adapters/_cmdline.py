"""Launch command lines -> a plain mapping the launch dialect's FIELD_MAP reads.

A command is split into: ``VAR=value`` prefixes (``env``), a wrapper in front of the launcher (``srun``,
``nohup``), the launcher's program tokens (``torchrun``, ``python -m torch.distributed.run``, ``deepspeed``,
``horovodrun``, ``mpirun``, ``tune run``, ``accelerate launch``), its options, the training script with its
arguments, and a trailing shell redirection (``&> log``). Each launcher's options are one table below
(spelling -> destination name, number of values); an option not in the table is a ConfigError with a
did-you-mean, because guessing its arity would misplace the script.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from typing import Any

from torsh.concepts.launch import shell_references  # noqa: F401 - the parser's callers ask it
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
    "--jsrun": ("jsrun", 0),
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

_ACCELERATE_FLAGS = {
    "--config_file": ("config_file", 1), "--num_processes": ("num_processes", 1),
    "--num_machines": ("num_machines", 1), "--machine_rank": ("machine_rank", 1),
    "--main_process_ip": ("main_process_ip", 1), "--main_process_port": ("main_process_port", 1),
    "--multi_gpu": ("multi_gpu", 0), "--cpu": ("cpu", 0), "--use_deepspeed": ("use_deepspeed", 0),
    "--use_fsdp": ("use_fsdp", 0), "--mixed_precision": ("mixed_precision", 1), "--gpu_ids": ("gpu_ids", 1),
    "--same_network": ("same_network", 0), "--rdzv_backend": ("rdzv_backend", 1),
    "--max_restarts": ("max_restarts", 1), "--monitor_interval": ("monitor_interval", 1), "-m": ("module", 0),
    "--module": ("module", 0), "--no_python": ("no_python", 0), "--main_training_function":
    ("main_training_function", 1), "--num_cpu_threads_per_process": ("num_cpu_threads_per_process", 1),
    "--dynamo_backend": ("dynamo_backend", 1), "--deepspeed_config_file": ("deepspeed_config_file", 1),
    "--zero_stage": ("zero_stage", 1), "--gradient_accumulation_steps": ("gradient_accumulation_steps", 1),
    "--quiet": ("quiet", 0), "-q": ("quiet", 0), "--debug": ("debug", 0), "--tee": ("tee", 1),
    "--log_dir": ("log_dir", 1), "--role": ("role", 1),
}  # fmt: skip

#: Launcher -> (option table, normalise "_" to "-" in option names, options end at the first positional).
LAUNCHER_FLAGS: dict[str, dict[str, tuple[str, int]]] = {
    "torchrun": _TORCHRUN_FLAGS, "deepspeed": _DEEPSPEED_FLAGS, "horovodrun": _HOROVODRUN_FLAGS,
    "mpirun": _MPIRUN_FLAGS, "accelerate": _ACCELERATE_FLAGS,
}  # fmt: skip
_REPEATABLE = {("mpirun", "x"), ("mpirun", "mca"), ("horovodrun", "network_interface")}

_PYTHON = re.compile(r"^(.*/)?python(\d+(\.\d+)?)?$")
_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
_REDIRECT = re.compile(r"^(\d*>>?|&>>?|\d*>&\d*|<(?![^<>\s]*>)|\||\|\||&&|;|&)")
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
    """Quote one argument for a POSIX shell, leaving ``$VAR`` / ``${VAR}`` expandable and ``<placeholder>`` as is."""
    if _SAFE.match(token):
        return token
    if "$" in token and not re.search(r'["\\`]', token):
        return f'"{token}"'
    return shlex.quote(token)


def join(tokens: Sequence[str]) -> str:
    """A command line from argv, quoted with :func:`quote`."""
    return " ".join(quote(t) for t in tokens)


def _find_launcher(tokens: list[str]) -> tuple[int, int, str, str]:
    """(start, end) of the launcher's program tokens, the launcher name and its program spelling."""
    for i, tok in enumerate(tokens):
        base = tok.rsplit("/", 1)[-1]
        if base == "torchrun":
            return i, i + 1, "torchrun", "torchrun"
        if base in ("deepspeed", "horovodrun"):
            return i, i + 1, base, base
        if base in ("mpirun", "mpiexec", "orterun"):
            return i, i + 1, "mpirun", base
        if base == "tune" and tokens[i + 1:i + 2] == ["run"]:
            return i, i + 2, "torchrun", "tune run"
        if base == "accelerate" and tokens[i + 1:i + 2] == ["launch"]:
            return i, i + 2, "accelerate", "accelerate launch"
        if _PYTHON.match(tok):
            j = i + 1
            while j < len(tokens) and tokens[j].startswith("-") and tokens[j] != "-m":
                j += 2 if tokens[j] in _PYTHON_OPTS_WITH_VALUE else 1
            if tokens[j:j + 1] == ["-m"] and j + 1 < len(tokens):
                module = tokens[j + 1]
                if module in ("torch.distributed.run", "torch.distributed.launch"):
                    return i, j + 2, "torchrun", f"python -m {module}"
                if module == "deepspeed.launcher.runner":
                    return i, j + 2, "deepspeed", "python -m deepspeed.launcher.runner"
    raise ConfigError([Problem("command", " ".join(tokens), "no launcher found; expected torchrun, python -m "
                               "torch.distributed.run/launch, deepspeed, horovodrun, mpirun or accelerate launch")])


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
        out["wrapper"] = shlex.join(wrapper)
    if redirect:
        out["redirect"] = " ".join(redirect)
    return out


def _parse_options(launcher: str, args: list[str]) -> tuple[dict[str, Any], list[str]]:
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
            known = sorted(table)
            raise ConfigError([Problem(f"{launcher} {name}", arg, f"unknown {launcher} option",
                                       did_you_mean(key, known))], source="launch")  # fmt: skip
        dest, nargs = table[key]
        if nargs == 0:
            value: Any = True
            i += 1
        elif eq:
            value, i = inline, i + 1
        else:
            if i + nargs >= len(args):
                raise ConfigError([Problem(f"{launcher} {name}", None, f"expects {nargs} value(s)")], source="launch")
            value = args[i + 1] if nargs == 1 else args[i + 1:i + 1 + nargs]
            i += 1 + nargs
        if (launcher, dest) in _REPEATABLE:
            options.setdefault(dest, []).append(value)
        elif dest in options and options[dest] != value:
            raise ConfigError([Problem(f"{launcher} {name}", value, f"given twice ({options[dest]!r} and "
                                       f"{value!r}); keep one")], source="launch")  # fmt: skip
        else:
            options[dest] = value
    return options, []


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
    if launcher in ("horovodrun", "mpirun"):
        if _PYTHON.match(positional[0]):
            j = 1
            flags = []
            while j < len(positional) and positional[j].startswith("-") and positional[j] != "-m":
                step = 2 if positional[j] in _PYTHON_OPTS_WITH_VALUE else 1
                flags += positional[j:j + step]
                j += step
            if flags:
                out["python_flags"] = flags
            if positional[j:j + 1] == ["-m"]:
                options["module"] = True
                j += 1
            if positional[0] != "python":
                out["python"] = positional[0]
            positional = positional[j:]
            if not positional:
                raise ConfigError([Problem(launcher, None, "python is run without a script")], source="launch")
        else:
            options["no_python"] = True
    out["script"] = positional[0]
    out["script_args"] = list(positional[1:])
