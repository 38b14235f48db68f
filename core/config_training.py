"""The sections of the config model that decide what one training step computes: batch sizes, sharding (ZeRO stage /
FSDP) and DDP, precision and loss scaling, offload, the optimizer and LR scheduler, gradient clipping and reduction,
compression, activation checkpointing. Imported from :mod:`torsh.config`."""

# No ``from __future__ import annotations`` in this module: with it, pydantic compiles and evaluates the field
# annotations from strings when the classes are built (~4 ms of every torsh-migrate call); as real objects they
# come from the module's cached bytecode. Annotations naming their own class are quoted.

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Discriminator,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Tag,
    model_validator,
)

from .concepts.optim import DEEPSPEED_SCHEDULERS
from .concepts.precision import GRAD_SCALER
from .deferred import AUTO, Deferred, is_deferred
from . import _config_docs
from .errors import ConfigError, Problem
from .config_base import MAX_BYTES_SIZE, MAX_LOSS_SCALE, MAX_PROCESSES, DType, MaybeAuto, Probability, Section

_DOCSTRING_READER = _config_docs.install(__name__, __file__)


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


ElementCount = Annotated[int, Field(gt=0, le=MAX_BYTES_SIZE)]
"""A positive number of tensor elements (a bucket, a window of parameters)."""
ElementCountOrZero = Annotated[int, Field(ge=0, le=MAX_BYTES_SIZE)]
"""A number of tensor elements where 0 switches the behaviour off (no bucketing, no prefetch, no reuse window)."""


class BucketSizes(Section):
    """The data-parallel collectives' sizes and windows in tensor elements, as DeepSpeed's ZeRO states them.

    Each left None takes DeepSpeed 0.19.8's default. DDP (stages 0/1) counts its buckets in MiB of gradient bytes:
    ``reduce_bucket_size`` becomes ``ddp.bucket_cap_mb`` unless that is set. FSDP2 (stage 3) issues one all-gather
    and one reduce-scatter per unit: units of consecutive blocks are grouped up to these sizes."""

    reduce_bucket_size: ElementCount | MaybeAuto | None = None
    """Gradients reduced per collective (DeepSpeed ``reduce_bucket_size``, default 5e8)."""
    allgather_bucket_size: ElementCountOrZero | MaybeAuto | None = None
    """Parameters all-gathered per collective after a ZeRO-1/2 step (DeepSpeed ``allgather_bucket_size``, default
    5e8; 0: no bucketing)."""
    prefetch_bucket_size: ElementCountOrZero | MaybeAuto | None = None
    """ZeRO-3 parameters fetched ahead in forward (DeepSpeed ``stage3_prefetch_bucket_size``, default 5e7; 0: no
    prefetch)."""
    max_live_parameters: ElementCountOrZero | MaybeAuto | None = None
    """Most ZeRO-3 parameters kept gathered by prefetching (DeepSpeed ``stage3_max_live_parameters``, default 1e9;
    0: none held ahead, so each block is its own unit)."""
    max_reuse_distance: ElementCountOrZero | MaybeAuto | None = None
    """A ZeRO-3 parameter used again within this many elements stays gathered (DeepSpeed
    ``stage3_max_reuse_distance``, default 1e9; 0: always released)."""
    param_persistence_threshold: ElementCountOrZero | MaybeAuto | None = None
    """ZeRO-3 parameters with fewer elements stay whole on every rank (DeepSpeed
    ``stage3_param_persistence_threshold``, default 1e5)."""


class LeafModules(Section):
    """Modules whose parameters are gathered together, never split into several sharding units (DeepSpeed's ZeRO-3
    leaf modules: an MoE block whose ranks call different experts)."""

    classes: list[str] | None = None
    """Class names, qualified or not. None: DeepSpeed 0.19.8's defaults (the Mixtral, Qwen2-MoE and Qwen3-MoE
    sparse blocks of transformers)."""
    names: list[str] = []
    """Module names as in ``model.named_modules()``."""
    name_suffixes: list[str] = []
    """Endings of module names."""


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
    buckets: BucketSizes | None = None
    """Collective sizes in elements, as DeepSpeed states them; set (even empty) for a job sized as DeepSpeed sizes
    it. None: DDP's ``ddp.bucket_cap_mb``, and each direct child holding parameters is an FSDP2 unit."""
    leaf_modules: LeafModules = LeafModules()
    """Modules never split into several sharding units."""
    ignore_unused_parameters: bool = True
    """ZeRO-2 with optimizer offload: a parameter without a gradient since the last step is fine (False: the step
    raises naming it, as DeepSpeed's ``ignore_unused_parameters: false``)."""

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
    """Directory for NVMe offload (the optimizer state's files go under ``zero_stage_<stage>/optimizer/rank<r>/<n>``,
    one folder per optimizer of the process)."""
    nvme_sub_group_size: NonNegativeInt | MaybeAuto = 1_000_000_000
    """NVMe offload: optimizer-state elements read, stepped and written back at a time (DeepSpeed's
    ``zero_optimization.sub_group_size``; 0: one parameter at a time); smaller keeps less state in host memory
    during the step. Configs often write a size larger than any model (``1e14``) for "the whole partition"."""
    nvme_block_size: PositiveInt = 1_048_576
    """NVMe offload: bytes per file read or write request (DeepSpeed's ``aio.block_size``)."""
    nvme_threads: PositiveInt = 1
    """NVMe offload: threads issuing the read and write requests (DeepSpeed's ``aio.intra_op_parallelism``)."""
    nvme_pipeline: bool = False
    """NVMe offload: read the next piece and write the last one while a piece steps (DeepSpeed's
    ``offload_optimizer.pipeline_read`` / ``pipeline_write``)."""

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> "OffloadConfig":
        if "nvme" in (self.params, self.optimizer) and not self.nvme_path:
            raise ValueError("offload.nvme_path is required when offloading to nvme")
        return self


class OptimizerConfig(Section):
    """The optimizer the engine builds (after sharding) when the training script does not pass one."""

    name: str | None = None
    """A ``torch.optim`` class name (``AdamW``, ``Adam``, ``SGD``, ``Adagrad``, ...) or one of DeepSpeed's own
    (``Lamb``, ``Lion``, ``Muon``, ``MuAdam``, ``MuAdamW``, ``MuSGD``), built with DeepSpeed's update rules. None:
    the training script passes the optimizer, and the hyper-parameters set here are applied to its parameter
    groups."""
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
# activation checkpointing


class ActivationCheckpointingConfig(Section):
    """Recompute activations in backward instead of storing them."""

    enabled: bool = False
    """Checkpoint activations."""
    modules: list[str] = []
    """Module class names to checkpoint. Empty: the sharding units (wrapped blocks)."""
    cpu_offload: bool = False
    """Keep saved activations on the CPU (``torch.autograd.graph.save_on_cpu``)."""


_config_docs.restore(_DOCSTRING_READER)  # every model class of this module is built
