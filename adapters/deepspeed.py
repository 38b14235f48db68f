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

Keys whose meaning depends on other keys are groups, each read and written in one place: precision and loss
scaling (``_deepspeed_precision.py``), optimizer and scheduler (``_deepspeed_optim.py``), offload, hierarchical
partitioning and stage ``"auto"`` (``_deepspeed_rules.py``). The reader checks the schema once and walks the input
once before the map (:meth:`DeepSpeed.normalise`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

from torsh import schemas
from torsh.config import TorshConfig
from torsh.dialect import Dialect, Prepared
from torsh.errors import ConfigError, Problem, did_you_mean
from torsh.translate import (
    Alias,
    Dropped,
    Fidelity,
    FieldMap,
    Ignored,
    Note,
    ReadContext,
    To,
    Translation,
    Unsupported,
    WriteContext,
)

from . import _deepspeed_rules as rules
from ._deepspeed_optim import OPTIMIZER, SCHEDULER
from ._deepspeed_precision import PRECISION
from ._sniff import Shape, best, top_keys

_PERF = "a performance knob with no numerical effect; the torsh engine sizes this itself"
_ZERO3_PERF = "a ZeRO-3 fetch/partition knob (FSDP2 prefetches implicitly); no numerical effect"
#: The sizes the engine plan reads from ``sharding.buckets`` (DDP buckets, FSDP2 unit sizes, units kept gathered).
_SIZES_UNITS = "no numerical effect; the torsh engine sizes its DDP buckets / FSDP2 units from it (see explain)"
_OFFLOAD_IO = "an offload I/O knob; no numerical effect"
_LOGGING = "logging only; no effect on training"
_CHECKPOINTING_CALLS = (
    "only configures deepspeed.checkpointing.checkpoint calls in model code; DeepSpeed does not checkpoint the "
    "model by itself (torsh uses activation_checkpointing.enabled)"
)
_DS_ONLY = "a DeepSpeed-only feature the torsh engine does not run; kept for DeepSpeed"


def _removed(instead: str) -> Any:
    return Dropped(f"removed in DeepSpeed 0.19.8 (DeepSpeedConfig raises on it); {instead}")


#: DeepSpeed key (canonical spelling) -> core path or status, for keys read alone. Keys whose meaning depends on
#: other keys are in the groups (``GROUPS``): precision, offload, hierarchical partitioning, optimizer, scheduler.
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
    "sparse_gradients": _removed("gradients of nn.Embedding(sparse=True) are still reduced sparsely without it"),
    # precision
    "bf16.immediate_grad_update": Ignored(_PERF),
    "torch_autocast.lower_precision_safe_modules": Unsupported("torsh autocasts the whole forward"),
    "data_types.keep_in_fp32_modules": rules.unless_default(
        "auto", Unsupported("torsh casts every parameter to precision.param_dtype")),
    "amp": _removed("use \"bf16\", \"fp16\" or \"torch_autocast\""),
    # ZeRO
    "zero_optimization.stage": To("sharding.stage", default=0),
    **{f"zero_optimization.offload_param.{k}": Ignored(_OFFLOAD_IO)
       for k in ("buffer_count", "buffer_size", "max_in_cpu")},
    **{f"zero_optimization.offload_optimizer.{k}": Ignored(_OFFLOAD_IO)
       for k in ("buffer_count", "fast_init", "cpuadam_cores_perc")},
    # NVMe offload's I/O: pieces of sub_group_size elements, block_size requests on intra_op_parallelism threads
    **{key: To(f"offload.{field}", default=rules.nvme_default(field)) for key, field in rules.NVME_IO.items()},
    "zero_optimization.offload_optimizer.ratio": rules.unless_default(
        1.0, Unsupported("partial optimizer offload (ZeRO-3 only) has no torch equivalent")),
    "zero_optimization.offload_optimizer.super_offload": rules.unless_default(
        False, Unsupported("SuperOffload has no torch equivalent")),
    "zero_optimization.gather_16bit_weights_on_model_save": rules.SAVE_FULL_WEIGHTS,
    "allgather_size": Ignored("legacy top-level bucket size (with \"zero_optimization\": true)"),
    **{f"zero_optimization.{k}": Ignored(_PERF) for k in (
        "contiguous_gradients", "reduce_scatter", "use_multi_rank_bucket_allreduce",
        "allgather_partitions", "overlap_comm", "round_robin_gradients",
        "memory_efficient_linear", "parameter_alignment", "log_trace_cache_warnings",
        "enable_sanity_checks", "override_module_apply", "pipeline_loading_checkpoint",
        "save_muon_momentum_buffer_in_memory", "compute_grad_norm",
        "load_from_fp32_weights", "elastic_checkpoint")},
    "zero_optimization.ignore_unused_parameters": To("sharding.ignore_unused_parameters", Fidelity.IGNORED,
                                                     "no numerical effect; false refuses a parameter without a "
                                                     "gradient at the ZeRO-2 offload step, as DeepSpeed does"),
    **{f"zero_optimization.leaf_module.{k}": To(f"sharding.leaf_modules.{k}", Fidelity.IGNORED,
                                                "the torsh engine never splits these modules (default: the Mixtral "
                                                "and Qwen MoE blocks) into FSDP2 units, as DeepSpeed gathers them "
                                                "whole") for k in ("classes", "names", "name_suffixes")},
    "zero_optimization.reduce_bucket_size": rules.positive_or_drop(
        "zero_optimization.reduce_bucket_size", To("sharding.buckets.reduce_bucket_size", Fidelity.IGNORED,
                                                   _SIZES_UNITS), "5e8"),
    **{f"zero_optimization.{k}": To(f"sharding.buckets.{k}", Fidelity.IGNORED, _SIZES_UNITS) for k in (
        "allgather_bucket_size", "prefetch_bucket_size", "max_live_parameters", "max_reuse_distance")},
    "zero_optimization.param_persistence_threshold": To("sharding.buckets.param_persistence_threshold",
                                                        Fidelity.IGNORED, _ZERO3_PERF),
    **{f"zero_optimization.{k}": Ignored(_ZERO3_PERF) for k in (
        "model_persistence_threshold", "module_granularity_threshold",
        "use_all_reduce_for_fetch_params", "allgather_sequential")},
    "zero_optimization.zenflow": Unsupported(_DS_ONLY),
    "zero_optimization.legacy_stage1": rules.unless_default(False, Dropped("DeepSpeed 0.19.8 raises when true")),
    **{f"zero_optimization.{k}": _removed(instead) for k, instead in (
        ("mics_shard_size", "use zero_hpz_partition_size (hierarchical partitioning, FSDP2 HSDP)"),
        ("mics_hierarchical_params_gather", "use zero_hpz_partition_size (hierarchical partitioning)"),
        ("zeropp_loco_param", "remove it; ZeRO++ quantized gradients work without LoCo"))},
    "zero_allow_untested_optimizer": Ignored("a DeepSpeed safety check on client optimizers"),
    "zero_force_ds_cpu_optimizer": Ignored("a DeepSpeed safety check on client optimizers with offload"),
    # optimizer, scheduler
    "optimizer.legacy_fusion": Ignored(_PERF),
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
                             reason="used only with a DeepSpeed PipelineModule"),
    "pipeline.activation_checkpoint_interval": To("pipeline.activation_checkpoint_interval"),
    **{f"pipeline.{k}": Ignored("a PipelineModule detail") for k in (
        "seed_layers", "pipe_partitioned", "grad_partitioned", "use_reentrant")},
    "tensor_parallel": rules.TENSOR_PARALLEL,
    "sequence_parallel_size": To("parallelism.sp"),
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
        "queue_depth", "single_submit", "overlap_events", "use_gds")},
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

#: Keys whose presence marks DeepSpeed JSON when sniffing.
_MARKERS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_clipping", "steps_per_print",
            "wall_clock_breakdown", "zero_allow_untested_optimizer", "zero_optimization"}
#: DeepSpeed's precision keys are sections; HF Trainer arguments use the same names as booleans.
_SECTION_MARKERS = ("fp16", "bf16", "bfloat16")
#: A DeepSpeed config: one of its own keys or sections, among keys DeepSpeed 0.19.8 knows (it ignores the others):
#: every top-level key of its schema (``scheduler`` and ``optimizer`` are read by rules, not the map).
SHAPES = (Shape(0.95, ({*_MARKERS, *_SECTION_MARKERS},),
                top_keys([*FIELD_MAP, *ALIASES, *schemas.load("deepspeed").get("properties", {})]),
                tables=_SECTION_MARKERS, lenient=True),)
#: Keys whose DeepSpeed default *is* the string "auto" (not the Hugging Face convention).
_DEEPSPEED_OWN_AUTO = ("pipeline.stages", "data_types.keep_in_fp32_modules", "zero_optimization.zenflow")
#: A micro batch DeepSpeed accepts when the source leaves the batch to the training script.
UNSTATED_MICRO_BATCH = 1
_IGNORED, _DROPPED, _DEFERRED = Fidelity.IGNORED, Fidelity.DROPPED, Fidelity.DEFERRED


class DeepSpeed(Dialect):
    """DeepSpeed 0.19.8: its map, its groups, and what its reader does before the map (``normalise``)."""

    NAME = "deepspeed"
    VERSIONS = ("0.19.8",)
    FIELD_MAP = FIELD_MAP
    ALIASES = ALIASES
    VALUE_MAPS = VALUE_MAPS
    #: Read in this order (stage "auto" first: the others depend on the stage); written in this order, which is
    #: DeepSpeed's own key order.
    GROUPS = (rules.FULL_WEIGHTS, rules.STAGE_AUTO, PRECISION, rules.OFFLOAD, rules.HIERARCHICAL, OPTIMIZER,
              SCHEDULER, rules.CLIPPING_WRITE, rules.PIPELINE_WRITE, rules.TENSOR_PARALLEL_WRITE)  # fmt: skip
    DEFERRED_SOURCES = rules.DEFERRED_SOURCES

    def shape(self, raw: Any) -> Any:
        if not isinstance(raw, dict):
            raise ConfigError([Problem("", raw, "a DeepSpeed config must be a JSON object")], source=NAME)
        return raw

    def check_schema(self, raw: Mapping[str, Any]) -> None:
        """Done in :meth:`normalise`, in the same pass that finds unknown keys inside sections kept whole."""

    def normalise(self, raw: Mapping[str, Any], prepared: Prepared) -> Prepared:
        """One schema pass, then one walk: unknown keys become DROPPED notes (DeepSpeed ignores unknown top-level
        keys; the ones its strict sections would refuse are errors), legacy forms and Accelerate's values are read
        before the map."""
        raw, lax = _as_pydantic_reads(raw)
        extra = _schema_check(raw)
        _check_validator_bounds(raw)
        data, notes = _before_the_map(copy.deepcopy(dict(raw)))
        notes = lax + notes
        nested, unknown = _Unknown(), _Unknown()
        _prune_whole_sections(data, extra, prepared.field_map, nested)
        prepared.data = _split(data, prepared.field_map, unknown)
        if unknown.refused or nested.refused:
            raise ConfigError(unknown.refused + nested.refused, source=NAME)
        prepared.notes = notes
        prepared.kept = {n.source_path: n.value for n in notes if n.source_path.startswith("flops_profiler.")}
        prepared.state["unknown"] = unknown.notes + nested.notes
        return prepared

    def finalize(self, ctx: ReadContext, prepared: Prepared) -> None:
        """A DeepSpeed job is sized as DeepSpeed sizes it: ``sharding.buckets`` is set (its defaults for the sizes
        the file leaves out) even when the file states none."""
        ctx.core.setdefault("sharding", {}).setdefault("buckets", {})

    def finish(self, translation: Translation[TorshConfig], prepared: Prepared) -> Translation[TorshConfig]:
        """Unknown keys last; an "auto" kept for DeepSpeed is deferred to whoever fills it; a config with no batch
        size is a finding --strict counts."""
        translation.notes.extend(prepared.state["unknown"])
        translation.notes.extend(_unstated_batch(translation.result))
        translation.notes[:] = [_deferred_if_auto(n) for n in translation.notes]
        return translation

    def finish_write(self, ctx: WriteContext, version: str | None) -> None:
        """DeepSpeed refuses a config without train_batch_size or train_micro_batch_size_per_gpu (an assertion at
        start-up). A source that leaves the batch to the script (FSDP, FairScale, Horovod) gets a micro batch of 1
        and a note: the script's DataLoader decides what it feeds; DeepSpeed uses the number for its own
        dataloader, its throughput logs and train_batch_size. A DeepSpeed source keeps the batch keys it had."""
        if NAME in ctx.cfg.extensions or {"train_batch_size", "train_micro_batch_size_per_gpu"} & set(ctx.out):
            return
        ctx.out["train_micro_batch_size_per_gpu"] = UNSTATED_MICRO_BATCH
        ctx.notes.append(Note("batch.micro_batch_size", "train_micro_batch_size_per_gpu", None, Fidelity.DEFAULTED,
                              f"the source leaves the batch to the script; DeepSpeed refuses a config without one, "
                              f"so {UNSTATED_MICRO_BATCH} is written: set it to the DataLoader's batch size per rank "
                              "(or \"auto\" when the HF Trainer / Accelerate fill it)"))  # fmt: skip

    def sniff(self, raw: Any) -> float:
        """DeepSpeed's own top-level keys (``SHAPES``), lowered by keys DeepSpeed does not know."""
        return best(SHAPES, raw)


def _schema_check(raw: Mapping[str, Any]) -> list[Any]:
    """Types and ranges DeepSpeed's schema states, all refused at once; returns its unknown-key findings."""
    schema = schemas.load(NAME)
    if schemas.conforms(raw, schema):  # no error anywhere: jsonschema is not needed
        return []
    import jsonschema

    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(raw))
    problems = []
    for err in sorted(errors, key=lambda e: list(map(str, e.absolute_path))):
        message = schemas._closest_branch(err.context).message if err.context else err.message
        if "additional properties" not in message.lower():  # unknown keys are notes, not schema errors
            problems.append(Problem(".".join(str(p) for p in err.absolute_path), err.instance, message))
    if problems:
        raise ConfigError(problems, source=NAME)
    return [e for e in errors if e.validator == "additionalProperties" and e.absolute_path]


#: Bounds DeepSpeed's config models enforce in validators the generated schema cannot state: dotted key -> (lowest
#: allowed value, what DeepSpeed says). Checked whether or not the section is enabled, as DeepSpeedConfig does.
_VALIDATOR_BOUNDS = {
    "fp16.loss_scale": (0, "must be >= 0 (0 enables dynamic loss scaling); DeepSpeedConfig refuses it"),
}


def _check_validator_bounds(raw: Mapping[str, Any]) -> None:
    problems = []
    for key, (lowest, why) in _VALIDATOR_BOUNDS.items():
        section, leaf = key.split(".")
        value = raw.get(section, {}).get(leaf) if isinstance(raw.get(section), dict) else None
        if _number(value) and value < lowest:
            problems.append(Problem(key, value, why))
    if problems:
        raise ConfigError(problems, source=NAME)


#: Values DeepSpeedConfig accepts for a key whose core type cannot hold them, and what they mean to whoever runs the
#: file: (key, value) -> (fidelity, reason). Read before the map, kept out of the core model.
_VALUES_BEFORE_THE_MAP: dict[tuple[str, Any], tuple[Fidelity, str]] = {
    ("steps_per_print", float("inf")): (_IGNORED, "inf: never print (Accelerate's way to silence DeepSpeed's progress "
                                        "lines); logging only"),
    # DeepSpeedConfig stores the string as it is; Accelerate's DeepSpeedPlugin (also under the HF Trainer) replaces
    # it with inf. DeepSpeed's engine alone would compute (step + 1) % "auto" at its first step() and fail.
    ("steps_per_print", "auto"): (_DEFERRED, "\"auto\": Accelerate and the HF Trainer replace it with inf (never "
                                  "print); logging only. deepspeed.initialize alone accepts the file but fails at the "
                                  "first step() (it computes step % \"auto\"): give a number there"),
}


def _before_the_map(raw: dict) -> tuple[dict, list[Note]]:
    """Values read before the map: the legacy ``"zero_optimization": true|false``, and what Accelerate passes
    (``steps_per_print: inf``) or DeepSpeed accepts without effect (a negative ``flops_profiler.profile_step``)."""
    notes = []
    zero = raw.get("zero_optimization")
    if isinstance(zero, bool):
        notes.append(Note("zero_optimization", "sharding.stage", zero, Fidelity.EXACT,
                          f"legacy boolean form: {str(zero).lower()} means stage {int(zero)}"))  # fmt: skip
        raw["zero_optimization"] = {"stage": int(zero)}
    for (key, value), (fidelity, why) in _VALUES_BEFORE_THE_MAP.items():
        if key in raw and raw[key] == value and type(raw[key]) is type(value):
            notes.append(Note(key, None, raw.pop(key), fidelity, why))
    clip, every = raw.get("gradient_clipping"), raw.get("steps_per_print")
    if _number(clip) and clip < 0:
        notes.append(Note("gradient_clipping", "gradients.clip_max_norm", clip, Fidelity.EXACT, f"{clip}: no "
                          "clipping, as 0 (DeepSpeed clips only when the value is above 0)"))  # fmt: skip
        raw["gradient_clipping"] = 0.0
    if _number(every) and isinstance(every, int) and every < 0:
        notes.append(Note("steps_per_print", "monitoring.steps_per_print", every, Fidelity.EXACT, f"{every}: the "
                          f"same as {-every} (DeepSpeed prints when (step + 1) % {every} == 0)"))
        raw["steps_per_print"] = -every
    zero = raw.get("zero_optimization")
    for key in ("offload_param", "offload_optimizer"):
        if isinstance(zero, dict) and key in zero and zero[key] is None:
            notes.append(Note(f"zero_optimization.{key}", None, zero.pop(key), Fidelity.EXACT, "null: no offload, "
                              "DeepSpeed's default (its config model reads null as not set)"))  # fmt: skip
    profiler = raw.get("flops_profiler")
    step = profiler.get("profile_step") if isinstance(profiler, dict) else None
    if isinstance(step, int) and not isinstance(step, bool) and step < 0:
        why = f"profile_step {step} is never reached: DeepSpeed's FLOPs profiler never runs"
        for key in ("enabled", "profile_step"):
            if key in profiler:
                notes.append(Note(f"flops_profiler.{key}", None, profiler.pop(key), _IGNORED, why))
        if not profiler:
            del raw["flops_profiler"]
    return raw, notes


#: The JSON types DeepSpeed's pydantic sections coerce text (and 0/1) into, as pydantic's lax mode does, in the
#: order tried: "true"/"yes"/"on"/"1" for a boolean, "16" or "1e9"-free "1000000000.0" for an integer, "1e-3" for a
#: number. DeepSpeed reads them with that meaning; the keys it reads with plain dict.get keep the text as it is.
_LAX_TYPES = ("boolean", "integer", "number")


def _as_pydantic_reads(raw: Mapping[str, Any]) -> tuple[Mapping[str, Any], list[Note]]:
    """The values of DeepSpeed's pydantic sections (``rules.STRICT_SECTIONS``) given as text, coerced as its config
    models coerce them, each with a note; the input itself when there is none."""
    schema, notes, out = schemas.load(NAME), [], None
    for section in rules.STRICT_SECTIONS:
        value = raw.get(section)
        if isinstance(value, dict):
            coerced = _coerce_section(value, schema["properties"].get(section, {}), section, notes)
            if coerced is not value:
                out = out if out is not None else dict(raw)
                out[section] = coerced
    return (raw if out is None else out), notes


def _coerce_section(section: dict, schema: Mapping[str, Any], path: str, notes: list[Note]) -> dict:
    out = section
    for key, value in section.items():
        sub = schema.get("properties", {}).get(key) if isinstance(schema, Mapping) else None
        if sub is None:
            continue
        new = (_coerce_section(value, sub, f"{path}.{key}", notes) if isinstance(value, dict) else
               _coerced(value, sub, f"{path}.{key}", notes))  # fmt: skip
        if new is not value:
            out = out if out is not section else dict(section)
            out[key] = new
    return out


def _coerced(value: Any, schema: Mapping[str, Any], path: str, notes: list[Note]) -> Any:
    """``value`` as pydantic's lax mode reads it for the field ``schema`` describes (itself when nothing applies)."""
    if not isinstance(value, (str, int)) or isinstance(value, bool) or value == "auto" or schemas.conforms(value,
                                                                                                          schema):
        return value
    branches = _branches(schema)
    from pydantic import TypeAdapter, ValidationError

    for kind, python in zip(_LAX_TYPES, (bool, int, float), strict=True):
        wanted = [b for b in branches if kind in _types(b) or kind == "integer" and "enum" in b]
        if not wanted or (kind == "boolean" and not isinstance(value, (str, int))):
            continue
        try:
            read = TypeAdapter(python).validate_python(value)
        except ValidationError:
            continue
        if any(schemas.conforms(read, b) for b in wanted):
            notes.append(Note(path, None, value, Fidelity.EXACT, f"{value!r} is read as {json_text(read)}, as "
                              "DeepSpeed's config model (pydantic) reads it"))  # fmt: skip
            return read
    return value


def _branches(schema: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The alternatives of a field's schema, nested anyOf flattened."""
    if "anyOf" not in schema:
        return [schema]
    return [leaf for branch in schema["anyOf"] for leaf in _branches(branch)]


def _types(schema: Mapping[str, Any]) -> tuple[str, ...]:
    kind = schema.get("type", ())
    return (kind,) if isinstance(kind, str) else tuple(kind)


def json_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class _Unknown:
    """Keys DeepSpeed does not know: DROPPED notes, or problems where its strict sections refuse the config."""

    def __init__(self) -> None:
        self.notes: list[Note] = []
        self.refused: list[Problem] = []

    def add(self, path: str, value: Any, why: str, key: str, known: list[str]) -> None:
        top, suggestion = path.split(".", 1)[0], did_you_mean(key, known)
        if "." in path and top in rules.STRICT_SECTIONS:
            self.refused.append(Problem(path, value, f"unknown key: DeepSpeed 0.19.8 refuses the whole config for it "
                                        f"(its {top} section forbids extra keys); fix its spelling or remove it",
                                        suggestion))  # fmt: skip
        else:
            hint = f"; did you mean '{suggestion}'?" if suggestion else ""
            self.notes.append(Note(path, None, value, _DROPPED, f"unknown key: {why}; dropped{hint}"))


def _prune_whole_sections(data: dict, errors: list[Any], fmap: FieldMap, unknown: _Unknown) -> None:
    """Sections kept whole (no core meaning: ``autotuning``, ``compile``, ...) are still checked against DeepSpeed's
    schema: a key DeepSpeed does not know inside one becomes a DROPPED note with a did-you-mean, and is not kept
    (DeepSpeed's strict section models would refuse it)."""
    for err in errors:
        path = [str(p) for p in err.absolute_path]
        if isinstance(_rule_above(path, fmap), (To, type(None))):
            continue
        known, node = list(err.schema.get("properties", {})), data
        for part in path:
            node = node[part]
        for key in [k for k in err.instance if k not in known]:
            del node[key]
            unknown.add(".".join([*path, key]), err.instance[key], "DeepSpeed 0.19.8 would refuse it in this section",
                        key, known)  # fmt: skip


def _rule_above(path: list[str], fmap: FieldMap) -> Any:
    """The map rule of the nearest enclosing key of ``path`` that has one (None when none has)."""
    return next((rule for end in range(1, len(path) + 1) if (rule := fmap.lookup(".".join(path[:end])))), None)


def _split(raw: Mapping[str, Any], fmap: FieldMap, unknown: _Unknown, actual: str = "", canonical: str = "") -> dict:
    """The keys the map reads; each key nobody reads becomes a DROPPED note with a did-you-mean, never silence."""
    known: dict[str, Any] = {}
    for key, value in raw.items():
        path, canon = f"{actual}.{key}" if actual else key, f"{canonical}.{key}" if canonical else key
        canon = fmap.aliases[canon].current if canon in fmap.aliases else canon
        if fmap.lookup(canon) is not None:
            known[key] = value
        elif isinstance(value, Mapping) and fmap.has_children(canon):
            if not value:
                unknown.notes.append(Note(path, None, {}, _IGNORED, "empty section: DeepSpeed's defaults apply"))
            else:
                known[key] = _split(value, fmap, unknown, path, canon)
        else:
            unknown.add(path, value, "DeepSpeed 0.19.8 does not read it (in its strict sections it is a validation "
                        "error)" if actual else "DeepSpeed 0.19.8 ignores unknown top-level keys, so it has no effect "
                        "there", key, fmap.children(canonical))  # fmt: skip
    return known


#: Where the finding for a config with no batch size is reported (what the HF Trainer, Accelerate and Lightning fill).
NO_BATCH_KEY = "train_micro_batch_size_per_gpu"
#: DeepSpeed's assertion for it (``DeepSpeedConfig._configure_train_batch_size``).
NO_BATCH_MESSAGE = "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"


def _unstated_batch(cfg: TorshConfig) -> list[Note]:
    """Neither train_batch_size nor train_micro_batch_size_per_gpu (given or "auto"): DeepSpeed refuses the config
    unless its caller writes a batch in first. The HF Trainer and Accelerate fill only keys written "auto"."""
    if cfg.batch.global_batch_size is not None or cfg.batch.micro_batch_size is not None:
        return []
    return [Note(NO_BATCH_KEY, "batch.micro_batch_size", None, _DEFERRED, f"no batch size: DeepSpeed refuses the "
                 f"config as written (\"{NO_BATCH_MESSAGE}\"), as torsh.initialize does, unless the code calling "
                 "initialize writes one in first (DeepSpeed's autotuner, Lightning's DeepSpeedStrategy); the HF "
                 "Trainer and Accelerate fill only a batch size written \"auto\": give a number or \"auto\"",
                 refused=True)]  # fmt: skip


def _deferred_if_auto(note: Note) -> Note:
    """A note for an ``"auto"`` value kept in extensions becomes DEFERRED, saying who resolves it."""
    if (note.fidelity in (_IGNORED, Fidelity.EXACT, Fidelity.UNSUPPORTED) and note.value == "auto"
            and not note.source_path.endswith(_DEEPSPEED_OWN_AUTO)):  # fmt: skip
        leaf = note.source_path.rsplit(".", 1)[-1].removeprefix("stage3_")
        why = rules.AUTO_IN_EXTENSIONS.get(leaf, "filled by HF Trainer/Accelerate; DeepSpeed alone uses its default")
        return Note(note.source_path, note.target_path, note.value, _DEFERRED, why)
    return note


DIALECT = DeepSpeed()
globals().update(DIALECT.exports())
#: Every key the reader knows, with its rule: the map's own and each group's (a Group).
FIELD_MAP = dict(DIALECT.field_map.rules)
