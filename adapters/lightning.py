"""Lightning's strategies: the arguments of ``DeepSpeedStrategy(...)``, ``FSDPStrategy(...)`` or
``ModelParallelStrategy(...)`` (Lightning 2.x; the last in ``_lightning_model_parallel``), with
the ``Trainer`` / ``Fabric`` arguments of the same call that bear on distribution, as a mapping::

    {"Trainer": {"devices": 4, "num_nodes": 1, "precision": "bf16-mixed"},
     "DeepSpeedStrategy": {"stage": 3, "offload_optimizer": true}}

``DeepSpeedStrategy`` either takes a whole DeepSpeed ``config`` or builds one from its keyword arguments (stage 2,
bucket sizes of 2e8, offload flags, ...); either way the config it would hand DeepSpeed is read through the deepspeed
dialect, with the Trainer's precision added as Lightning adds it. ``FSDPStrategy`` wraps FSDP1
``FullyShardedDataParallel``: its arguments are read through the fsdp dialect, with Lightning's own spellings
(``state_dict_type="full"``, class sets such as ``{Block}`` for the wrap and checkpointing policies, a
``device_mesh=(replicate, shard)`` tuple). Values computed at run time are kept as expressions and reported.
Writing gives ``DeepSpeedStrategy(config=...)`` (default) or, with ``--variant fsdp``, ``FSDPStrategy`` arguments.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from torsh import schemas
from torsh.config import MAX_PROCESSES, MAX_PROCESSES_PER_NODE, TorshConfig
from torsh.errors import ConfigError, Problem
from torsh.translate import Fidelity, Note, Translation

from . import deepspeed, fsdp
from ._sniff import Shape, best

NAME = "lightning"
VERSIONS = ("deepspeed", "fsdp")
DEFAULT_FORMAT = "json"
FIELD_MAP: dict[str, Any] = {}
VALUE_MAPS: dict[str, dict] = {}
ALIASES: dict[str, str] = {}
STRATEGIES = ("DeepSpeedStrategy", "FSDPStrategy", "ModelParallelStrategy")
LAUNCH = ("Trainer", "Fabric")
#: DeepSpeedStrategy's keyword defaults (Lightning 2.x) that shape the config it builds.
_DS_DEFAULTS = {"zero_optimization": True, "stage": 2, "offload_optimizer": False, "offload_parameters": False,
                "offload_params_device": "cpu", "offload_optimizer_device": "cpu", "nvme_path": "/local_nvme",
                "pin_memory": False, "contiguous_gradients": True, "overlap_comm": True, "allgather_partitions": True,
                "reduce_scatter": True, "allgather_bucket_size": 200_000_000, "reduce_bucket_size": 200_000_000,
                "sub_group_size": 1_000_000_000_000, "zero_allow_untested_optimizer": True,
                "partition_activations": False, "cpu_checkpointing": False,
                "contiguous_memory_optimization": False, "synchronize_checkpoint_boundary": False}  # fmt: skip
_ZERO_KEYS = ("stage", "contiguous_gradients", "overlap_comm", "allgather_partitions", "reduce_scatter",
              "allgather_bucket_size", "reduce_bucket_size", "sub_group_size")  # fmt: skip
_CHECKPOINTING = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                  "synchronize_checkpoint_boundary")  # fmt: skip
_OFFLOAD_TUNING = ("params_buffer_count", "params_buffer_size", "max_in_cpu", "optimizer_buffer_count", "queue_depth",
                   "single_submit", "overlap_events", "thread_count")  # fmt: skip
_STRATEGY_ONLY = {"remote_device": "where the model is built before DeepSpeed takes it (deepspeed.zero.Init)",
                  "logging_level": "DeepSpeed's log level", "load_full_weights": "how a checkpoint is loaded",
                  "exclude_frozen_parameters": "what a checkpoint saves", "process_group_backend": "the backend "
                  "(torsh picks nccl or gloo)", "timeout": "the process-group timeout", "accelerator": "the device"}
#: DeepSpeedStrategy's keyword arguments (Lightning 2.6); any other name is a TypeError in Lightning.
_DS_ARGUMENTS = frozenset((
    "accelerator", "allgather_bucket_size", "allgather_partitions", "block_size", "cluster_environment", "config",
    "contiguous_gradients", "contiguous_memory_optimization", "cpu_checkpointing", "exclude_frozen_parameters",
    "hysteresis", "initial_scale_power", "load_full_weights", "logging_batch_size_per_gpu", "logging_level",
    "loss_scale", "loss_scale_window", "max_in_cpu", "min_loss_scale", "nvme_path", "offload_optimizer",
    "offload_optimizer_device", "offload_parameters", "offload_params_device", "optimizer_buffer_count",
    "overlap_comm", "overlap_events", "parallel_devices", "params_buffer_count", "params_buffer_size",
    "partition_activations", "pin_memory", "precision_plugin", "process_group_backend", "queue_depth",
    "reduce_bucket_size", "reduce_scatter", "remote_device", "single_submit", "stage", "sub_group_size",
    "synchronize_checkpoint_boundary", "thread_count", "timeout", "zero_allow_untested_optimizer",
    "zero_optimization"))  # fmt: skip
#: Arguments Lightning copies into the DeepSpeed config unchecked: DeepSpeed's reader judges them (as here the
#: deepspeed dialect does), not a type of Lightning's.
_PASSED_TO_DEEPSPEED = frozenset((*_ZERO_KEYS, *_CHECKPOINTING, "zero_allow_untested_optimizer", "pin_memory",
                                  "nvme_path", "offload_optimizer_device", "offload_params_device"))  # fmt: skip
#: The fp16 loss-scaling arguments, which Lightning puts in the config's fp16 section under 16-bit precision.
_LOSS_SCALING = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")
_PRECISION = {"16-mixed": "fp16", "16": "fp16", "16-true": "fp16", "bf16-mixed": "bf16", "bf16": "bf16",
              "bf16-true": "bf16", "32-true": "fp32", "32": "fp32", "64-true": None, "64": None}  # fmt: skip


def _classes(value: Any) -> list[str] | None:
    """Module class names from a class set as written in code (``{Block}``, ``{A, B}``) or a list of names."""
    if isinstance(value, list) and all(isinstance(v, str) and v.isidentifier() for v in value):
        return value
    found = re.fullmatch(r"\{\s*([\w.]+(?:\s*,\s*[\w.]+)*)\s*,?\s*\}", value) if isinstance(value, str) else None
    return [c.strip().rsplit(".", 1)[-1] for c in found.group(1).split(",")] if found else None


def _launch_notes(section: str, args: dict, notes: list[Note]) -> str | None:
    """The Trainer / Fabric arguments: precision is returned (Lightning hands it to the strategy); the rest noted."""
    precision = None
    for key, value in args.items():
        path = f"{section}.{key}"
        if key == "precision":
            precision = _PRECISION.get(str(value))
            if str(value) not in _PRECISION:
                notes.append(Note(path, None, value, Fidelity.DROPPED, "not one of Lightning's precisions (an "
                                  "expression of the script?): the precision is not known"))  # fmt: skip
        elif key in ("devices", "num_nodes"):
            count = _count(path, value)
            notes.append(Note(path, f"launch.{'nproc_per_node' if key == 'devices' else 'nnodes'}", value,
                              Fidelity.DROPPED if count is None else Fidelity.EXACT,
                              "decided when the script runs" if count is None else ""))
        else:
            notes.append(Note(path, None, value, Fidelity.IGNORED, "not a distributed setting"))
    return precision


def _count(path: str, value: Any) -> int | None:
    """A whole ``devices`` / ``num_nodes`` count (None: a list, a string, ``devices=-1``: known when it runs)."""
    if not isinstance(value, int) or isinstance(value, bool) or (path.endswith("devices") and value == -1):
        return None
    limit = MAX_PROCESSES_PER_NODE if path.endswith("devices") else MAX_PROCESSES
    if not 0 < value <= limit:
        raise ConfigError([Problem(path, value, f"Lightning needs a count from 1 to {limit} here"
                                   + (" (or -1: every device of the node)" if path.endswith("devices") else ""))],
                          source=NAME)  # fmt: skip
    return value


def _deepspeed_config(args: dict, notes: list[Note]) -> tuple[dict, dict[str, str]]:
    """The DeepSpeed config DeepSpeedStrategy builds from its arguments, and which argument gave each key."""
    if isinstance(args.get("config"), dict):
        return dict(args["config"]), {}
    a = {**_DS_DEFAULTS, **args}
    config: dict[str, Any] = {"activation_checkpointing": {k: a[k] for k in _CHECKPOINTING}}
    origin = {f"activation_checkpointing.{k}": f"DeepSpeedStrategy.{k}" for k in _CHECKPOINTING}
    if "block_size" in args:  # Lightning writes it to aio.block_size (NVMe offload's request size)
        config["aio"] = {"block_size": args["block_size"]}
        origin["aio.block_size"] = "DeepSpeedStrategy.block_size"
    if a["zero_optimization"]:
        zero = {k: a[k] for k in _ZERO_KEYS}
        origin.update({f"zero_optimization.{k}": f"DeepSpeedStrategy.{k}" for k in _ZERO_KEYS})
        _offload(a, args, zero, origin, notes)
        config.update(zero_allow_untested_optimizer=a["zero_allow_untested_optimizer"], zero_optimization=zero)
        origin["zero_allow_untested_optimizer"] = "DeepSpeedStrategy.zero_allow_untested_optimizer"
    if a.get("logging_batch_size_per_gpu", "auto") != "auto":
        config["train_micro_batch_size_per_gpu"] = a["logging_batch_size_per_gpu"]
    _unused_arguments(args, a, set(origin.values()), notes)
    return config, origin


def _offload(a: dict, args: dict, zero: dict, origin: dict, notes: list[Note]) -> None:
    """The offload sections DeepSpeedStrategy builds from its flags, devices, pin_memory and nvme_path."""
    for flag, key, device in (("offload_optimizer", "offload_optimizer", "offload_optimizer_device"),
                              ("offload_parameters", "offload_param", "offload_params_device")):
        if not a[flag]:
            continue
        zero[key] = {"device": a[device], "pin_memory": a["pin_memory"]}
        origin[f"zero_optimization.{key}.device"] = f"DeepSpeedStrategy.{device if device in args else flag}"
        if device in args and flag in args:
            notes.append(Note(f"DeepSpeedStrategy.{flag}", None, True, Fidelity.EXACT, f"offload to {device}"))
        origin[f"zero_optimization.{key}.pin_memory"] = "DeepSpeedStrategy.pin_memory"
        if a[device] == "nvme" or "nvme_path" in args:  # Lightning writes the path into every offload section
            zero[key]["nvme_path"] = a["nvme_path"]
            origin[f"zero_optimization.{key}.nvme_path"] = "DeepSpeedStrategy.nvme_path"


def _unused_arguments(args: dict, a: dict, used: set[str], notes: list[Note]) -> None:
    """Arguments that configure nothing DeepSpeed reads here (or only how Lightning runs)."""
    for key, value in args.items():
        if key in ("offload_params_device", "offload_optimizer_device"):
            flag = "offload_parameters" if key.startswith("offload_params") else "offload_optimizer"
            if a[flag]:
                continue  # the device of the offload the flag asks for: noted as the offload
            notes.append(Note(f"DeepSpeedStrategy.{key}", None, value, Fidelity.IGNORED, f"no effect without {flag}"))
        elif key in ("nvme_path", "pin_memory") and f"DeepSpeedStrategy.{key}" not in used:
            notes.append(Note(f"DeepSpeedStrategy.{key}", None, value, Fidelity.IGNORED, "no effect without offload"
                              + (" to nvme" if key == "nvme_path" else "")))  # fmt: skip
        elif key in _STRATEGY_ONLY or key in _OFFLOAD_TUNING:
            notes.append(Note(f"DeepSpeedStrategy.{key}", None, value, Fidelity.IGNORED, _STRATEGY_ONLY.get(
                key, "an offload I/O tuning value; memory and speed, not results")))  # fmt: skip
        elif key in ("cluster_environment", "parallel_devices", "precision_plugin"):
            notes.append(Note(f"DeepSpeedStrategy.{key}", None, value, Fidelity.IGNORED, "how Lightning runs"))


def _state_dict_type(value: Any, path: str, origin: dict, notes: list[Note]) -> Any:
    return f"{value.upper()}_STATE_DICT" if value in ("full", "sharded") else value


def _auto_wrap_policy(value: Any, path: str, origin: dict, notes: list[Note]) -> Any:
    if _classes(value) is None:
        return value
    origin["auto_wrap_policy.transformer_layer_cls"] = path
    return {"transformer_layer_cls": _classes(value)}


def _device_mesh(value: Any, path: str, origin: dict, notes: list[Note]) -> Any:
    if not isinstance(value, list) or len(value) != 2:
        return value
    origin["device_mesh.shape"] = path
    return {"shape": value}


def _checkpointing(value: Any, path: str, origin: dict, notes: list[Note]) -> Any:
    """Lightning's activation checkpointing argument: the blocks (a class set or one name), applied after FSDP."""
    classes = _classes(value) if not isinstance(value, str) or value.startswith("{") else [value]
    notes.append(Note(path, "activation_checkpointing.modules", value, Fidelity.EXACT if classes else
                      Fidelity.DROPPED, "the blocks checkpointed" if classes else "a policy object of the script: "
                      "which blocks are checkpointed is not in the file"))  # fmt: skip
    if classes:
        origin["(checkpointing)"] = classes
    return _NOT_PASSED


def _how_lightning_runs(value: Any, path: str, origin: dict, notes: list[Note]) -> Any:
    notes.append(Note(path, None, value, Fidelity.IGNORED, _STRATEGY_ONLY.get(path.split(".")[-1],
                                                                              "how Lightning runs")))  # fmt: skip
    return _NOT_PASSED


_NOT_PASSED = object()
#: FSDPStrategy's own spellings of FSDP1 arguments (or arguments it keeps): argument -> what is passed to FSDP1.
_FSDP_ARGUMENTS = {
    "state_dict_type": _state_dict_type,
    "auto_wrap_policy": _auto_wrap_policy,
    "activation_checkpointing": _checkpointing,
    "activation_checkpointing_policy": _checkpointing,
    "device_mesh": _device_mesh,
    **dict.fromkeys((*_STRATEGY_ONLY, "checkpoint_io", "cluster_environment", "parallel_devices"), _how_lightning_runs),
}


def _fsdp_kwargs(args: dict, notes: list[Note]) -> tuple[dict, dict[str, str]]:
    """FSDPStrategy's arguments as FSDP1 keyword arguments (Lightning's spellings turned into FSDP's)."""
    out, origin = {}, {}
    for key, value in args.items():
        path = f"FSDPStrategy.{key}"
        passed = _FSDP_ARGUMENTS[key](value, path, origin, notes) if key in _FSDP_ARGUMENTS else value
        if passed is not _NOT_PASSED:
            out[key] = passed
            origin.setdefault(key, path)
    out.setdefault("state_dict_type", "FULL_STATE_DICT")  # Lightning's default "full"
    return out, origin


def _deepspeed_arguments(args: Any) -> None:
    """DeepSpeedStrategy's own refusals: an argument it does not have (a TypeError in Lightning), and a ``config``
    that is neither a mapping nor None (Lightning reads a text as the path of a JSON file)."""
    if not isinstance(args, dict):
        return
    import difflib

    problems = [Problem(f"DeepSpeedStrategy.{k}", args[k], "DeepSpeedStrategy has no such argument" + (
        f" (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(str(k), _DS_ARGUMENTS, 1)) else ""))
        for k in args if k not in _DS_ARGUMENTS]  # fmt: skip
    config = args.get("config")
    if config is not None and not isinstance(config, dict):
        problems.append(Problem("DeepSpeedStrategy.config", config, "Lightning reads a text here as the path of a "
                                "DeepSpeed JSON file and then ignores the other arguments: translate that file "
                                "itself (the deepspeed dialect), or give the config as a mapping"))  # fmt: skip
    if problems:
        raise ConfigError(problems, source=NAME)


def _strategy(raw: Any) -> str:
    """The one strategy section of the mapping (a ConfigError naming what is wrong otherwise)."""
    checked = raw
    if isinstance(raw, dict) and isinstance(raw.get("DeepSpeedStrategy"), dict):
        _deepspeed_arguments(raw["DeepSpeedStrategy"])
        checked = {**raw, "DeepSpeedStrategy": {k: v for k, v in raw["DeepSpeedStrategy"].items()
                                                if k not in _PASSED_TO_DEEPSPEED and v is not None}}  # fmt: skip
    problems = schemas.check(checked, NAME)
    if problems:
        raise ConfigError(problems, source=NAME)
    strategies = [k for k in STRATEGIES if isinstance(raw, dict) and isinstance(raw.get(k), dict)]
    if len(strategies) != 1:
        raise ConfigError([Problem("", sorted(raw) if isinstance(raw, dict) else raw, "expected one of "
                                   f"{', '.join(STRATEGIES)} with its arguments (and Trainer or Fabric)")],
                          source=NAME)  # fmt: skip
    unknown = set(raw) - {strategies[0], *LAUNCH}
    if unknown:
        raise ConfigError([Problem(k, raw[k], f"expected {strategies[0]} and Trainer or Fabric beside it")
                           for k in sorted(unknown)], source=NAME)  # fmt: skip
    return strategies[0]


def _not_given(args: dict, notes: list[Note]) -> dict:
    """DeepSpeedStrategy's arguments without the nulls Lightning treats as its default (a switch it tests for truth,
    a config it builds itself); the nulls it copies into the DeepSpeed config stay, for DeepSpeed's reader."""
    out = {}
    for key, value in args.items():
        if value is None and key not in _PASSED_TO_DEEPSPEED:
            notes.append(Note(f"DeepSpeedStrategy.{key}", None, None, Fidelity.IGNORED, "null: Lightning's default "
                              f"{_DS_DEFAULTS.get(key)!r} applies" if key in _DS_DEFAULTS else "null: not given"))
            continue
        out[key] = value
    return out


def _read_deepspeed(args: dict, precision: str | None, precision_key: str, notes: list[Note]):
    """The config DeepSpeedStrategy hands DeepSpeed, read by the deepspeed dialect: (translation, origins, prefix)."""
    args = _not_given(args, notes)
    config, origin = _deepspeed_config(args, notes)
    if precision in ("fp16", "bf16") and precision not in config:  # as Lightning adds it
        config[precision] = {"enabled": True}
        origin[f"{precision}.enabled"] = precision_key
        if precision == "fp16":  # with the loss scaling given to the strategy
            for key in (k for k in _LOSS_SCALING if k in args):
                config["fp16"][key] = args[key]
                origin[f"fp16.{key}"] = f"DeepSpeedStrategy.{key}"
    for key in (k for k in _LOSS_SCALING if k in args and f"fp16.{k}" not in origin):
        notes.append(Note(f"DeepSpeedStrategy.{key}", None, args[key], Fidelity.IGNORED, "fp16 loss scaling: "
                          "Lightning uses it only under 16-bit (fp16) precision"))  # fmt: skip
    prefix = "DeepSpeedStrategy.config." if "config" in args else "DeepSpeedStrategy."
    try:
        inner = deepspeed.read(config)
    except ConfigError as exc:  # named by the argument that gave the key
        raise ConfigError([replace(p, path=origin.get(p.path, prefix + p.path)) for p in exc.problems],
                          source=NAME) from None  # fmt: skip
    inner.notes[:] = _without_the_batch_refusal(inner.notes)
    return inner, origin, prefix


def _without_the_batch_refusal(notes: list[Note]) -> list[Note]:
    """DeepSpeedStrategy writes a micro batch into a config that has none (the Trainer's: the dataloader's batch
    size; Fabric's: 1), so DeepSpeed does not refuse what the strategy hands it."""
    return [n for n in notes if not (n.refused and n.source_path == deepspeed.NO_BATCH_KEY)]


def _read_fsdp(args: dict, precision: str | None, precision_key: str, notes: list[Note]):
    """FSDPStrategy's FSDP1 arguments, read by the fsdp dialect: (translation, origins, prefix)."""
    config, origin = _fsdp_kwargs(args, notes)
    if precision in ("fp16", "bf16") and "mixed_precision" not in config:  # Lightning's FSDPPrecision
        config["mixed_precision"] = {k: precision for k in ("param_dtype", "reduce_dtype", "buffer_dtype")}
        origin.update({f"mixed_precision.{k}": precision_key for k in config["mixed_precision"]})
    checkpointing = origin.pop("(checkpointing)", None)
    inner = fsdp.read(config, version="fsdp1")
    if checkpointing:
        ac = inner.result.activation_checkpointing.model_copy(update={"enabled": True, "modules": checkpointing})
        inner.result = inner.result.model_copy(update={"activation_checkpointing": ac})
    return inner, origin, "FSDPStrategy."


def read(raw: Any, *, version: str | None = None) -> Translation[TorshConfig]:
    """Read a Lightning strategy's arguments (with the Trainer's or Fabric's) into the core model."""
    strategy = _strategy(raw)
    notes: list[Note] = []
    precision = _launch_precision(raw, notes)
    counts = _counts(raw)
    if strategy == "ModelParallelStrategy":
        from . import _lightning_model_parallel

        return _lightning_model_parallel.read(raw, counts, [n for n in notes if not n.source_path.endswith(
            ".precision")])  # fmt: skip
    args = raw[strategy]
    precision_key = next((f"{s}.precision" for s in LAUNCH if s in raw), "")
    inner, origin, prefix = _READERS[strategy](args, precision, precision_key, notes)
    given = None if "config" in args else {f"{strategy}.{k}" for k in args} | {precision_key}
    renamed = _under_arguments(inner.notes, origin, prefix, given, strategy)
    cfg = inner.result.model_copy(update={"launch": inner.result.launch.model_copy(update=counts),
                                          "extensions": _kept(inner.result, prefix)})
    return Translation(cfg, notes + renamed, NAME, "torsh")


def _launch_precision(raw: dict, notes: list[Note]) -> str | None:
    """The Trainer's / Fabric's precision (the last section that names one), their other arguments noted."""
    precision = None
    for section in (s for s in LAUNCH if isinstance(raw.get(s), dict)):
        precision = _launch_notes(section, raw[section], notes) or precision
    return precision


def _kept(inner: TorshConfig, prefix: str) -> dict[str, dict]:
    """What the inner dialect kept is this strategy's: a DeepSpeed JSON written from it is a standalone one."""
    kept = {f"{prefix}{k}": v for keys in inner.extensions.values() for k, v in keys.items()}
    return {NAME: kept} if kept else {}


def _counts(raw: dict) -> dict[str, int]:
    """The device and node counts the Trainer / Fabric give (core launch field -> count)."""
    counts = {}
    for section in LAUNCH:
        for key, core in (("devices", "nproc_per_node"), ("num_nodes", "nnodes")):
            count = _count(f"{section}.{key}", raw.get(section, {}).get(key))
            if count is not None:
                counts[core] = count
    return counts


def _under_arguments(notes: list[Note], origin: dict, prefix: str, given: set[str] | None,
                     strategy: str) -> list[Note]:  # fmt: skip
    """The inner dialect's notes under the argument that gave each key, once per argument; a key the strategy built
    from its defaults (``given``: the arguments written, None for a whole config) is DEFAULTED."""
    renamed, seen = [], set()
    for note in notes:
        source = origin.get(note.source_path, prefix + note.source_path)
        if source in seen:
            continue
        seen.add(source)
        if given is not None and source not in given and note.fidelity is not Fidelity.DEFAULTED:
            renamed.append(replace(note, source_path=source, fidelity=Fidelity.DEFAULTED,
                                   reason=f"not set; {strategy}'s default"))  # fmt: skip
        else:
            renamed.append(replace(note, source_path=source))
    return renamed


_READERS = {"DeepSpeedStrategy": _read_deepspeed, "FSDPStrategy": _read_fsdp}


def _inner(cfg: TorshConfig, dialect: str, prefix: str) -> TorshConfig:
    """The config with this dialect's kept keys handed back to the inner dialect that reads the strategy."""
    kept = {k.removeprefix(prefix): v for k, v in cfg.extensions.get(NAME, {}).items() if k.startswith(prefix)}
    return cfg.model_copy(update={"extensions": {dialect: kept} if kept else {}})


def write(cfg: TorshConfig, *, version: str | None = None) -> Translation[dict]:
    """``{"DeepSpeedStrategy": {"config": ...}}`` (default) or ``{"FSDPStrategy": {...}}`` (``version="fsdp"``)."""
    version = version or "deepspeed"
    if version not in VERSIONS:
        raise ConfigError([Problem("version", version, f"expected one of {', '.join(VERSIONS)}")], source=NAME)
    if version == "deepspeed":
        prefix = "DeepSpeedStrategy.config." if any(k.startswith("DeepSpeedStrategy.config.") for k in
                                                    cfg.extensions.get(NAME, {})) else "DeepSpeedStrategy."
        inner = deepspeed.write(_inner(cfg, "deepspeed", prefix))
        return Translation({"DeepSpeedStrategy": {"config": inner.result}}, [
            replace(n, target_path=f"DeepSpeedStrategy.config.{n.target_path}") if n.target_path else n
            for n in inner.notes], "torsh", NAME)  # fmt: skip
    inner = fsdp.write(_inner(cfg, "fsdp", "FSDPStrategy."), version="fsdp1")
    args = dict(inner.result)
    if "state_dict_type" in args:
        args["state_dict_type"] = args["state_dict_type"].split("_")[0].lower()
    wrap = args.pop("auto_wrap_policy", None)
    if isinstance(wrap, dict) and "transformer_layer_cls" in wrap:
        args["auto_wrap_policy"] = "{" + ", ".join(wrap["transformer_layer_cls"]) + "}"
    elif wrap is not None:
        args["auto_wrap_policy"] = wrap
    if isinstance(args.get("device_mesh"), dict):
        args["device_mesh"] = args["device_mesh"].get("shape")
    if cfg.activation_checkpointing.enabled and cfg.activation_checkpointing.modules:
        args["activation_checkpointing_policy"] = "{" + ", ".join(cfg.activation_checkpointing.modules) + "}"
    notes = [replace(n, target_path=f"FSDPStrategy.{n.target_path}") if n.target_path else n for n in inner.notes]
    return Translation({"FSDPStrategy": args}, notes, "torsh", NAME)


#: A mapping with one Lightning strategy section (beside the Trainer's or Fabric's launch arguments).
SHAPES = (Shape(1.0, (STRATEGIES,), LAUNCH, tables=STRATEGIES,
                where=lambda raw: sum(isinstance(raw.get(k), dict) for k in STRATEGIES) == 1),)


def sniff(raw: Any) -> float:
    """A mapping with one Lightning strategy section (``SHAPES``)."""
    return best(SHAPES, raw)
