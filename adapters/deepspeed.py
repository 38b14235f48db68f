"""DeepSpeed 0.19.8 JSON (and hjson) <-> the core model.

Reading makes DeepSpeed's *effective* behaviour explicit in the core model, so that writing another dialect
keeps it: clipping at 1.0 when ``gradient_clipping`` is absent, the reduce dtype following bf16/fp16, fp32
master weights, DeepSpeed's Adam being AdamW with a weight decay of 0, its loss-scaling rules (ZeRO's
hysteresis vs stage 0's), warm-up shape ``log``. Every key ends in one note:

* mapped (exact / approximate), or made explicit when absent (defaulted);
* ``"auto"`` (the Hugging Face convention) -> deferred, with where the value will come from;
* knobs with no core meaning (bucket sizes, prefetch, aio, autotuning, ...) -> ignored, kept in
  ``extensions["deepspeed"]`` so writing DeepSpeed again restores them;
* keys 0.19.8 removed (``amp``, ``elasticity``, 1-bit optimizers, ...) -> dropped, with what to use instead;
* unknown keys -> dropped with a did-you-mean. DeepSpeed ignores unknown top-level keys silently (a misspelt
  ``gradient_clippping`` would leave clipping at 1.0); here they are lossy notes, so ``--strict`` fails on them.

The cross-key rules (precision, optimizer, scheduler, offload) live in ``adapters/_deepspeed_rules.py`` (reading)
and ``adapters/_deepspeed_write.py`` (writing).
"""

from __future__ import annotations

from typing import Any

from torsh import schemas
from torsh.config import TorshConfig
from torsh.errors import ConfigError, Problem
from torsh.translate import (
    Alias,
    Dropped,
    Fidelity,
    FieldMap,
    Ignored,
    Note,
    To,
    Translation,
    Unsupported,
    check_version,
    read_mapping,
    write_mapping,
)

from . import _deepspeed_rules as rules
from ._deepspeed_write import WRITE_HOOKS

NAME = "deepspeed"
VERSIONS = ("0.19.8",)
DEFAULT_FORMAT = "json"

_PERF = "a performance knob with no numerical effect; the torsh engine sizes this itself"
_ZERO3_PERF = "a ZeRO-3 fetch/partition knob (FSDP2 prefetches implicitly); no numerical effect"
#: The bucket sizes torsh.engine.units reads from the kept value (DDP buckets, FSDP2 unit sizes).
_SIZES_UNITS = "no numerical effect; kept: the torsh engine sizes its DDP buckets / FSDP2 units from it (see explain)"
_OFFLOAD_IO = "an offload I/O knob; no numerical effect"
_LOGGING = "logging only; no effect on training"
_CHECKPOINTING_CALLS = (
    "only configures deepspeed.checkpointing.checkpoint calls in model code; DeepSpeed does not checkpoint the "
    "model by itself (torsh uses activation_checkpointing.enabled)"
)
_DS_ONLY = "a DeepSpeed-only feature the torsh engine does not run; kept for DeepSpeed"


def _removed(instead: str) -> Any:
    return Dropped(f"removed in DeepSpeed 0.19.8 (DeepSpeedConfig raises on it); {instead}")


#: DeepSpeed key (canonical spelling) -> core path or status. Hooks record keys whose meaning depends on
#: other keys; ``_deepspeed_rules.finalize`` turns them into core values once the whole file is read.
FIELD_MAP: dict[str, Any] = {
    # batch (DeepSpeed's resolution rule is BatchConfig.resolve)
    "train_batch_size": "batch.global_batch_size",
    "train_micro_batch_size_per_gpu": "batch.micro_batch_size",
    "gradient_accumulation_steps": "batch.gradient_accumulation_steps",
    "managed_gradient_accumulation": rules.unless_default(
        True, Unsupported("false makes every step() a boundary (the caller owns accumulation); torsh "
                          "accumulates per batch.gradient_accumulation_steps")),
    # gradients
    "gradient_clipping": rules.CLIPPING,
    "prescale_gradients": To("gradients.prescale", default=False),
    "gradient_predivide_factor": To("gradients.predivide_factor", default=1.0),
    "gradient_allreduce_op": To("gradients.reduce_op", default="mean"),
    "communication_data_type": rules.record(),
    "seq_parallel_communication_data_type": Ignored("sequence parallelism is not part of the core model"),
    "sparse_gradients": _removed("gradients of nn.Embedding(sparse=True) are still reduced sparsely without it"),
    # precision
    **{f"fp16.{k}": rules.record() for k in rules.FP16_DEFAULTS},
    **{f"bf16.{k}": rules.record() for k in rules.BF16_DEFAULTS},
    "bf16.immediate_grad_update": Ignored(_PERF),
    **{f"torch_autocast.{k}": rules.record() for k in ("enabled", "dtype")},
    "torch_autocast.lower_precision_safe_modules": Unsupported("torsh autocasts the whole forward"),
    **{f"data_types.{k}": rules.record() for k in ("param_dtype", "grad_accum_dtype", "buffer_dtype")},
    "data_types.keep_in_fp32_modules": rules.unless_default(
        "auto", Unsupported("torsh casts every parameter to precision.param_dtype")),
    "amp": _removed("use \"bf16\", \"fp16\" or \"torch_autocast\""),
    # ZeRO
    "zero_optimization.stage": To("sharding.stage", default=0),
    "zero_optimization.offload_param.device": rules.record(),
    "zero_optimization.offload_param.nvme_path": rules.record(),
    "zero_optimization.offload_param.pin_memory": rules.record(),
    "zero_optimization.offload_optimizer.device": rules.record(),
    "zero_optimization.offload_optimizer.nvme_path": rules.record(),
    "zero_optimization.offload_optimizer.pin_memory": rules.record(),
    **{f"zero_optimization.offload_param.{k}": Ignored(_OFFLOAD_IO)
       for k in ("buffer_count", "buffer_size", "max_in_cpu")},
    **{f"zero_optimization.offload_optimizer.{k}": Ignored(_OFFLOAD_IO)
       for k in ("buffer_count", "pipeline_read", "pipeline_write", "fast_init", "cpuadam_cores_perc")},
    "zero_optimization.offload_optimizer.ratio": rules.unless_default(
        1.0, Unsupported("partial optimizer offload (ZeRO-3 only) has no torch equivalent")),
    "zero_optimization.offload_optimizer.super_offload": rules.unless_default(
        False, Unsupported("SuperOffload has no torch equivalent")),
    "zero_optimization.cpu_offload": rules.record(),
    "zero_optimization.cpu_offload_param": rules.record(),
    "zero_optimization.cpu_offload_use_pin_memory": rules.record(),
    "zero_optimization.gather_16bit_weights_on_model_save": rules.SAVE_FULL_WEIGHTS,
    "allgather_size": Ignored("legacy top-level bucket size (with \"zero_optimization\": true)"),
    "zero_optimization.zero_hpz_partition_size": rules.HPZ,
    **{f"zero_optimization.{k}": Ignored(_PERF) for k in (
        "contiguous_gradients", "reduce_scatter", "use_multi_rank_bucket_allreduce",
        "allgather_partitions", "overlap_comm", "round_robin_gradients",
        "sub_group_size", "memory_efficient_linear", "parameter_alignment", "log_trace_cache_warnings",
        "enable_sanity_checks", "override_module_apply", "pipeline_loading_checkpoint",
        "save_muon_momentum_buffer_in_memory", "leaf_module", "compute_grad_norm", "ignore_unused_parameters",
        "load_from_fp32_weights", "elastic_checkpoint")},
    "zero_optimization.reduce_bucket_size": rules.positive_or_drop(Ignored(_SIZES_UNITS), "5e8"),
    **{f"zero_optimization.{k}": Ignored(_SIZES_UNITS) for k in (
        "allgather_bucket_size", "prefetch_bucket_size", "max_live_parameters")},
    **{f"zero_optimization.{k}": Ignored(_ZERO3_PERF) for k in (
        "param_persistence_threshold", "model_persistence_threshold", "max_reuse_distance", "module_granularity_threshold",
        "use_all_reduce_for_fetch_params", "allgather_sequential")},
    **{f"zero_optimization.{k}": rules.unless_default(False, Unsupported("ZeRO++ quantized communication has no "
                                                                         "torch equivalent"))
       for k in ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients")},
    "zero_optimization.zenflow": Unsupported(_DS_ONLY),
    "zero_optimization.legacy_stage1": rules.unless_default(False, Dropped("DeepSpeed 0.19.8 raises when true")),
    **{f"zero_optimization.{k}": _removed(instead) for k, instead in (
        ("mics_shard_size", "use zero_hpz_partition_size (hierarchical partitioning, FSDP2 HSDP)"),
        ("mics_hierarchical_params_gather", "use zero_hpz_partition_size (hierarchical partitioning)"),
        ("zeropp_loco_param", "remove it; ZeRO++ quantized gradients work without LoCo"))},
    "zero_allow_untested_optimizer": Ignored("a DeepSpeed safety check on client optimizers"),
    "zero_force_ds_cpu_optimizer": Ignored("a DeepSpeed safety check on client optimizers with offload"),
    # optimizer, scheduler
    "optimizer.type": rules.record(),
    "optimizer.params.*": rules.record(),
    "optimizer.legacy_fusion": Ignored(_PERF),
    "scheduler.type": rules.record(),
    "scheduler.params.*": rules.record(),
    # activation checkpointing (DeepSpeed's section configures its checkpoint function, not the model)
    **{f"activation_checkpointing.{k}": Unsupported(_CHECKPOINTING_CALLS) for k in (
        "partition_activations", "contiguous_memory_optimization", "cpu_checkpointing", "number_checkpoints",
        "synchronize_checkpoint_boundary", "profile")},
    # monitoring
    "steps_per_print": "monitoring.steps_per_print",
    "wall_clock_breakdown": To("monitoring.wall_clock_breakdown", default=False),
    "log_level": "monitoring.log_level",
    **{f"tensorboard.{k}": f"monitoring.tensorboard.{k}" for k in ("enabled", "output_path", "job_name")},
    **{f"csv_monitor.{k}": f"monitoring.csv.{k}" for k in ("enabled", "output_path", "job_name")},
    **{f"wandb.{k}": f"monitoring.wandb.{k}" for k in ("enabled", "group", "team", "project")},
    **{f"comet.{k}": Ignored(_LOGGING) for k in (
        "enabled", "samples_log_interval", "project", "workspace", "api_key", "experiment_name", "experiment_key",
        "online", "mode")},
    **{f"comms_logger.{k}": Ignored(_LOGGING) for k in ("enabled", "prof_all", "prof_ops", "verbose", "debug")},
    **{f"flops_profiler.{k}": f"monitoring.profiler.{k}" for k in (
        "enabled", "profile_step", "module_depth", "top_modules", "detailed", "output_file")},
    "flops_profiler.recompute_fwd_factor": Ignored(_LOGGING),
    "memory_breakdown": Ignored(_LOGGING),
    "dump_state": Ignored(_LOGGING),
    "timers": Ignored(_LOGGING),
    # checkpoint
    "checkpoint.tag_validation": To("checkpoint.tag_validation", default="warn"),
    "checkpoint.load_universal": rules.unless_default(
        False, Unsupported("torsh checkpoints (torch.distributed.checkpoint) reshard on load by themselves")),
    **{f"checkpoint.{k}": Ignored("checkpoint I/O detail; torsh writes torch.distributed.checkpoint") for k in (
        "use_node_local_storage", "parallel_write", "checkpoint_serialization", "writer")},
    "datastates_ckpt": Ignored("asynchronous checkpoint engine; no numerical effect"),
    "nebula": _removed("use torsh's checkpoint section (torch.distributed.checkpoint)"),
    # data
    "dataloader_drop_last": To("data.drop_last", default=False),
    "data_efficiency": rules.unless_disabled(Unsupported("curriculum learning / random-LTD are not run by torsh")),
    "curriculum_learning": _removed("use data_efficiency.data_sampling.curriculum_learning"),
    # parallelism and engines the core model only carries or does not have
    "pipeline.stages": rules.PIPELINE_STAGES,
    "pipeline.partition": To("pipeline.partition_method", fidelity=rules.APPROXIMATE,
                             reason="used only with a DeepSpeed PipelineModule; torsh does not run pipelines yet"),
    "pipeline.activation_checkpoint_interval": To("pipeline.activation_checkpoint_interval"),
    **{f"pipeline.{k}": Ignored("a PipelineModule detail") for k in (
        "seed_layers", "pipe_partitioned", "grad_partitioned", "use_reentrant")},
    "tensor_parallel": rules.TENSOR_PARALLEL,
    "sequence_parallel_size": rules.unless_default(1, Unsupported("sequence parallelism is not run by torsh")),
    "data_parallel_size": Unsupported("an explicit data-parallel mesh size; torsh uses the launch world size"),
    "expert_parallel": Unsupported(_DS_ONLY),
    "use_data_before_expert_parallelism": rules.unless_default(False, Unsupported(_DS_ONLY)),
    "hybrid_engine": rules.unless_disabled(Unsupported("the RLHF hybrid engine is DeepSpeed-only")),
    "compile": rules.unless_default_section("deepcompile", False, Unsupported("DeepCompile passes are DeepSpeed-only")),
    "weight_quantization": Unsupported("inference weight quantization is DeepSpeed-only"),
    "vocabulary_size": Ignored("only used by DeepSpeed for a warning"),
    "disable_allgather": Ignored(_PERF),
    "disable_python_gc": Ignored(_PERF),
    **{f"aio.{k}": Ignored("NVMe asynchronous-I/O tuning; no numerical effect") for k in (
        "block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events", "use_gds")},
    "autotuning": Ignored("DeepSpeed's autotuner searches knobs offline; no effect on a training run"),
    # removed top-level sections
    "elasticity": _removed("set train_batch_size / train_micro_batch_size_per_gpu / gradient_accumulation_steps "
                           "directly (torchrun --nnodes MIN:MAX for an elastic launch)"),
    "compression_training": _removed("the compression library is gone: train unquantized, quantize afterwards"),
    "quantize_training": _removed("Mixture-of-Quantization is gone: train unquantized, quantize afterwards"),
    "eigenvalue": _removed("it only drove Mixture-of-Quantization, which is gone too"),
    "sparse_attention": _removed("use torch.nn.functional.scaled_dot_product_attention or flex_attention"),
    "graph_harvesting": _removed("use torch.compile / CUDA graphs in the model code"),
    "progressive_layer_drop": _removed("implement layer drop in the model"),
}

#: Legacy and alternative spellings DeepSpeed 0.19.8 still accepts.
ALIASES = {
    "bfloat16": Alias("bf16", "0.6"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save":
        Alias("zero_optimization.gather_16bit_weights_on_model_save", "0.9 (both accepted)"),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save":
        Alias("zero_optimization.gather_16bit_weights_on_model_save", "0.6 (deprecated)"),
    **{f"zero_optimization.stage3_{k}": Alias(f"zero_optimization.{k}", "0.9 (both accepted)") for k in (
        "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
        "max_live_parameters", "max_reuse_distance", "module_granularity_threshold",
        "use_all_reduce_for_fetch_params", "allgather_sequential")},
}

#: Per DeepSpeed key, DeepSpeed value -> core value (strings compare case-insensitively).
VALUE_MAPS = {
    "checkpoint.tag_validation": {"warn": "warn", "ignore": "ignore", "fail": "fail"},
    "gradient_allreduce_op": {"mean": "mean", "sum": "sum"},
    "zero_optimization.stage": {0: 0, 1: 1, 2: 2, 3: 3},
}

_FIELD_MAP = FieldMap(FIELD_MAP, ALIASES)

#: Keys whose presence marks DeepSpeed JSON when sniffing.
_MARKERS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_clipping", "steps_per_print",
            "wall_clock_breakdown", "zero_allow_untested_optimizer"}
#: DeepSpeed's precision and ZeRO keys are sections; HF Trainer arguments use the same names as booleans.
_SECTION_MARKERS = ("zero_optimization", "fp16", "bf16", "bfloat16")


def sniff(raw: Any) -> float:
    """0.95 when the top level holds DeepSpeed's own keys (its sections as objects), else 0."""
    if not isinstance(raw, dict) or not raw:
        return 0.0
    sections = any(isinstance(raw.get(k), dict) for k in _SECTION_MARKERS) or raw.get("zero_optimization") is True
    return 0.95 if sections or _MARKERS & set(raw) else 0.0


def read(raw: Any, *, version: str | None = None) -> Translation[TorshConfig]:
    """Read a DeepSpeed config dict (parsed JSON/hjson) into the core model with a note for every key."""
    check_version(NAME, version, VERSIONS)
    if not isinstance(raw, dict):
        raise ConfigError([Problem("", raw, "a DeepSpeed config must be a JSON object")], source=NAME)
    problems = [p for p in schemas.check(raw, NAME) if "additional properties" not in p.reason.lower()]
    if problems:
        raise ConfigError(problems, source=NAME)
    raw, early_notes = rules.legacy_forms(raw)
    raw, nested_notes = rules.unknown_in_whole_sections(raw, _FIELD_MAP, schemas.load(NAME))
    known, unknown_notes = rules.split_unknown(raw, _FIELD_MAP)
    unknown_notes += nested_notes
    refused = rules.refused_unknown_keys(unknown_notes)
    if refused:
        raise ConfigError(refused, source=NAME)
    translation = read_mapping(known, dialect=NAME, field_map=_FIELD_MAP, value_maps=VALUE_MAPS,
                               deferred_sources=rules.DEFERRED_SOURCES, finalize=rules.finalize)
    translation.notes[:0] = early_notes
    translation.notes.extend(unknown_notes)
    translation.notes[:] = rules.mark_auto(translation.notes)
    return translation


def write(cfg: TorshConfig, *, version: str | None = None) -> Translation[dict]:
    """Write the core model as DeepSpeed 0.19.8 JSON; what DeepSpeed cannot express becomes a note."""
    check_version(NAME, version, VERSIONS)
    translation = write_mapping(cfg, dialect=NAME, field_map=_WRITE_MAP, value_maps=VALUE_MAPS)
    if NAME not in cfg.extensions:  # a DeepSpeed source is written back with the batch keys it had
        _batch_for_deepspeed(translation)
    return translation


#: A micro batch DeepSpeed accepts when the source leaves the batch to the training script.
UNSTATED_MICRO_BATCH = 1


def _batch_for_deepspeed(translation: Translation[dict]) -> None:
    """DeepSpeed refuses a config without train_batch_size or train_micro_batch_size_per_gpu (an assertion at
    start-up). A source that leaves the batch to the script (FSDP, FairScale, Horovod) gets a micro batch of 1 and
    a note: the script's DataLoader decides what it feeds; DeepSpeed uses the number for its own dataloader, its
    throughput logs and train_batch_size."""
    if {"train_batch_size", "train_micro_batch_size_per_gpu"} & set(translation.result):
        return
    translation.result["train_micro_batch_size_per_gpu"] = UNSTATED_MICRO_BATCH
    translation.notes.append(Note("batch.micro_batch_size", "train_micro_batch_size_per_gpu", None, Fidelity.DEFAULTED,
                                  f"the source leaves the batch to the script; DeepSpeed refuses a config without "
                                  f"one, so {UNSTATED_MICRO_BATCH} is written: set it to the DataLoader's batch size "
                                  "per rank (or \"auto\" when the HF Trainer / Accelerate fill it)"))  # fmt: skip


# The write side: the derived reverse map, plus one hook per concept that spans several DeepSpeed keys.
_WRITE_MAP = FieldMap({**FIELD_MAP, **WRITE_HOOKS}, ALIASES)
