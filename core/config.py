"""The core configuration model: one typed description of a distributed training job.

Every dialect adapter reads into and writes out of :class:`TorshConfig`; the engine builds a job from it.
It is pure pydantic: importing it never imports torch or any training framework.

Refinements of the sketch in DESIGN.md, and why:

* **Names follow the upstream PyTorch API** (``reshard_after_forward``, ``bucket_cap_mb``,
  ``find_unused_parameters``); DeepSpeed's five LR schedulers keep DeepSpeed's parameter names because they
  are DeepSpeed's concepts and users know them by those names.
* **Defaults are neutral PyTorch defaults**, not any one framework's: no clipping, fp32, no loss scaling.
  An adapter that reads a dialect writes that dialect's *effective* values explicitly (DeepSpeed's
  clipping of 1.0, its reduce dtype), so a later export to another dialect keeps the behaviour.
* **A ``data`` section** (drop_last, shuffle, seed, epochs) was added: the seed ``[training] epochs`` key and
  DeepSpeed's ``dataloader_drop_last`` need a home, and ``torsh.initialize`` builds the dataloader.
* **``precision`` spells out every dtype of the precision contract** (compute, reduce, buffers, master
  weights, gradient accumulation, optimizer state) instead of one "mixed precision" switch: the DeepSpeed to
  FSDP port failures users report all live in the gaps between these (reference/user_pains.md 1-5).
* **Loss scaling names whose rules it follows** (DeepSpeed ZeRO, DeepSpeed stage 0, torch GradScaler):
  the three differ in hysteresis and growth timing, and a parity check needs the exact one.
* **``sharding.reshard_after_forward`` may be None**, meaning "as the stage implies" (3: True, 2: False), so
  a config states a stage once and an explicit value is still representable (FSDP2's int form is not: it
  is reported by the adapters).
* **Compression is one flat section with method-specific fields** checked by a validator; flat dotted
  paths (``compression.ratio``) keep adapter maps one line per key.
* **Scheduler is a union tagged by ``name``**: DeepSpeed's five schedulers with typed parameters, any other
  name is a ``torch.optim.lr_scheduler`` class with keyword arguments.
* **``extensions``** holds, per dialect, the keys that have no core meaning (performance knobs, logging
  details), keyed by their dotted source path, so a same-dialect round trip is lossless.

Every field has an attribute docstring; they become the descriptions of ``schemas/torsh.schema.json``.
"""

# No ``from __future__ import annotations`` in this module: with it, pydantic compiles and evaluates the ~190 field
# annotations from strings when the classes are built (~4 ms of every torsh-migrate call); as real objects they
# come from the module's cached bytecode. Annotations naming their own class are quoted.

import copy
import re
from typing import Any

from pydantic import BaseModel, ValidationError, model_validator

from .concepts.optim import DEEPSPEED_SCHEDULERS  # re-exported: importers take it from here
from .deferred import AUTO, Deferred, is_deferred  # noqa: F401 - AUTO and is_deferred re-exported
from .errors import ConfigError, Problem

# The sections and the shared types live in their own modules (training step, job, base); importers take them from
# here. The docstring reader is in _config_docs.
from . import _config_docs
from ._config_docs import _attribute_docstrings  # noqa: F401
from .config_base import (
    MAX_BYTES_SIZE,
    MAX_LOSS_SCALE,
    MAX_PROCESSES,
    MAX_PROCESSES_PER_NODE,
    MAX_TIMEOUT_S,
    DType,
    MaybeAuto,
    Probability,
    Section,
)
from .config_job import (
    CheckpointConfig,
    CommunicationConfig,
    DataConfig,
    Host,
    LaunchConfig,
    MonitoringConfig,
    ParallelismConfig,
    PerNodeCount,
    PipelineConfig,
    ProcessCount,
    ProfilerConfig,
    ShellRef,
    TimelineConfig,
    WandbConfig,
    WriterConfig,
)
from .config_training import (
    ActivationCheckpointingConfig,
    BatchConfig,
    BucketSizes,
    CompressionConfig,
    DdpConfig,
    GradientsConfig,
    LeafModules,
    LossScalingConfig,
    LRRangeTest,
    OffloadConfig,
    OffloadDevice,
    OneCycle,
    OptimizerConfig,
    PrecisionConfig,
    ResolvedBatch,
    SchedulerConfig,
    ShardingConfig,
    TorchScheduler,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    WarmupType,
    WrapPolicy,
)

_DOCSTRING_READER = _config_docs.install(__name__, __file__)

# --------------------------------------------------------------------------------------------------
# root

SECTION_NAMES = (
    "batch", "sharding", "ddp", "precision", "offload", "optimizer", "scheduler", "gradients", "compression",
    "activation_checkpointing", "communication", "launch", "checkpoint", "monitoring", "parallelism", "pipeline",
    "data", "extensions",
)  # fmt: skip
#: Core paths (prefixes) whose values size collectives and group modules but change no number a step computes: a
#: dialect with no setting for them loses nothing a training run depends on (IGNORED on writing, not UNSUPPORTED).
NO_NUMERICAL_EFFECT = ("sharding.buckets.", "sharding.leaf_modules.")


class TorshConfig(Section):
    """A distributed training job: the core model every dialect translates to and from."""

    batch: BatchConfig = BatchConfig()
    """Batch sizes."""
    sharding: ShardingConfig = ShardingConfig()
    """ZeRO stage / FSDP sharding."""
    ddp: DdpConfig = DdpConfig()
    """DDP settings."""
    precision: PrecisionConfig = PrecisionConfig()
    """Dtypes and loss scaling."""
    offload: OffloadConfig = OffloadConfig()
    """CPU / NVMe offload."""
    optimizer: OptimizerConfig | None = None
    """The optimizer to build. None: the training script passes one."""
    scheduler: SchedulerConfig | None = None
    """The LR scheduler to build. None: none, or the training script passes one."""
    gradients: GradientsConfig = GradientsConfig()
    """Clipping and reduction."""
    compression: CompressionConfig = CompressionConfig()
    """Gradient compression."""
    activation_checkpointing: ActivationCheckpointingConfig = ActivationCheckpointingConfig()
    """Activation checkpointing."""
    communication: CommunicationConfig = CommunicationConfig()
    """Process group and collectives."""
    launch: LaunchConfig = LaunchConfig()
    """Process launch."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpoints."""
    monitoring: MonitoringConfig = MonitoringConfig()
    """Logging and metrics."""
    parallelism: ParallelismConfig = ParallelismConfig()
    """Parallel degrees (data, tensor, pipeline, context)."""
    pipeline: PipelineConfig = PipelineConfig()
    """Pipeline schedule."""
    data: DataConfig = DataConfig()
    """Training dataloader."""
    extensions: dict[str, dict[str, Any]] = {}
    """Per dialect, keys with no core meaning keyed by their dotted source path, kept for lossless round trips."""

    @model_validator(mode="after")
    def _extensions_finite(self) -> "TorshConfig":
        # Kept keys are written back verbatim: NaN or infinity means nothing in any dialect and no file format but
        # YAML and TOML can even hold it, so it is refused here rather than written into a config that fails later.
        import math

        for dialect, keys in self.extensions.items():
            for key, value in keys.items():
                for path, leaf in iter_leaves({"v": value}):
                    if isinstance(leaf, float) and not math.isfinite(leaf):
                        where = f"extensions.{dialect}.{key}" + path[1:]
                        raise ValueError(f"kept setting {where} is {leaf}: it must be a finite number")
                    for item in leaf if isinstance(leaf, list) else ():
                        if isinstance(item, float) and not math.isfinite(item):
                            raise ValueError(f"kept setting extensions.{dialect}.{key}{path[1:]} holds {item}: it "
                                             "must be a finite number")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _one_setting_per_degree(self) -> "TorshConfig":
        replicate, shard = self.parallelism.dp_replicate, self.sharding.hybrid_shard_size
        if replicate is not None and shard is not None:
            raise ValueError(f"parallelism.dp_replicate ({replicate}) and sharding.hybrid_shard_size ({shard}) are "
                             "one setting (replicas x shard group = the data-parallel ranks): give only one of "
                             "them")  # fmt: skip
        if replicate not in (None, 1) and self.sharding.stage < 2:
            raise ValueError(f"parallelism.dp_replicate={replicate} needs sharding.stage 2 or 3 (HSDP: replicas of "
                             f"shard groups; stage is {self.sharding.stage})")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _offload_needs_sharding(self) -> "TorshConfig":
        if self.offload.params != "none" and self.sharding.stage < 2:
            raise ValueError(f"offload.params='{self.offload.params}' needs sharding.stage 2 or 3 "
                             f"(stage is {self.sharding.stage})")  # fmt: skip
        return self

    # ---- construction and errors -------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Any, *, source: str | None = None) -> "TorshConfig":
        """Validate ``data``; every problem is reported in one :class:`ConfigError`."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise validation_to_config_error(exc, cls, source=source) from None

    # ---- "auto" --------------------------------------------------------------------------------

    def deferred_paths(self) -> list[str]:
        """Dotted paths of every field still holding ``AUTO``."""
        return [path for path, value in iter_leaves(self.model_dump()) if isinstance(value, Deferred)]

    def resolve_deferred(self, values: dict[str, Any]) -> "TorshConfig":
        """A copy with the given dotted paths set (typically the deferred ones), validated again."""
        data = self.model_dump()
        for path, value in values.items():
            set_path(data, path, value)
        return type(self).from_dict(data)


# --------------------------------------------------------------------------------------------------
# dotted-path helpers


def iter_leaves(data: Any, prefix: str = ""):
    """Yield ``(dotted_path, value)`` for every non-dict leaf of nested dicts (lists are leaves)."""
    if isinstance(data, dict) and data:
        for key, value in data.items():
            yield from iter_leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif prefix:
        yield prefix, data


def get_path(data: Any, path: str, default: Any = None) -> Any:
    """The value at a dotted path of nested dicts/models, or ``default``."""
    node = data
    for part in path.split("."):
        if isinstance(node, dict):
            if part not in node:
                return default
            node = node[part]
        elif isinstance(node, BaseModel) and part in type(node).model_fields:
            node = getattr(node, part)
        else:
            return default
    return node


def set_path(data: dict, path: str, value: Any) -> None:
    """Set a dotted path in nested dicts, creating the intermediate dicts."""
    parts = path.split(".")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = copy.deepcopy(value)


def field_names_at(model: type[BaseModel], path: tuple[Any, ...]) -> list[str]:
    """The field names of the section reached by ``path`` from ``model`` (for did-you-mean)."""
    current: Any = model
    for part in path:
        fields = getattr(current, "model_fields", None)
        if not fields or part not in fields:
            return []
        current = _section_type(fields[part].annotation)
    return list(getattr(current, "model_fields", {}) or {})


def _section_type(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _section_type(arg)
        if found is not None:
            return found
    return None


def validation_to_config_error(exc: ValidationError, model: type[BaseModel], *, source: str | None = None):
    """Turn pydantic's errors into one ConfigError: dotted paths, values, reasons, did-you-mean."""
    grouped: dict[str, list[dict]] = {}
    for err in exc.errors(include_url=False):
        path = _clean_loc(model, err["loc"])
        grouped.setdefault(".".join(str(p) for p in path), []).append({**err, "clean": path})
    problems = []
    for path, errs in grouped.items():
        err = errs[0]
        if err["type"] == "extra_forbidden":
            from .errors import unknown_key

            problems.append(unknown_key(path, err["input"], field_names_at(model, tuple(err["clean"][:-1]))))
            continue
        reasons = list(dict.fromkeys(_reason(e) for e in errs))
        value = err.get("input")
        named = _NAMED_PATH.match(reasons[0])
        if err["type"] == "value_error" and named:  # a cross-field rule names the key it is about
            path, value = named.group(1), get_path(value, named.group(1)[len(path) + 1 if path else 0:])
        problems.append(Problem(path, value, " or ".join(reasons)))
    return ConfigError(problems, source=source)


_NAMED_PATH = re.compile(r"^([a-z_]+(?:\.[a-z_]+)+)")


def _clean_loc(model: type[BaseModel], loc: tuple[Any, ...]) -> list[Any]:
    """Drop pydantic's union-member and tag segments, keeping field names and list indices."""
    clean: list[Any] = []
    current: Any = model
    for part in loc:
        fields = getattr(current, "model_fields", None)
        if isinstance(part, int):
            clean.append(part)
        elif fields and part in fields:
            clean.append(part)
            current = _section_type(fields[part].annotation)
        elif fields is None and isinstance(part, str) and not _looks_internal(part):
            clean.append(part)  # a key inside a free-form dict
        elif current is not None and part in DEEPSPEED_SCHEDULERS + ("torch",):
            current = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
                       "OneCycle": OneCycle, "LRRangeTest": LRRangeTest, "torch": TorchScheduler}[part]  # fmt: skip
        elif fields and not _looks_internal(part):
            clean.append(part)  # an unknown key (extra_forbidden)
    return clean


def _looks_internal(part: str) -> bool:
    return any(ch in part for ch in "[]()") or part in {
        "int", "float", "str", "bool", "dict", "list", "tuple", "none", "literal", "is-instance",
    } or part.startswith(("constrained-", "function-", "lax-", "strict-", "json-"))  # fmt: skip


def _reason(err: dict) -> str:
    msg = err["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    if msg == 'expected "auto"':
        return 'the string "auto"'
    return msg



_config_docs.restore(_DOCSTRING_READER)  # every model class of this module is built
