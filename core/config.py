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
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Tag,
    ValidationError,
    model_validator,
)
from typing_extensions import TypeAliasType

from .concepts.optim import DEEPSPEED_SCHEDULERS  # re-exported: importers take it from here
from .concepts.precision import GRAD_SCALER
from .deferred import AUTO, Deferred, is_deferred
from .errors import ConfigError, Problem


def _install_docstring_reader() -> Any:
    """Make pydantic read this module's attribute docstrings from one pass over the file.

    ``use_attribute_docstrings`` makes pydantic (before Python 3.13) walk the stack and re-tokenize the
    source of every model class, about a third of this module's import time, which every ``torsh-migrate``
    call pays. Every field here is written the same way, a line ``name: annotation = default`` and a docstring in
    triple double quotes starting on the next line, so one regular-expression pass over the text finds them all
    (a sixth of the cost of parsing the classes with ``ast``). A class whose documented names are not exactly its
    annotated attributes, in order (a field written another way), is left to pydantic's own reader, as are
    classes of other modules and a pydantic without this internal. Returns what
    :func:`_restore_docstring_reader` needs (None when nothing was installed).
    """
    try:
        from pydantic._internal import _fields
        original = _fields.extract_docstrings_from_cls
        with open(__file__, encoding="utf-8") as handle:
            docs = _attribute_docstrings(handle.read())
    except (ImportError, AttributeError, OSError):
        return None

    def extract(cls: type, *args: Any, **kwargs: Any) -> dict[str, str]:
        found = docs.get(cls.__qualname__) if cls.__module__ == __name__ else None
        if found is not None and list(found) == list(cls.__dict__.get("__annotations__", {})):
            return found
        return original(cls, *args, **kwargs)

    _fields.extract_docstrings_from_cls = extract
    return _fields, original


_CLASS_OR_DOCUMENTED_FIELD = re.compile(r'^class (\w+)|^    (\w+): [^\n]*\n    """(.*?)"""', re.MULTILINE | re.DOTALL)


def _attribute_docstrings(source: str) -> dict[str, dict[str, str]]:
    """Per top-level class of ``source``, its attributes' docstrings, cleaned as pydantic cleans them."""
    import inspect

    docs: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for match in _CLASS_OR_DOCUMENTED_FIELD.finditer(source):
        class_name, field, text = match.groups()
        if class_name:
            current = docs[class_name] = {}
            continue
        if "\\" in text:  # an escape sequence: the docstring is the literal's value, not its source text
            import ast

            text = ast.literal_eval(f'"""{text}"""')
        current[field] = inspect.cleandoc(text)
    return docs


def _restore_docstring_reader(installed: Any) -> None:
    if installed is not None:
        module, original = installed
        module.extract_docstrings_from_cls = original


_DOCSTRING_READER = _install_docstring_reader()

# --------------------------------------------------------------------------------------------------
# Shared types

def _normalise_dtype(value: Any) -> Any:
    from .concepts.dtypes import normalise

    return normalise(value)


DType = Annotated[Literal["fp32", "bf16", "fp16"], BeforeValidator(_normalise_dtype)]
"""A floating-point dtype; accepts the spellings fp32/float32/torch.float32, bf16/bfloat16, fp16/float16/half."""

MaybeAuto = Deferred  # readability in annotations: ``int | MaybeAuto``


# Bounds of counts and sizes: beyond them a value is a typo or hostile input (10**8 processes, a 2**2000 loss scale),
# and downstream arithmetic (timedelta, fp32 scales, per-process lists) would overflow or exhaust memory.
MAX_PROCESSES = 1 << 20
"""Most processes (world size, nodes, a shard group) a job may have."""
MAX_PROCESSES_PER_NODE = 4096
"""Most processes on one node (nproc_per_node, hostfile slots)."""
MAX_LOSS_SCALE = float(2**64)
"""Largest loss scale (DeepSpeed ``initial_scale_power`` 64); fp32 overflows at 2**128 and a gradient scaled by more
than 2**64 is inf for any loss above 2**64."""
MAX_TIMEOUT_S = 1e9
"""Longest timeout in seconds (about 31 years; ``datetime.timedelta`` overflows near 8.6e13)."""
MAX_BYTES_SIZE = 1 << 40
"""Largest buffer or bucket size in bytes (1 TiB)."""

Probability = Annotated[float, Field(ge=0.0, lt=1.0)]
"""A coefficient in [0, 1): Adam betas, momentum cycled into beta1."""


class Section(BaseModel):
    """Base of every section: unknown keys are errors, every field is documented, every float is finite."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
        validate_default=True,
        allow_inf_nan=False,
    )


# --------------------------------------------------------------------------------------------------
# batch


@dataclass(frozen=True)
class ResolvedBatch:
    """Batch sizes after resolution against a data-parallel world size."""

    global_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int


class BatchConfig(Section):
    """Global batch, micro batch per rank and gradient accumulation (DeepSpeed's three batch keys)."""

    global_batch_size: PositiveInt | MaybeAuto | None = None
    """Samples per optimizer step across all data-parallel ranks (DeepSpeed ``train_batch_size``)."""
    micro_batch_size: PositiveInt | MaybeAuto | None = None
    """Samples per rank per forward/backward (DeepSpeed ``train_micro_batch_size_per_gpu``)."""
    gradient_accumulation_steps: PositiveInt | MaybeAuto | None = None
    """Micro-batches per optimizer step; derived from the other two when absent."""

    def resolve(self, world_size: int) -> ResolvedBatch:
        """Resolve the three values for ``world_size`` data-parallel ranks, exactly as DeepSpeed 0.19.8 does.

        Floor division, the same six cases and the same error texts as
        ``deepspeed.runtime.config.DeepSpeedConfig._set_batch_related_parameters`` / ``_batch_assertion``.
        """
        if world_size < 1:
            raise ConfigError([Problem("batch", world_size, "the data-parallel world size must be at least 1")])
        deferred = [k for k in ("global_batch_size", "micro_batch_size", "gradient_accumulation_steps")
                    if is_deferred(getattr(self, k))]  # fmt: skip
        if deferred:
            raise ConfigError([Problem(f"batch.{k}", AUTO, "is \"auto\": resolve it (torsh.initialize fills it "
                                       "from the dataloader) or give a number") for k in deferred])  # fmt: skip
        tbs, mbs, gas, w = self.global_batch_size, self.micro_batch_size, self.gradient_accumulation_steps, world_size
        if tbs is not None and mbs is not None and gas is not None:
            pass
        elif tbs is not None and mbs is not None:
            gas = tbs // mbs // w
        elif tbs is not None and gas is not None:
            mbs = tbs // w // gas
        elif mbs is not None and gas is not None:
            tbs = mbs * gas * w
        elif tbs is not None:
            gas, mbs = 1, tbs // w
        elif mbs is not None:
            tbs, gas = mbs * w, 1
        else:
            raise ConfigError([Problem("batch", None, "Either train_batch_size or train_micro_batch_size_per_gpu "
                                       "needs to be provided")])  # fmt: skip
        checks = [
            (tbs > 0, f"Train batch size: {tbs} has to be greater than 0"),
            (mbs > 0, f"Micro batch size per gpu: {mbs} has to be greater than 0"),
            (gas > 0, f"Gradient accumulation steps: {gas} has to be greater than 0"),
            (tbs == mbs * gas * w, "Check batch related parameters. train_batch_size is not equal to "
             f"micro_batch_per_gpu * gradient_acc_step * world_size {tbs} != {mbs} * {gas} * {w}"),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise ConfigError([Problem("batch", self.model_dump(mode="json", exclude_none=True), message)])
        return ResolvedBatch(tbs, mbs, gas, w)


# --------------------------------------------------------------------------------------------------
# sharding, ddp


class WrapPolicy(Section):
    """Which modules become their own sharding unit (FSDP ``auto_wrap_policy``)."""

    module_classes: list[str] = []
    """Class names to wrap (e.g. ``["LlamaDecoderLayer"]``); FSDP1 ``transformer_auto_wrap_policy``."""
    min_num_params: PositiveInt | None = None
    """Wrap every module with at least this many parameters (FSDP1 ``size_based_auto_wrap_policy``)."""


class ShardingConfig(Section):
    """How parameters, gradients and optimizer state are partitioned across data-parallel ranks."""

    stage: Literal[0, 1, 2, 3] = 0
    """0: replicate (DDP); 1: + optimizer state (ZeRO-1); 2: + gradients (ZeRO-2); 3: + parameters (ZeRO-3)."""
    reshard_after_forward: bool | None = None
    """Free gathered parameters after forward. None: as the stage implies (3 → True, 2 → False)."""
    hybrid_shard_size: Annotated[int, Field(gt=0, le=MAX_PROCESSES)] | MaybeAuto | None = None
    """Shard within groups of this many ranks and replicate across groups (HSDP, ZeRO++ hpZ). None: shard over all.
    "auto": the ranks of one node (FSDP1 ``HYBRID_SHARD`` without a device mesh), resolved at start-up."""
    wrap: WrapPolicy = WrapPolicy()
    """Sharding units. Empty: each direct child that holds parameters, then the root."""
    backward_prefetch: Literal["backward_pre", "backward_post", "none"] | None = None
    """Prefetch of the next all-gather in backward. None: the framework's default."""
    forward_prefetch: bool = False
    """Prefetch the next all-gather in forward (static graphs only)."""
    sync_module_states: bool = True
    """Broadcast parameters and buffers from rank 0 at start-up, so every rank starts from the same weights."""

    @model_validator(mode="after")
    def _reshard_needs_sharded_params(self) -> "ShardingConfig":
        if self.reshard_after_forward is not None and self.stage < 2:
            raise ValueError(f"sharding.reshard_after_forward={self.reshard_after_forward} needs sharding.stage 2 "
                             f"or 3 (stage is {self.stage})")  # fmt: skip
        if self.hybrid_shard_size is not None and self.stage < 2:
            raise ValueError(f"sharding.hybrid_shard_size={self.hybrid_shard_size} needs sharding.stage 2 or 3 "
                             f"(stage is {self.stage})")  # fmt: skip
        return self

    @property
    def effective_reshard_after_forward(self) -> bool | None:
        """True/False for stages 2 and 3, None when parameters are not sharded."""
        if self.stage < 2:
            return None
        return self.reshard_after_forward if self.reshard_after_forward is not None else self.stage == 3


class DdpConfig(Section):
    """``DistributedDataParallel`` settings (stages 0 and 1)."""

    bucket_cap_mb: Annotated[float, Field(gt=0.0, le=MAX_BYTES_SIZE / (1 << 20))] | MaybeAuto = 25.0
    """Gradient bucket size in MiB."""
    overlap_comm: bool = True
    """Overlap gradient reduction with backward computation."""
    find_unused_parameters: bool = False
    """Traverse the graph each step to find parameters that received no gradient."""
    static_graph: bool = False
    """The set of used parameters never changes between iterations."""
    gradient_as_bucket_view: bool = False
    """Gradients are views into the communication buckets (saves memory)."""
    broadcast_buffers: bool = True
    """Synchronise buffers from rank 0 at every forward."""


# --------------------------------------------------------------------------------------------------
# precision


class LossScalingConfig(Section):
    """Loss scaling for fp16 training."""

    mode: Literal["none", "static", "dynamic"] = "none"
    """none: no scaling; static: a fixed scale; dynamic: grow and back off with overflows."""
    static_scale: Annotated[float, Field(gt=0.0, le=MAX_LOSS_SCALE)] | None = None
    """The scale when ``mode`` is static."""
    initial_scale: Annotated[float, Field(gt=0.0, le=MAX_LOSS_SCALE)] = GRAD_SCALER["initial_scale"]
    """Starting scale when dynamic (DeepSpeed ``2**initial_scale_power``, GradScaler ``init_scale``)."""
    growth_interval: PositiveInt = 1000
    """Clean steps between growths (DeepSpeed ``loss_scale_window``, GradScaler ``growth_interval``)."""
    growth_factor: float = Field(default=GRAD_SCALER["growth_factor"], gt=1.0, le=MAX_LOSS_SCALE)
    """Multiplier on growth."""
    backoff_factor: float = Field(default=GRAD_SCALER["backoff_factor"], gt=0.0, lt=1.0)
    """Multiplier on overflow."""
    hysteresis: PositiveInt = 2
    """Overflows tolerated before the scale drops (DeepSpeed ZeRO rule only)."""
    consecutive_hysteresis: bool = False
    """Refill hysteresis on every clean step rather than only at growth (DeepSpeed)."""
    min_scale: Annotated[float, Field(gt=0.0, le=MAX_LOSS_SCALE)] = 1.0
    """Lower bound of the scale (DeepSpeed ``min_loss_scale``)."""
    semantics: Literal["deepspeed_zero", "deepspeed_stage0", "torch_grad_scaler"] = "torch_grad_scaler"
    """Whose rules: DeepSpeed ZeRO's scaler (hysteresis, growth after window+1 clean steps), DeepSpeed stage 0's
    (no hysteresis), or torch ``GradScaler`` (halve on every overflow, grow after exactly growth_interval)."""

    @model_validator(mode="after")
    def _static_needs_scale(self) -> "LossScalingConfig":
        if self.mode == "static" and self.static_scale is None:
            raise ValueError("precision.loss_scaling.static_scale is required when mode is 'static'")
        return self


class PrecisionConfig(Section):
    """The precision contract: the dtype of every tensor class in training."""

    param_dtype: DType | MaybeAuto = "fp32"
    """Parameters in forward/backward compute (DeepSpeed casts the model to it; FSDP2 ``param_dtype``).
    ``"auto"``: chosen at start-up from the training arguments (Hugging Face's ``fp16/bf16.enabled: "auto"``)."""
    reduce_dtype: DType | None = None
    """Gradient reduction across ranks. None: same as ``param_dtype``."""
    buffer_dtype: DType | None = None
    """Module buffers. None: kept as loaded (not cast with the parameters)."""
    master_dtype: DType = "fp32"
    """The weights the optimizer updates (DeepSpeed keeps fp32 master weights in mixed precision)."""
    grad_accum_dtype: DType | None = None
    """Gradients accumulated over micro-batches. None: same as ``param_dtype``."""
    optimizer_state_dtype: DType = "fp32"
    """Optimizer state (Adam moments)."""
    cast_forward_inputs: bool = False
    """Cast floating-point forward inputs to ``param_dtype`` (DeepSpeed ``fp16.auto_cast``, FSDP2 default True)."""
    autocast: bool = False
    """Run forward under ``torch.autocast(param_dtype)`` with parameters kept in ``master_dtype`` instead of casting
    the parameters (DeepSpeed ``torch_autocast``)."""
    loss_scaling: LossScalingConfig = LossScalingConfig()
    """fp16 loss scaling."""
    skip_step_on_nonfinite: bool = False
    """Skip the optimizer and scheduler step when the gradient norm is inf/NaN (DeepSpeed bf16
    ``check_grad_overflow``; always on with dynamic loss scaling)."""

    @model_validator(mode="after")
    def _autocast_needs_low_precision(self) -> "PrecisionConfig":
        if self.autocast and self.param_dtype == "fp32":
            raise ValueError("precision.autocast needs precision.param_dtype bf16 or fp16 (the autocast dtype)")
        return self

    @property
    def effective_reduce_dtype(self) -> str | Deferred:
        """The gradient reduction dtype (AUTO while ``param_dtype`` is deferred and no explicit value is set)."""
        return self.reduce_dtype or self.param_dtype

    @property
    def effective_grad_accum_dtype(self) -> str | Deferred:
        """The gradient accumulation dtype (AUTO while ``param_dtype`` is deferred and no explicit value is set)."""
        return self.grad_accum_dtype or self.param_dtype


# --------------------------------------------------------------------------------------------------
# offload, optimizer, scheduler, gradients

OffloadDevice = Literal["none", "cpu", "nvme"]


class OffloadConfig(Section):
    """Where parameters and optimizer state live between uses."""

    params: OffloadDevice = "none"
    """Parameter (and gradient) offload target."""
    optimizer: OffloadDevice = "none"
    """Optimizer state and master weights offload target (the optimizer step runs there)."""
    pin_memory: bool = True
    """Page-lock offloaded CPU memory for faster transfers."""
    nvme_path: str | None = None
    """Directory for NVMe offload."""

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> "OffloadConfig":
        if "nvme" in (self.params, self.optimizer) and not self.nvme_path:
            raise ValueError("offload.nvme_path is required when offloading to nvme")
        return self


class OptimizerConfig(Section):
    """The optimizer the engine builds (after sharding) when the training script does not pass one."""

    name: str | None = None
    """A ``torch.optim`` class name (``AdamW``, ``Adam``, ``SGD``, ``Adagrad``, ...) or a DeepSpeed-only name
    (``Lamb``, ``Lion``) that adapters report as unsupported by the engine. None: the training script passes
    the optimizer, and the hyper-parameters set here are applied to its parameter groups."""
    lr: NonNegativeFloat | MaybeAuto = 1e-3
    """Learning rate."""
    weight_decay: NonNegativeFloat | MaybeAuto | None = None
    """Weight decay. None: the optimizer class's own default (torch AdamW: 0.01; DeepSpeed's Adam/AdamW: 0)."""
    betas: tuple[Probability, Probability] | MaybeAuto | None = None
    """Adam-family coefficients, each in [0, 1). None: the class default."""
    eps: PositiveFloat | MaybeAuto | None = None
    """Adam-family epsilon. None: the class default."""
    momentum: NonNegativeFloat | MaybeAuto | None = None
    """SGD/RMSprop momentum. None: the class default."""
    kwargs: dict[str, Any] = {}
    """Further constructor keyword arguments, passed through (``amsgrad``, ``nesterov``, ``foreach``, ...)."""


WarmupType = Literal["log", "linear"]


class WarmupLR(Section):
    """DeepSpeed ``WarmupLR``: warm up from min to max, then hold (log warm-up by default)."""

    name: Literal["WarmupLR"]
    """Scheduler name."""
    warmup_min_lr: NonNegativeFloat | MaybeAuto = 0.0
    """Learning rate at the start of warm-up."""
    warmup_max_lr: NonNegativeFloat | MaybeAuto | None = None
    """Learning rate at the end of warm-up. None: each parameter group's learning rate."""
    warmup_num_steps: PositiveInt | MaybeAuto = 1000
    """Warm-up length in optimizer steps (DeepSpeed uses max(2, n))."""
    warmup_type: WarmupType = "log"
    """Shape of the warm-up curve."""


class WarmupDecayLR(Section):
    """DeepSpeed ``WarmupDecayLR``: warm up, then decay linearly to 0 at ``total_num_steps``."""

    name: Literal["WarmupDecayLR"]
    """Scheduler name."""
    total_num_steps: PositiveInt | MaybeAuto
    """Total optimizer steps of the run."""
    warmup_min_lr: NonNegativeFloat | MaybeAuto = 0.0
    """Learning rate at the start of warm-up."""
    warmup_max_lr: NonNegativeFloat | MaybeAuto = 0.001
    """Peak learning rate (DeepSpeed's default 0.001, not the optimizer's lr)."""
    warmup_num_steps: PositiveInt | MaybeAuto = 1000
    """Warm-up length in optimizer steps."""
    warmup_type: WarmupType = "log"
    """Shape of the warm-up curve."""


class WarmupCosineLR(Section):
    """DeepSpeed ``WarmupCosineLR``: ratio warm-up of the optimizer's lr, then cosine decay."""

    name: Literal["WarmupCosineLR"]
    """Scheduler name."""
    total_num_steps: PositiveInt | MaybeAuto
    """Total optimizer steps of the run."""
    warmup_min_ratio: NonNegativeFloat = 0.0
    """Ratio of the base lr at the start of warm-up."""
    warmup_num_steps: PositiveInt | MaybeAuto = 1000
    """Warm-up length in optimizer steps."""
    cos_min_ratio: NonNegativeFloat = 0.0001
    """Ratio of the base lr at the end of the cosine."""
    warmup_type: WarmupType = "log"
    """Shape of the warm-up curve."""


class OneCycle(Section):
    """DeepSpeed ``OneCycle``: triangular lr cycle with inverse momentum cycling, then decay."""

    name: Literal["OneCycle"]
    """Scheduler name."""
    cycle_min_lr: NonNegativeFloat | MaybeAuto
    """Lowest learning rate of the cycle."""
    cycle_max_lr: NonNegativeFloat | MaybeAuto
    """Highest learning rate of the cycle."""
    decay_lr_rate: NonNegativeFloat = 0.0
    """Decay rate after the cycle."""
    cycle_first_step_size: PositiveInt = 2000
    """Steps of the rising half."""
    cycle_second_step_size: PositiveInt | None = None
    """Steps of the falling half. None: same as the first."""
    cycle_first_stair_count: NonNegativeInt = 0
    """Stairs in the rising half (0: smooth)."""
    cycle_second_stair_count: NonNegativeInt | None = None
    """Stairs in the falling half. None: same as the first."""
    decay_step_size: NonNegativeInt = 0
    """Steps per decay interval after the cycle."""
    cycle_momentum: bool = True
    """Cycle momentum (Adam beta1) inversely to the lr; forces beta2 to 0.99 as DeepSpeed does."""
    cycle_min_mom: Probability = 0.8
    """Lowest momentum."""
    cycle_max_mom: Probability = 0.9
    """Highest momentum."""
    decay_mom_rate: NonNegativeFloat = 0.0
    """Momentum decay rate after the cycle."""


class LRRangeTest(Section):
    """DeepSpeed ``LRRangeTest``: grow the lr linearly (or in stairs) to find a good range."""

    name: Literal["LRRangeTest"]
    """Scheduler name."""
    lr_range_test_min_lr: NonNegativeFloat = 1e-3
    """Starting learning rate."""
    lr_range_test_step_size: PositiveInt = 2000
    """Steps per increase interval."""
    lr_range_test_step_rate: NonNegativeFloat = 1.0
    """Increase per interval."""
    lr_range_test_staircase: bool = False
    """Increase in stairs rather than continuously."""


class TorchScheduler(Section):
    """Any ``torch.optim.lr_scheduler`` class, built with keyword arguments."""

    name: str
    """Class name in ``torch.optim.lr_scheduler`` (e.g. ``CosineAnnealingLR``)."""
    kwargs: dict[str, Any] = {}
    """Constructor keyword arguments."""


def _scheduler_tag(value: Any) -> str:
    name = value.get("name") if isinstance(value, dict) else getattr(value, "name", None)
    return name if name in DEEPSPEED_SCHEDULERS else "torch"


SchedulerConfig = Annotated[
    Annotated[WarmupLR, Tag("WarmupLR")]
    | Annotated[WarmupDecayLR, Tag("WarmupDecayLR")]
    | Annotated[WarmupCosineLR, Tag("WarmupCosineLR")]
    | Annotated[OneCycle, Tag("OneCycle")]
    | Annotated[LRRangeTest, Tag("LRRangeTest")]
    | Annotated[TorchScheduler, Tag("torch")],
    Discriminator(_scheduler_tag),
]


def _non_zero(value: float) -> float:
    if value == 0:
        raise ValueError("must not be 0: gradients are divided by it")
    return value


class GradientsConfig(Section):
    """Gradient clipping and how gradients are combined across ranks."""

    clip_max_norm: NonNegativeFloat | MaybeAuto | None = None
    """Clip the global gradient norm to this value. None or 0: no clipping."""
    reduce_op: Literal["mean", "sum", "adasum"] = "mean"
    """Combine gradients across data-parallel ranks by mean, sum or Horovod's Adasum."""
    predivide_factor: Annotated[float, AfterValidator(_non_zero)] = 1.0
    """Divide by this before the reduction and by world_size/factor after (overflow control); any non-zero value,
    as in DeepSpeed: the two scalings cancel whatever the sign."""
    prescale: bool = False
    """Divide by world size before the reduction instead of after (DeepSpeed ``prescale_gradients``)."""


class CompressionConfig(Section):
    """Gradient compression for the data-parallel reduction (the seeds' CompressionConfig)."""

    method: Literal["none", "fp16", "bf16", "powersgd", "topk", "quantize"] = "none"
    """Compression method."""
    rank: PositiveInt | None = None
    """PowerSGD matrix approximation rank (default 1)."""
    warm_start: bool | None = None
    """PowerSGD: reuse the previous step's factors (default True)."""
    ratio: float | None = Field(default=None, gt=0.0, le=1.0)
    """Top-k: fraction of gradient elements sent each step."""
    bits: Literal[2, 4, 8] | None = None
    """Quantization: bits per element."""
    error_feedback: bool | None = None
    """Keep what was not sent and add it next step (default: on for powersgd/topk, off for quantize)."""
    period: PositiveInt = 1
    """Compress every N-th step; the other steps reduce uncompressed."""
    start_step: NonNegativeInt = 0
    """Uncompressed warm-up steps before compression starts (PowerSGD ``start_powerSGD_iter``)."""

    @model_validator(mode="after")
    def _fields_match_method(self) -> "CompressionConfig":
        owners = {"rank": "powersgd", "warm_start": "powersgd", "ratio": "topk", "bits": "quantize"}
        for field, method in owners.items():
            if getattr(self, field) is not None and self.method != method:
                raise ValueError(f"compression.{field} is read only when compression.method is '{method}' "
                                 f"(method is '{self.method}')")  # fmt: skip
        if self.error_feedback and self.method in ("none", "fp16", "bf16"):
            raise ValueError(f"compression.error_feedback has no meaning for method '{self.method}'")
        if self.method == "topk" and self.ratio is None:
            raise ValueError("compression.ratio is required when compression.method is 'topk'")
        if self.method == "quantize" and self.bits is None:
            raise ValueError("compression.bits is required when compression.method is 'quantize'")
        return self


# --------------------------------------------------------------------------------------------------
# activation checkpointing, communication, launch


class ActivationCheckpointingConfig(Section):
    """Recompute activations in backward instead of storing them."""

    enabled: bool = False
    """Checkpoint activations."""
    modules: list[str] = []
    """Module class names to checkpoint. Empty: the sharding units (wrapped blocks)."""
    cpu_offload: bool = False
    """Keep saved activations on the CPU (``torch.autograd.graph.save_on_cpu``)."""


class CommunicationConfig(Section):
    """The process group and collective settings."""

    backend: Literal["auto", "nccl", "gloo", "mpi", "ccl"] = "auto"
    """torch.distributed backend. auto: nccl with CUDA, gloo otherwise."""
    init_method: str | None = None
    """Process-group init method (``env://``, ``tcp://host:port``, ``file://...``). None: ``env://``."""
    timeout_s: Annotated[float, Field(gt=0.0, le=MAX_TIMEOUT_S)] | None = None
    """Collective timeout in seconds. None: torch's default."""
    hierarchical_allreduce: bool = False
    """Reduce within nodes, then across nodes (Horovod)."""
    hierarchical_allgather: bool = False
    """Gather within nodes, then across nodes (Horovod)."""
    fusion_threshold_bytes: Annotated[int, Field(ge=0, le=MAX_BYTES_SIZE)] | None = None
    """Tensor-fusion buffer size in bytes (Horovod); 0 disables fusion."""
    cycle_time_ms: Annotated[float, Field(ge=0.0, le=MAX_TIMEOUT_S * 1000)] | None = None
    """Fusion cycle time in milliseconds (Horovod)."""


ProcessCount = Annotated[int, Field(gt=0, le=MAX_PROCESSES)]
"""A number of processes or nodes: at least 1, at most :data:`MAX_PROCESSES`."""
PerNodeCount = Annotated[int, Field(gt=0, le=MAX_PROCESSES_PER_NODE)]
"""Processes on one node: at least 1, at most :data:`MAX_PROCESSES_PER_NODE`."""


class Host(Section):
    """One machine of a multi-node job."""

    name: str
    """Host name or address."""
    slots: PerNodeCount | None = None
    """Processes (usually accelerators) on this host. None: the launcher decides."""


# A named alias: pydantic builds one validator for it per model and refers to it from each of the seven launch fields
# that accept it. Inlined, its Unicode pattern was compiled fourteen times (in LaunchConfig's and TorshConfig's
# validators): ~6 ms of this module's import and ~1.7 MiB of memory. The JSON schema names it once, $defs/ShellRef.
ShellRef = TypeAliasType(
    "ShellRef", Annotated[str, Field(pattern=r"^(\$\w+|\$\{[^{}]+\}|\$\(\([^()]*\)\)|<[^<>]+>|\{\w+\})$")])
"""A launch value written as a shell variable (``$NGPU``, ``${NODE_RANK:-0}``, ``$((N * 8))``) or a documentation
placeholder (``<n>``, ``{num_gpus}``); kept verbatim for the shell that runs the command."""


class LaunchConfig(Section):
    """How the processes of the job are started (torchrun, deepspeed, horovodrun, mpirun)."""

    nnodes: ProcessCount | ShellRef | None = None
    """Number of nodes (the minimum when elastic)."""
    max_nnodes: ProcessCount | ShellRef | None = None
    """Maximum number of nodes for an elastic job. None: fixed size."""
    nproc_per_node: PerNodeCount | Literal["auto", "gpu", "cpu"] | ShellRef | None = None
    """Processes per node."""
    world_size: ProcessCount | ShellRef | None = None
    """Total processes, when given without a topology (e.g. ``horovodrun -np``)."""
    node_rank: Annotated[int, Field(ge=0, lt=MAX_PROCESSES)] | ShellRef | None = None
    """This node's index (static rendezvous)."""
    master_addr: str | None = None
    """Address of rank 0 (static rendezvous)."""
    master_port: Annotated[int, Field(ge=0, le=65535)] | ShellRef | None = None
    """Port of rank 0 (static rendezvous)."""
    rdzv_backend: str | None = None
    """Rendezvous backend (static, c10d, etcd, ...)."""
    rdzv_endpoint: str | None = None
    """Rendezvous host[:port]."""
    rdzv_id: str | None = None
    """Rendezvous job id."""
    rdzv_conf: dict[str, str] = {}
    """Extra rendezvous settings (``timeout``, ``join_timeout``, ...)."""
    standalone: bool = False
    """Single-node job with a local rendezvous."""
    max_restarts: NonNegativeInt | ShellRef | None = None
    """Worker-group restarts before failing."""
    hosts: list[Host] = []
    """Hosts and their slots (hostfile / ``-H``)."""
    hostfile: str | None = None
    """Path of the hostfile the command names (its hosts, when known, are in ``hosts``)."""
    include: str | None = None
    """DeepSpeed ``--include`` node/slot filter."""
    exclude: str | None = None
    """DeepSpeed ``--exclude`` node/slot filter."""
    script: str | None = None
    """Training script (or module with ``module``)."""
    script_args: list[str] = []
    """Arguments passed to the training script."""
    module: bool = False
    """Run ``script`` as a module (``python -m``)."""
    no_python: bool = False
    """Execute ``script`` directly, not through Python."""
    local_rank_argv: Literal["--local_rank", "--local-rank"] | None = None
    """The flag the launcher appends to the script's arguments with the local rank (deepspeed: ``--local_rank``,
    ``torch.distributed.launch``: ``--local-rank``). None: the script gets only the ``LOCAL_RANK`` variable."""
    env: dict[str, str] = {}
    """Environment variables exported to every worker."""
    forward_env: list[str] = []
    """Variables forwarded to every worker with their value in the launching shell (``mpirun -x NAME``)."""

    @model_validator(mode="after")
    def _elastic_range(self) -> "LaunchConfig":
        if isinstance(self.max_nnodes, int) and isinstance(self.nnodes, int) and self.max_nnodes < self.nnodes:
            raise ValueError(f"launch.max_nnodes ({self.max_nnodes}) is smaller than launch.nnodes ({self.nnodes})")
        if self.include and self.exclude:
            raise ValueError("launch.include and launch.exclude cannot both be set (DeepSpeed rejects it too)")
        return self


# --------------------------------------------------------------------------------------------------
# checkpoint, monitoring, pipeline, data


class CheckpointConfig(Section):
    """Where and how often checkpoints are written."""

    dir: str | None = None
    """Checkpoint directory."""
    interval_steps: PositiveInt | None = None
    """Save every N optimizer steps. None: only when the script asks."""
    keep_last: PositiveInt | None = None
    """Keep only the newest N checkpoints. None: keep all."""
    tag_validation: Literal["warn", "ignore", "fail"] = "warn"
    """Check that every rank saves under the same tag."""
    save_full_weights: bool = False
    """Also save consolidated (unsharded) weights in the compute dtype (DeepSpeed
    ``gather_16bit_weights_on_model_save``)."""
    state_dict_type: Literal["sharded", "full"] = "sharded"
    """Checkpoint form: one shard per rank, or one full state dict."""


class WriterConfig(Section):
    """A metrics writer (TensorBoard, CSV)."""

    enabled: bool = False
    """Write metrics."""
    output_path: str = ""
    """Directory."""
    job_name: str = "DeepSpeedJobName"
    """Sub-directory per run."""


class WandbConfig(Section):
    """Weights & Biases logging."""

    enabled: bool = False
    """Log to wandb."""
    project: str | None = None
    """Project name."""
    team: str | None = None
    """Team (entity)."""
    group: str | None = None
    """Run group."""


class ProfilerConfig(Section):
    """FLOPs / time profiling at one step."""

    enabled: bool = False
    """Profile."""
    profile_step: PositiveInt = 1
    """Step to profile."""
    module_depth: int = Field(default=-1, ge=-1)
    """Depth of the module tree in the report (-1: all)."""
    top_modules: NonNegativeInt = 1
    """Modules listed per level."""
    detailed: bool = True
    """Per-module detail."""
    output_file: str | None = None
    """Report file. None: stdout."""


class TimelineConfig(Section):
    """A communication timeline trace (Horovod timeline)."""

    filename: str | None = None
    """Trace file."""
    mark_cycles: bool = False
    """Mark fusion cycles in the trace."""


class MonitoringConfig(Section):
    """Logging, metrics and profiling."""

    steps_per_print: PositiveInt | None = None
    """Log progress every N optimizer steps. None: never."""
    wall_clock_breakdown: bool = False
    """Time forward, backward and step separately."""
    log_level: str | None = None
    """Log level of the framework's logger."""
    tensorboard: WriterConfig = WriterConfig()
    """TensorBoard events."""
    csv: WriterConfig = WriterConfig()
    """CSV metrics files."""
    wandb: WandbConfig = WandbConfig()
    """Weights & Biases."""
    profiler: ProfilerConfig = ProfilerConfig()
    """FLOPs profiler."""
    timeline: TimelineConfig = TimelineConfig()
    """Communication timeline."""


class ParallelismConfig(Section):
    """The parallel degrees of the job's device mesh, named as torchtitan and Accelerate name them.

    The data-parallel degree is what the others leave: world size / (tp x pp x cp). Within it, the shard group is
    ``sharding.hybrid_shard_size`` (the dp_shard degree; None: every data-parallel rank) and ``dp_replicate`` the
    number of groups; give one of the two, the other follows from the world size.
    """

    dp_replicate: PositiveInt | None = None
    """Data-parallel replicas of the shard groups (HSDP). None: the data-parallel ranks / sharding.hybrid_shard_size;
    set it instead of sharding.hybrid_shard_size when the group size depends on the world size."""
    tp: Annotated[int, Field(gt=0, le=MAX_PROCESSES)] = 1
    """Tensor-parallel degree: the model's linear layers are split over this many ranks (DTensor)."""
    pp: Annotated[int, Field(gt=0, le=MAX_PROCESSES)] | MaybeAuto = 1
    """Pipeline-parallel degree (pipeline stages). "auto": the stages of a DeepSpeed ``PipelineModule``."""
    cp: Annotated[int, Field(gt=0, le=MAX_PROCESSES)] = 1
    """Context (sequence) parallel degree."""
    tp_plan: dict[str, Literal["colwise", "rowwise"]] | None = None
    """Which linear layers tensor parallelism splits: module-name patterns (``*`` matches within one dotted name,
    ``**`` across them) -> colwise or rowwise. None: the default plan for Hugging Face-style names."""


class PipelineConfig(Section):
    """Pipeline schedule settings (the number of stages is ``parallelism.pp``)."""

    micro_batches: PositiveInt | None = None
    """Micro-batches per pipeline step."""
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] | None = None
    """Schedule."""
    partition_method: str | None = None
    """How layers are assigned to stages (DeepSpeed ``partition``: parameters, uniform, type:...)."""
    activation_checkpoint_interval: NonNegativeInt = 0
    """Checkpoint every N layers (0: off)."""

    @model_validator(mode="before")
    @classmethod
    def _stages_moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "stages" in data:
            raise ValueError(f"pipeline.stages={data['stages']!r} moved to parallelism.pp (one place for every "
                             "parallel degree): write it there")  # fmt: skip
        return data


class DataConfig(Section):
    """The training dataloader ``torsh.initialize`` builds from ``training_data``."""

    drop_last: bool = False
    """Drop the last incomplete batch (DeepSpeed ``dataloader_drop_last``)."""
    shuffle: bool = True
    """Shuffle with a ``DistributedSampler``."""
    seed: int = Field(default=0, ge=-(2**63), lt=2**64)
    """Sampler seed."""
    num_workers: Annotated[int, Field(ge=0, le=MAX_PROCESSES_PER_NODE)] = 0
    """Dataloader worker processes."""
    epochs: PositiveInt | None = None
    """Passes over the data (used to resolve "auto" total step counts)."""


# --------------------------------------------------------------------------------------------------
# root

SECTION_NAMES = (
    "batch", "sharding", "ddp", "precision", "offload", "optimizer", "scheduler", "gradients", "compression",
    "activation_checkpointing", "communication", "launch", "checkpoint", "monitoring", "parallelism", "pipeline",
    "data", "extensions",
)  # fmt: skip


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


_restore_docstring_reader(_DOCSTRING_READER)  # every model class of this module is built
