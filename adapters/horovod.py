"""Horovod 0.28.1 settings: horovodrun flags, the ``--config-file`` YAML, the HOROVOD_* environment and
``hvd.DistributedOptimizer`` keyword arguments.

Input shape: a mapping with any of four top-level keys, one per place a Horovod job is configured::

    horovodrun:             # horovodrun's flags by their argparse dest: num_proc, hosts, fusion_threshold_mb,
      fusion_threshold_mb: 64   #   cycle_time_ms, hierarchical_allreduce, min_num_proc, use_gloo, command, ...
    config_file:            # the --config-file YAML as is (controller, params, autotune, timeline,
      params: {cycle_time_ms: 5}  #   stall_check, library_options, logging)
    env:                    # HOROVOD_* variables as strings (given explicitly: adapters never read os.environ)
      HOROVOD_HIERARCHICAL_ALLREDUCE: "1"
    distributed_optimizer:  # DistributedOptimizer(...) keyword arguments
      compression: fp16     #   none / fp16; op: Average / Sum / Adasum; backward_passes_per_step; ...

A bare config-file YAML and a bare HOROVOD_* mapping are recognised too (``sniff``) and read as
``config_file`` / ``env``. Where one tunable is given in several places, Horovod's precedence applies: a flag
beats the config file, which beats the environment (the losers are IGNORED notes naming the winner).

``write`` produces all four sections: the same settings as flags, as a config file and as an environment,
and the optimizer arguments; :func:`command_line` turns the ``horovodrun`` section into an argument list.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from torsh.adapters._sniff import Shape, best
from torsh.adapters._torch_names import AUTO_SETTERS
from torsh.concepts.launch import HOROVOD_LOG_LEVELS
from torsh.config import MAX_BYTES_SIZE, TorshConfig, get_path
from torsh.dialect import Dialect, Prepared
from torsh.errors import ConfigError, Problem
from torsh.translate import (
    NOTHING,
    Fidelity,
    FieldMap,
    Hook,
    Ignored,
    Note,
    ReadContext,
    To,
    Translation,
    Unsupported,
    WriteContext,
    settle_auto,
)

NAME = "horovod"
VERSIONS = ("0.28.1",)
SECTIONS = ("horovodrun", "config_file", "env", "distributed_optimizer")
CONFIG_FILE_SECTIONS = ("controller", "params", "autotune", "timeline", "stall_check", "library_options", "logging")
_MIB = 1024 * 1024
_INT64 = 2**63
_NO_TORCH = "no effect under torch.distributed (a Horovod runtime knob); kept for a Horovod round trip"


@dataclass(frozen=True)
class Tunable:
    """One horovodrun tunable in its three spellings (flag dest, config-file path, environment variable)."""

    flag: str
    yaml: str
    env: str
    kind: str
    """int, float, bool, str, mb (fusion threshold: MB as a flag, bytes in the environment) or level."""
    core: str | None = None
    """Core path; None: a Horovod-only knob kept in extensions."""
    reason: str = _NO_TORCH
    fidelity: Fidelity = Fidelity.EXACT
    """Of the mapping to ``core`` (with ``reason`` saying why when approximate)."""
    inverted: str = ""
    """The spelling ("yaml" or "env") that holds the negation of the flag (stall_check.enabled, LOG_HIDE_TIME)."""


TUNABLES = (
    Tunable("fusion_threshold_mb", "params.fusion_threshold_mb", "HOROVOD_FUSION_THRESHOLD", "mb",
            "communication.fusion_threshold_bytes"),
    Tunable("cycle_time_ms", "params.cycle_time_ms", "HOROVOD_CYCLE_TIME", "float", "communication.cycle_time_ms"),
    Tunable("cache_capacity", "params.cache_capacity", "HOROVOD_CACHE_CAPACITY", "int"),
    Tunable("hierarchical_allreduce", "params.hierarchical_allreduce", "HOROVOD_HIERARCHICAL_ALLREDUCE", "bool",
            "communication.hierarchical_allreduce"),
    Tunable("hierarchical_allgather", "params.hierarchical_allgather", "HOROVOD_HIERARCHICAL_ALLGATHER", "bool",
            "communication.hierarchical_allgather"),
    Tunable("torus_allreduce", "params.torus_allreduce", "HOROVOD_TORUS_ALLREDUCE", "bool",
            reason="Horovod's 2-D torus allreduce has no torch.distributed equivalent; NCCL picks its own algorithm"),
    Tunable("autotune", "autotune.enabled", "HOROVOD_AUTOTUNE", "bool",
            reason="Horovod's Bayesian autotuning of fusion and cycle time; torch.distributed has no autotuner"),
    Tunable("autotune_log_file", "autotune.log_file", "HOROVOD_AUTOTUNE_LOG", "str"),
    Tunable("autotune_warmup_samples", "autotune.warmup_samples", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "int"),
    Tunable("autotune_steps_per_sample", "autotune.steps_per_sample", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "int"),
    Tunable("autotune_bayes_opt_max_samples", "autotune.bayes_opt_max_samples",
            "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "int"),
    Tunable("autotune_gaussian_process_noise", "autotune.gaussian_process_noise",
            "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "float"),
    Tunable("timeline_filename", "timeline.filename", "HOROVOD_TIMELINE", "str", "monitoring.timeline.filename"),
    Tunable("timeline_mark_cycles", "timeline.mark_cycles", "HOROVOD_TIMELINE_MARK_CYCLES", "bool",
            "monitoring.timeline.mark_cycles"),
    Tunable("no_stall_check", "stall_check.enabled", "HOROVOD_STALL_CHECK_DISABLE", "bool",
            reason="Horovod's stall inspector; torch.distributed reports hangs through its collective timeout",
            inverted="yaml"),
    Tunable("stall_check_warning_time_seconds", "stall_check.warning_time_seconds",
            "HOROVOD_STALL_CHECK_TIME_SECONDS", "int"),
    Tunable("stall_check_shutdown_time_seconds", "stall_check.shutdown_time_seconds",
            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "int"),
    Tunable("mpi_threads_disable", "library_options.mpi_threads_disable", "HOROVOD_MPI_THREADS_DISABLE", "bool"),
    Tunable("num_nccl_streams", "library_options.num_nccl_streams", "HOROVOD_NUM_NCCL_STREAMS", "int"),
    Tunable("thread_affinity", "library_options.thread_affinity", "HOROVOD_THREAD_AFFINITY", "int"),
    Tunable("gloo_timeout_seconds", "library_options.gloo_timeout_seconds", "HOROVOD_GLOO_TIMEOUT_SECONDS", "int",
            "communication.timeout_s", "Horovod's Gloo context timeout (default 30 s) becomes the process-group "
            "timeout, which also covers NCCL collectives", Fidelity.APPROXIMATE),
    Tunable("log_level", "logging.level", "HOROVOD_LOG_LEVEL", "level", "monitoring.log_level"),
    Tunable("log_with_timestamp", "logging.with_timestamp", "HOROVOD_LOG_HIDE_TIME", "bool", inverted="env"),
)  # fmt: skip
_PRECEDENCE = "a horovodrun flag beats --config-file, which beats the environment"

# --------------------------------------------------------------------------------------------------
# reading hooks


def _parse(value: Any, t: Tunable, form: str, ctx: ReadContext, path: str) -> Any:
    """The value in the flag's units and type, or NOTHING after recording a problem."""
    parsed, why = _from_env_text(value, t) if form == "env" else (value, "")
    why = why or _out_of_range(parsed, t)
    if why:
        ctx.problem(path, value, why)
        return NOTHING
    return str(parsed).upper() if t.kind == "level" else parsed


def _from_env_text(value: Any, t: Tunable) -> tuple[Any, str]:
    """An environment variable's text as Horovod parses it (strtol for integers and switches, strtod for floats)."""
    text = str(value).strip()
    if t.kind in ("bool", "int", "mb"):
        if not text.lstrip("-").isdigit():  # Horovod parses these with strtol: "true" would silently mean 0
            return NOTHING, ("Horovod reads this variable as an integer (strtol); write 1 or 0" if t.kind == "bool"
                             else "expected an integer")  # fmt: skip
        number = int(text)
        return (number > 0 if t.kind == "bool" else number / _MIB if t.kind == "mb" else number), ""
    if t.kind == "float":
        try:
            return float(text), ""
        except ValueError:
            return NOTHING, "expected a number"
    return text, ""


def _out_of_range(value: Any, t: Tunable) -> str:
    """Why horovodrun would refuse the value ("" when it accepts it)."""
    if t.kind == "level":
        known = str(value).upper() in HOROVOD_LOG_LEVELS
        return "" if known else f"unknown log level; expected one of {', '.join(HOROVOD_LOG_LEVELS)}"
    if t.kind not in ("int", "mb", "float"):
        return ""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return "must be a finite number >= 0 (horovodrun validates it)"
    return _bound(value, t)


def _bound(value: float, t: Tunable) -> str:
    """The bound of a finite number >= 0 that its kind or its flag sets."""
    if t.kind == "int" and (value != int(value) or value >= _INT64):
        return "must be a whole number below 2**63 (Horovod reads a 64-bit integer)"
    if t.kind == "mb" and value * _MIB > MAX_BYTES_SIZE:
        return f"a fusion buffer over {MAX_BYTES_SIZE // _MIB} MB (1 TiB) is not a real setting"
    if t.flag == "autotune_gaussian_process_noise" and not 0 <= value <= 1:
        return "must be in [0, 1] (horovodrun validates it)"
    return ""


@dataclass(frozen=True)
class Spelling(Hook):
    """A map entry for one spelling of a tunable: ``form`` says which (a horovodrun flag, a config-file key or an
    environment variable, parsed as Horovod parses it) and ``to`` where the value goes. Where several spellings
    are given, Horovod's precedence decides: a flag, then the config file, then the environment."""

    tunable: Tunable | None = None
    form: str = ""

    @property
    def to(self) -> str | None:
        """The core path (None: a Horovod-only knob, kept for a Horovod round trip)."""
        return self.tunable.core if self.tunable else None


def _spelling(t: Tunable, form: str) -> Spelling:
    return Spelling(read=partial(_read_spelling, t, form), tunable=t, form=form)


def _read_spelling(t: Tunable, form: str, value: Any, ctx: ReadContext, path: str) -> None:
    parsed = _parse(value, t, form, ctx, path)
    if parsed is NOTHING:
        return
    if t.core is None:
        ctx.keep(path, value)
        ctx.note(path, Fidelity.IGNORED, t.reason, value)
        return
    core_value = int(round(parsed * _MIB)) if t.kind == "mb" else parsed
    winner = ctx.origin.get(t.core)
    if winner is not None and winner != path:
        same = get_path(ctx.core, t.core) == core_value
        ctx.note(path, Fidelity.IGNORED, f"{'same value as' if same else 'overridden by'} {winner} ({_PRECEDENCE})",
                 value)  # fmt: skip
        return
    ctx.set(t.core, core_value, path, t.fidelity, t.reason if t.fidelity is not Fidelity.EXACT else "")
    if t.kind == "mb" and core_value > 0:
        ctx.set("ddp.bucket_cap_mb", core_value / _MIB, path, Fidelity.APPROXIMATE,
                "DDP buckets gradients in reverse parameter order up to this size and overlaps them with "
                "backward; Horovod fuses whatever is ready each cycle into one buffer of this size")  # fmt: skip


def _controller(value: Any, ctx: ReadContext, path: str) -> None:
    leaf = path.rsplit(".", 1)[-1]
    name = {"use_gloo": "gloo", "use_mpi": "mpi", "use_jsrun": "mpi"}.get(leaf, str(value).lower())
    if leaf.startswith("use_") and value is not True:
        ctx.note(path, Fidelity.IGNORED, "flag not given", value)
        return
    if name not in ("gloo", "mpi", "ccl"):
        ctx.problem(path, value, "No such controller supported; expected gloo or mpi")
        return
    winner = ctx.origin.get("communication.backend")
    if winner not in (None, path):
        same = get_path(ctx.core, "communication.backend") == name
        ctx.note(path, Fidelity.IGNORED, f"{'same value as' if same else 'overridden by'} {winner} ({_PRECEDENCE})",
                 value)  # fmt: skip
        return
    ctx.set("communication.backend", name, path, Fidelity.APPROXIMATE,
            "Horovod's controller and CPU collectives; GPU tensors use NCCL whatever the controller, as "
            "torch.distributed does with backend nccl")  # fmt: skip


def _hosts(value: Any, ctx: ReadContext, path: str) -> None:
    hosts = []
    for item in str(value).split(","):
        name, _, slots = item.strip().partition(":")
        if not name or not slots.isdigit():
            ctx.problem(path, value, "expected host:slots[,host:slots...] (e.g. 'node1:4,node2:4')")
            return
        hosts.append({"name": name, "slots": int(slots)})
    ctx.set("launch.hosts", hosts, path)


def _command(value: Any, ctx: ReadContext, path: str) -> None:
    args = list(value) if isinstance(value, list) else str(value).split()
    if args and args[0].rsplit("/", 1)[-1].startswith("python"):
        args = args[1:]
        if args[:1] == ["-m"]:
            ctx.set("launch.module", True, path, note=False)
            args = args[1:]
    else:
        ctx.set("launch.no_python", True, path, note=False)
    if args:
        ctx.set("launch.script", args[0], path)
        ctx.set("launch.script_args", args[1:], path, note=False)


def _elastic_note(value: Any, ctx: ReadContext, path: str) -> None:
    # Converted in _finalize_read, where slots per host are known.
    ctx.note(path, Fidelity.APPROXIMATE, "Horovod counts processes; torchrun counts nodes (divided by the slots per "
             "host, or nodes of one process each when no slots are given)", value,
             "launch.max_nnodes" if "max" in path else "launch.nnodes")  # fmt: skip


def _op(value: Any, ctx: ReadContext, path: str) -> None:
    op = str(value).rsplit(".", 1)[-1].lower()
    if op in ("average", "sum"):
        ctx.set("gradients.reduce_op", {"average": "mean", "sum": "sum"}[op], path)
    elif op == "adasum":
        ctx.keep(path, value)
        ctx.note(path, Fidelity.UNSUPPORTED, "Adasum's scale-invariant pairwise combination has no torch.distributed "
                 "equivalent; gradients will be averaged", value)  # fmt: skip
    elif op in ("min", "max", "product"):
        ctx.keep(path, value)
        ctx.note(path, Fidelity.UNSUPPORTED, f"a {op} of gradients is not a training reduction the engine runs", value)
    else:
        ctx.problem(path, value, "unknown op; expected Average, Sum, Adasum, Min, Max or Product")


def _finalize_read(ctx: ReadContext) -> None:
    run = ctx.raw.get("horovodrun") or {}
    low, high = run.get("min_num_proc"), run.get("max_num_proc")
    if low is None and high is None:
        return
    slots = run.get("slots") or _uniform_slots(get_path(ctx.core, "launch.hosts") or [])
    per_node = slots or 1
    if low is not None:
        ctx.set("launch.nnodes", max(1, -(-low // per_node)), "horovodrun.min_num_proc", note=False)
    if high is not None:
        ctx.set("launch.max_nnodes", max(1, high // per_node), "horovodrun.max_num_proc", note=False)
    ctx.set("launch.nproc_per_node", per_node, "horovodrun.slots" if slots else "horovodrun.min_num_proc", note=False)


def _uniform_slots(hosts: list[dict]) -> int | None:
    slots = {h.get("slots") for h in hosts}
    return slots.pop() if len(slots) == 1 else None


# --------------------------------------------------------------------------------------------------
# the map

#: Keys of Horovod's own config files from before 0.21.1 (its test configs and the 2019 config.default.yaml);
#: horovodrun 0.28.1 reads only the keys in TUNABLES and passes over these without a word.
_NOT_READ = "horovodrun 0.28.1 does not read this key, so it has no effect"
_AFFINITY = (f"the background thread's core in Horovod before 0.21.1; {_NOT_READ}: thread_affinity "
             "(HOROVOD_THREAD_AFFINITY) replaced it")
_OLD_CONFIG_KEYS = {
    "library_options.mlsl_bgt_affinity": _AFFINITY,
    "library_options.ccl_bgt_affinity": _AFFINITY,
    "library_options.mpi_threads_disabled": f"{_NOT_READ} (it reads library_options.mpi_threads_disable)",
    "autotune.batches_per_sample": f"Horovod's 2019 name of autotune.steps_per_sample; {_NOT_READ}",
    "timeline.enabled": f"{_NOT_READ}: the timeline is written when timeline.filename is set",
}
_OLD_ENV = {"HOROVOD_MLSL_BGT_AFFINITY": _AFFINITY, "HOROVOD_CCL_BGT_AFFINITY": _AFFINITY}
_RUNTIME = "set per process or per job by horovodrun at run time, not a setting"
_LAUNCH_ONLY = "a horovodrun launch option with no training meaning; the launch dialect translates launch commands"


def _config_file_keys_read(config: dict, notes: list[Note]) -> dict:
    """The config file without the keys horovodrun's config parser does not read: it takes each key it knows with
    ``section.get(key)`` and passes over every other one (a section it does not know, too), so these are DROPPED
    notes with a did-you-mean, never errors."""
    from torsh.errors import did_you_mean

    known = {k.split(".", 1)[1] for k in FIELD_MAP if k.startswith("config_file.")}
    sections = {k.split(".", 1)[0] for k in known}
    kept: dict = {}
    for section, value in config.items():
        if value is None:  # `if params:` / `if value is not None`: horovodrun skips it
            notes.append(Note(f"config_file.{section}", None, None, Fidelity.EXACT, "null: horovodrun skips it"))
            continue
        if section not in sections:
            guess = did_you_mean(str(section), sorted(sections))
            notes.append(Note(f"config_file.{section}", None, value, Fidelity.DROPPED, "horovodrun 0.28.1 reads no "
                              "such section (it passes over it)" + (f"; did you mean '{guess}'?" if guess else "")))
            continue
        if not isinstance(value, dict):
            kept[section] = value  # a section that is not a mapping: horovodrun fails on it, the schema says so
            continue
        kept[section] = {}
        for key, item in value.items():
            if item is None:  # _set_arg_from_config sets only what is not None
                notes.append(Note(f"config_file.{section}.{key}", None, None, Fidelity.EXACT, "null: horovodrun "
                                  "skips it, the flag's default applies"))  # fmt: skip
                continue
            if f"{section}.{key}" in known or not isinstance(key, str):
                kept[section][key] = item
                continue
            leaves = sorted(k.split(".", 1)[1] for k in known - set(_OLD_CONFIG_KEYS) if k.startswith(f"{section}."))
            guess = did_you_mean(key, leaves)
            notes.append(Note(f"config_file.{section}.{key}", None, item, Fidelity.DROPPED, "horovodrun 0.28.1 does "
                              "not read this key (it passes over it), so it has no effect"
                              + (f"; did you mean '{guess}'?" if guess else "")))  # fmt: skip
    return kept


def _field_map() -> dict[str, Any]:
    fmap: dict[str, Any] = {}
    for t in TUNABLES:
        fmap[f"horovodrun.{t.flag}"] = _spelling(t, "flag")
        fmap[f"config_file.{t.yaml}"] = _spelling(t, "yaml")
        fmap[f"env.{t.env}"] = _spelling(t, "env")
    fmap.update({
        "horovodrun.num_proc": "launch.world_size",
        "horovodrun.hosts": Hook(read=_hosts),
        "horovodrun.slots": To("launch.nproc_per_node", Fidelity.APPROXIMATE, "horovodrun's slots per host for "
                               "elastic jobs; torchrun starts this many processes on every node", write=False),
        "horovodrun.min_num_proc": Hook(read=_elastic_note),
        "horovodrun.max_num_proc": Hook(read=_elastic_note),
        "horovodrun.reset_limit": To("launch.max_restarts", Fidelity.APPROXIMATE,
                                     "Horovod counts resets of the worker set; torchrun counts worker-group restarts"),
        "horovodrun.host_discovery_script": Unsupported("torchrun finds nodes by rendezvous (every node runs "
                                                        "torchrun --nnodes MIN:MAX); there is no discovery script"),
        "horovodrun.command": Hook(read=_command),
        "horovodrun.use_gloo": Hook(read=_controller),
        "horovodrun.use_mpi": Hook(read=_controller),
        "horovodrun.use_jsrun": Hook(read=_controller),
        "config_file.controller": Hook(read=_controller),
        "env.HOROVOD_CONTROLLER": Hook(read=_controller),
        "env.HOROVOD_CPU_OPERATIONS": Hook(read=_controller),
        "config_file.logging.hide_timestamp": Ignored("Horovod silently ignores it: horovodrun reads "
                                                      "logging.with_timestamp (its own sample file uses this key)"),
        "distributed_optimizer.compression": "compression.method",
        "distributed_optimizer.backward_passes_per_step": To(
            "batch.gradient_accumulation_steps", Fidelity.APPROXIMATE,
            "Horovod sums the passes' gradients and leaves loss scaling to the script; torsh.initialize's engine "
            "divides the loss by the steps as DeepSpeed does (torsh.horovod keeps Horovod's sum)"),
        "distributed_optimizer.op": Hook(read=_op),
        "distributed_optimizer.gradient_predivide_factor": "gradients.predivide_factor",
        "distributed_optimizer.groups": Ignored("groups only batch Horovod's allreduce calls; the numbers are equal"),
        "distributed_optimizer.num_groups": Ignored("deprecated spelling of groups; only batches allreduce calls"),
        "distributed_optimizer.sparse_as_dense": Ignored("sparse gradients are reduced densely by torch DDP anyway"),
        "distributed_optimizer.named_parameters": Ignored("Python objects of the script, not a setting", keep=False),
        "distributed_optimizer.process_set": Unsupported("Horovod process sets (sub-communicators) are not "
                                                         "expressed by the core model; all ranks reduce together"),
    })  # fmt: skip
    fmap.update({f"config_file.{key}": Ignored(why) for key, why in _OLD_CONFIG_KEYS.items()})
    fmap.update({f"env.{var}": Ignored(why) for var, why in _OLD_ENV.items()})
    for flag in ("start_timeout", "nics", "output_filename", "verbose", "config_file", "ssh_port",
                 "ssh_identity_file", "disable_cache", "elastic_timeout", "cooldown_range", "hostfile", "mpi_args",
                 "tcp_flag", "binding_args", "prefix_output_with_timestamp"):  # fmt: skip
        fmap[f"horovodrun.{flag}"] = Ignored(_LAUNCH_ONLY)
    for var in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "HOSTNAME",
                "GLOO_RENDEZVOUS_ADDR", "GLOO_RENDEZVOUS_PORT", "GLOO_IFACE"):  # fmt: skip
        fmap[f"env.HOROVOD_{var}"] = Ignored(_RUNTIME, keep=False)
    for var in ("ELASTIC", "START_TIMEOUT", "ELASTIC_TIMEOUT", "CCL_CACHE", "ADASUM_MPI_CHUNK_SIZE",
                "BATCH_D2D_MEMCOPIES", "DISABLE_GROUP_FUSION", "DISABLE_NVTX_RANGES", "ENABLE_ASYNC_COMPLETION",
                "DYNAMIC_PROCESS_SETS", "ENABLE_XLA_OPS"):  # fmt: skip
        fmap[f"env.HOROVOD_{var}"] = Ignored(_NO_TORCH)
    return fmap


FIELD_MAP = _field_map()
VALUE_MAPS = {
    "distributed_optimizer.compression": {"none": "none", "fp16": "fp16", "Compression.none": "none",
                                          "Compression.fp16": "fp16", "hvd.Compression.none": "none",
                                          "hvd.Compression.fp16": "fp16"},
}  # fmt: skip
ALIASES: dict[str, str] = {}
_BUILD_TIME = ("HOROVOD_WITH_", "HOROVOD_WITHOUT_", "HOROVOD_GPU", "HOROVOD_BUILD_", "HOROVOD_CPU_OPERATIONS_")

# --------------------------------------------------------------------------------------------------
# sniff and read


#: The four-section layout (1), and a bare config-file YAML or HOROVOD_* environment (0.9): horovodrun passes over
#: a config file's other keys, and the environment holds other variables (written in capitals) too.
FOUR_SECTIONS = Shape(1.0, (SECTIONS,))
CONFIG_FILE = Shape(0.9, (CONFIG_FILE_SECTIONS,), tables={"logging"}, excludes=SECTIONS)
ENV = Shape(0.9, ({"HOROVOD_*"},), {"[A-Z]*"}, where=lambda raw: all(isinstance(k, str) and not isinstance(
    v, (dict, list)) for k, v in raw.items()))  # fmt: skip
SHAPES = (FOUR_SECTIONS, CONFIG_FILE, ENV)


def _bare_section(raw: Any) -> str:
    """The section a bare config-file YAML or HOROVOD_* mapping stands for ("" for the four-section layout)."""
    return "config_file" if CONFIG_FILE.confidence(raw) else "env" if ENV.confidence(raw) else ""


def _unwrap(path: str, wrapped: str) -> str:
    return path[len(wrapped) + 1:] if wrapped and path.startswith(wrapped + ".") else path


def _run_time_env(env: dict, notes: list[Note]) -> dict:
    """The HOROVOD_* variables Horovod reads at run time; the others get an ignored note each."""
    kept = {}
    for key, value in env.items():
        if isinstance(key, str) and key.startswith("HOROVOD_") and not key.startswith(_BUILD_TIME):
            kept[key] = value
            continue
        built = str(key).startswith("HOROVOD_")
        why = "read when Horovod is built, not at run time" if built else "not a Horovod variable"
        notes.append(Note(f"env.{key}", None, value, Fidelity.IGNORED, why))
    return kept


def _flags_as_parsed(flags: dict, notes: list[Note]) -> dict:
    """The ``horovodrun`` section as horovodrun's argument parser gives it: a null is a flag not given (argparse's
    default None), and a number written as text is converted by the option's type as argparse converts the
    command line's words (``int("4")``; a text it cannot convert stays, for the schema to refuse)."""
    from torsh import schemas

    types = {k: v.get("type") for k, v in schemas.load(NAME)["properties"]["horovodrun"]["properties"].items()}
    out = {}
    for key, value in flags.items():
        if value is None:
            notes.append(Note(f"horovodrun.{key}", None, None, Fidelity.IGNORED, "null: the flag is not given "
                              "(horovodrun's default applies)"))  # fmt: skip
            continue
        convert = {"integer": int, "number": float}.get(str(types.get(key)))
        if isinstance(value, str) and convert is not None:
            try:
                value = convert(value)
            except ValueError:
                pass
        elif key == "cooldown_range" and isinstance(value, list) and all(isinstance(v, str) for v in value):
            try:
                value = [int(v) for v in value]
            except ValueError:
                pass
        out[key] = value
    return out


class Horovod(Dialect):
    """Horovod's four places of settings; a bare config file or environment is read as its section.

    Notes and errors name keys as the user wrote them: ``params.cycle_time_ms`` for a bare config file,
    ``config_file.params.cycle_time_ms`` in the four-section layout.
    """

    NAME = NAME
    VERSIONS = VERSIONS
    FIELD_MAP = FIELD_MAP
    VALUE_MAPS = VALUE_MAPS
    ALIASES = ALIASES
    SHAPE = "a mapping"
    SCHEMA_NAMES_UNKNOWN_KEYS = False  # unknown keys are the map's to report, with a did-you-mean

    def read(self, raw: Any, *, version: str | None = None, base_dir: Any = None) -> Translation[TorshConfig]:
        wrapped = _bare_section(raw)
        try:
            result = super().read({wrapped: raw} if wrapped else raw, version=version)
        except ConfigError as exc:
            raise ConfigError([replace(p, path=_unwrap(p.path, wrapped)) for p in exc.problems], source=NAME) from None
        result.notes[:] = [replace(n, source_path=_unwrap(n.source_path, wrapped)) for n in result.notes]
        return result

    def shape(self, raw: Any) -> Any:
        raw = super().shape(raw)
        for section in SECTIONS:
            if section in raw and not isinstance(raw[section], (dict, type(None))):
                raise ConfigError([Problem(section, raw[section], f"the {section} section must be a mapping")],
                                  source=NAME)  # fmt: skip
        return raw

    def check_schema(self, raw: Any) -> None:
        """Checked in ``normalise``, on the environment Horovod reads."""

    def normalise(self, raw: Any, prepared: Prepared) -> Prepared:
        """Sections in precedence order (flag, config file, environment), and the environment without what Horovod
        never reads at run time (a note each)."""
        env = _run_time_env(raw.get("env") or {}, prepared.notes)
        ordered = {k: raw[k] for k in SECTIONS if k in raw} | {k: v for k, v in raw.items() if k not in SECTIONS}
        if "env" in ordered:
            ordered["env"] = env
        if isinstance(ordered.get("config_file"), dict):
            ordered["config_file"] = _config_file_keys_read(ordered["config_file"], prepared.notes)
        if isinstance(ordered.get("horovodrun"), dict):
            ordered["horovodrun"] = _flags_as_parsed(ordered["horovodrun"], prepared.notes)
        super().check_schema(ordered)
        prepared.data = ordered
        return prepared

    def finalize(self, ctx: ReadContext, prepared: Prepared) -> None:
        _finalize_read(ctx)

    def write_map(self, version: str | None) -> FieldMap:
        return _WRITE_MAP

    def finish_write(self, ctx: WriteContext, version: str | None) -> None:
        # Horovod has no "auto": what the source left to the launcher or the script is not written (deferred notes).
        settle_auto(ctx, AUTO_SETTERS)

    def sniff(self, raw: Any) -> float:
        """The four-section layout, a bare config-file YAML or a HOROVOD_* environment (``SHAPES``)."""
        return best(SHAPES, raw)


# --------------------------------------------------------------------------------------------------
# write


def _env_text(value: Any) -> str:
    return ("1" if value else "0") if isinstance(value, bool) else str(value)


def _write_kept_tunable(t: Tunable, kept: dict, ctx: WriteContext) -> None:
    """A Horovod-only knob kept from a Horovod source, written in all three spellings."""
    for form, path in (("flag", f"horovodrun.{t.flag}"), ("yaml", f"config_file.{t.yaml}"), ("env", f"env.{t.env}")):
        if path not in kept:
            continue
        value = _kept_value(t, form, path, kept[path])
        flag_value = (not value) if t.inverted == form else value
        for out_form, out_path in (("flag", f"horovodrun.{t.flag}"), ("yaml", f"config_file.{t.yaml}"),
                                   ("env", f"env.{t.env}")):  # fmt: skip
            out = (not flag_value) if t.inverted == out_form else flag_value
            ctx.put(out_path, _env_text(out) if out_form == "env" else out, f"extensions.horovod.{path}",
                    Fidelity.EXACT, "kept from the source" if out_path == path else f"same setting as {path}")
        return


def _kept_value(t: Tunable, form: str, path: str, value: Any) -> Any:
    """A kept knob's value in the flag's type, checked as the reader checks it (the extensions of a torsh file are
    written by hand, so a kept value may never have been read from Horovod)."""
    ctx = ReadContext(raw={}, dialect=NAME)
    parsed = _parse(value, t, form, ctx, f"extensions.horovod.{path}")
    if ctx.problems:
        raise ConfigError(ctx.problems, source=NAME)
    if t.kind in ("str", "level"):
        return str(parsed)
    return parsed * _MIB if t.kind == "mb" else parsed


def _write_tunables(cfg: TorshConfig, ctx: WriteContext) -> None:
    """Every tunable in its three spellings: from the core model, or kept from a Horovod source."""
    kept = cfg.extensions.get(NAME, {})
    for t in TUNABLES:
        if t.core is None:
            _write_kept_tunable(t, kept, ctx)
        else:
            _write_core_tunable(t, cfg, ctx)
    if cfg.communication.timeout_s is not None and not float(cfg.communication.timeout_s).is_integer():
        ctx.note("communication.timeout_s", Fidelity.APPROXIMATE, "Horovod takes whole seconds",
                 cfg.communication.timeout_s)
    if cfg.communication.fusion_threshold_bytes is not None and cfg.ddp.bucket_cap_mb != 25.0:
        ctx.note("ddp.bucket_cap_mb", Fidelity.APPROXIMATE, "Horovod has no DDP buckets; its fusion threshold is "
                 "written from communication.fusion_threshold_bytes", cfg.ddp.bucket_cap_mb)  # fmt: skip


def _tunable_source(t: Tunable, cfg: TorshConfig) -> tuple[Any, str, Fidelity, str]:
    """A tunable's value and the core field it comes from (the fusion threshold from DDP's bucket size when only
    that is set), with the fidelity of writing it."""
    value = get_path(cfg, t.core)
    if t.kind == "int" and isinstance(value, float):
        value = int(round(value))
    bucket = cfg.ddp.bucket_cap_mb
    if t.kind == "mb" and value is None and bucket != 25.0 and isinstance(bucket, float):
        return int(bucket * _MIB), "ddp.bucket_cap_mb", Fidelity.APPROXIMATE, ("from ddp.bucket_cap_mb: Horovod "
                                                                               "fuses per cycle, not per bucket")
    return value, t.core, t.fidelity, t.reason if t.fidelity is not Fidelity.EXACT else ""


def _write_core_tunable(t: Tunable, cfg: TorshConfig, ctx: WriteContext) -> None:
    value, source, fidelity, reason = _tunable_source(t, cfg)
    if value is None or value is False:
        return
    flag_value = value
    if t.kind == "mb" and value % _MIB == 0:
        flag_value = value // _MIB
    elif t.kind == "mb":  # horovodrun's flag and config file take whole MB
        reason = "horovodrun takes whole MB; the exact byte count is in HOROVOD_FUSION_THRESHOLD"
        fidelity, flag_value = Fidelity.APPROXIMATE, max(1, round(value / _MIB))
    ctx.put(f"horovodrun.{t.flag}", flag_value, source, fidelity, reason)
    ctx.put(f"config_file.{t.yaml}", flag_value, source, fidelity, reason)
    ctx.put(f"env.{t.env}", _env_text(value), source, Fidelity.EXACT if t.kind == "mb" else fidelity, reason)


def _write_backend(cfg: TorshConfig, ctx: WriteContext) -> None:
    backend = cfg.communication.backend
    if backend in ("gloo", "mpi"):
        ctx.put(f"horovodrun.use_{backend}", True, "communication.backend", Fidelity.APPROXIMATE,
                "Horovod's controller; GPU tensors still go through NCCL when Horovod is built with it")
        ctx.put("config_file.controller", backend, "communication.backend", Fidelity.APPROXIMATE)
        ctx.put("env.HOROVOD_CONTROLLER", backend, "communication.backend", Fidelity.APPROXIMATE)
        ctx.put("env.HOROVOD_CPU_OPERATIONS", backend, "communication.backend", Fidelity.APPROXIMATE)
    elif backend in ("nccl", "ccl"):
        ctx.note("communication.backend", Fidelity.APPROXIMATE, f"Horovod uses {backend.upper()} when it is built "
                 f"with it (HOROVOD_GPU_OPERATIONS / HOROVOD_CPU_OPERATIONS={backend}); no run-time setting", backend)


def _write_launch(cfg: TorshConfig, ctx: WriteContext) -> None:
    """The horovodrun section: hosts, process counts (elastic ranges in processes), restarts, the command."""
    launch = cfg.launch
    if launch.hosts and all(h.slots for h in launch.hosts):
        ctx.put("horovodrun.hosts", ",".join(f"{h.name}:{h.slots}" for h in launch.hosts), "launch.hosts")
    elif launch.hosts:
        ctx.note("launch.hosts", Fidelity.UNSUPPORTED, "horovodrun -H needs slots for every host", launch.hosts)
    _write_process_counts(launch, ctx)
    if launch.max_restarts is not None:
        ctx.put("horovodrun.reset_limit", launch.max_restarts, "launch.max_restarts", Fidelity.APPROXIMATE,
                "torchrun counts worker-group restarts, Horovod resets of the worker set")
    if launch.script:
        ctx.put("horovodrun.command", [*_python(launch), launch.script, *launch.script_args], "launch.script")
    for path in ("master_addr", "master_port", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id"):
        if getattr(launch, path) is not None:
            ctx.note(f"launch.{path}", Fidelity.DROPPED, "horovodrun runs its own rendezvous", getattr(launch, path))


def _python(launch: Any) -> list[str]:
    """What runs the script: horovodrun runs a command, so Python is spelled (``-m`` for a module)."""
    return [] if launch.no_python else ["python", "-m"] if launch.module else ["python"]


def _write_process_counts(launch: Any, ctx: WriteContext) -> None:
    """-np from the world size or nodes x processes per node, and an elastic range in processes."""
    per_node = launch.nproc_per_node if isinstance(launch.nproc_per_node, int) else None
    if launch.max_nnodes is not None:
        _write_elastic_range(launch, per_node, ctx)
    world = launch.world_size or (launch.nnodes * per_node if launch.nnodes and per_node else None)
    if world:
        ctx.put("horovodrun.num_proc", world, "launch.world_size" if launch.world_size else "launch.nproc_per_node")


def _write_elastic_range(launch: Any, per_node: int | None, ctx: WriteContext) -> None:
    """torchrun's node range as horovodrun's process range (nodes x processes per node)."""
    why = "torchrun counts nodes, horovodrun processes: nodes x nproc_per_node"
    ctx.put("horovodrun.min_num_proc", (launch.nnodes or 1) * (per_node or 1), "launch.nnodes", Fidelity.APPROXIMATE,
            why)
    ctx.put("horovodrun.max_num_proc", launch.max_nnodes * (per_node or 1), "launch.max_nnodes", Fidelity.APPROXIMATE,
            why)
    if per_node:
        ctx.put("horovodrun.slots", per_node, "launch.nproc_per_node")


def _write_optimizer(cfg: TorshConfig, ctx: WriteContext) -> None:
    method = cfg.compression.method
    if method == "fp16":
        ctx.put("distributed_optimizer.compression", "fp16", "compression.method")
    elif method != "none":
        ctx.note("compression.method", Fidelity.UNSUPPORTED, f"Horovod compresses only to fp16 (Compression.fp16); "
                 f"it has no {method} compressor", method)  # fmt: skip
    op = cfg.gradients.reduce_op
    if op != "mean":
        ctx.put("distributed_optimizer.op", {"sum": "Sum", "adasum": "Adasum"}[op], "gradients.reduce_op")
    if cfg.gradients.prescale:
        ctx.note("gradients.prescale", Fidelity.APPROXIMATE, "Horovod has no prescale switch; "
                 "gradient_predivide_factor=size() divides before the sum", True)  # fmt: skip
    if cfg.sharding.stage > 0:
        ctx.note("sharding.stage", Fidelity.UNSUPPORTED, "Horovod replicates parameters, gradients and optimizer "
                 f"state on every rank: it has no ZeRO / FSDP sharding (stage {cfg.sharding.stage})",
                 cfg.sharding.stage)  # fmt: skip


def _write_all(cfg: TorshConfig, ctx: WriteContext) -> None:
    for write_part in (_write_tunables, _write_backend, _write_launch, _write_optimizer):
        write_part(cfg, ctx)


_CLAIMED_COMMUNICATION = ("backend", "fusion_threshold_bytes", "cycle_time_ms", "timeout_s", "hierarchical_allreduce",
                          "hierarchical_allgather")  # fmt: skip
_CLAIMED_LAUNCH = ("hosts", "nproc_per_node", "nnodes", "max_nnodes", "world_size", "max_restarts", "script",
                   "script_args", "module", "no_python", "master_addr", "master_port", "node_rank", "rdzv_backend",
                   "rdzv_endpoint", "rdzv_id")  # fmt: skip
_WRITE_HOOKS = Hook(write=_write_all, claims=(
    *(f"communication.{k}" for k in _CLAIMED_COMMUNICATION), *(f"launch.{k}" for k in _CLAIMED_LAUNCH),
    "monitoring.timeline", "monitoring.log_level", "ddp.bucket_cap_mb", "compression.method", "gradients.reduce_op",
    "gradients.prescale", "sharding.stage"))  # fmt: skip
_WRITE_MAP = FieldMap({**FIELD_MAP, "__write__": _WRITE_HOOKS}, ALIASES)


DIALECT = Horovod()
globals().update(DIALECT.exports())


def command_line(flags: dict[str, Any]) -> list[str]:
    """horovodrun's argument list for a ``horovodrun`` section (flag dests), the training command last."""
    spelled = {"num_proc": "-np", "hosts": "-H", "min_num_proc": "--min-np", "max_num_proc": "--max-np",
               "slots": "--slots-per-host", "use_gloo": "--gloo", "use_mpi": "--mpi", "use_jsrun": "--jsrun",
               "no_stall_check": "--no-stall-check", "nics": "--network-interfaces", "tcp_flag": "--tcp",
               "log_with_timestamp": "--log-with-timestamp"}  # fmt: skip
    argv = ["horovodrun"]
    for dest, value in flags.items():
        if dest == "command":
            continue
        flag = spelled.get(dest, "--" + dest.replace("_", "-"))
        if value is True:
            argv.append(flag)
        elif value is False:
            if dest in ("hierarchical_allreduce", "hierarchical_allgather", "torus_allreduce", "autotune",
                        "timeline_mark_cycles", "mpi_threads_disable"):  # fmt: skip
                argv.append("--no-" + dest.replace("_", "-"))
            elif dest == "log_with_timestamp":
                argv.append("--log-without-timestamp")
        else:
            argv += [flag, *map(str, value if isinstance(value, list) else [value])]
    return argv + [str(a) for a in flags.get("command", [])]
