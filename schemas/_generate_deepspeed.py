"""Regenerate ``deepspeed.schema.json`` from DeepSpeed's own config field types, allowed values and bounds.

A maintenance tool for a DeepSpeed version bump; it needs the pinned DeepSpeed installed:
``DS_ACCELERATOR=cpu python -m torsh.schemas._generate_deepspeed [OUT]`` (default: next to this file).
Field names, types, enum values and numeric bounds (``Field(ge/gt/le/lt)``) are taken from DeepSpeed's
pydantic sections; the sections DeepSpeed reads with plain ``dict.get`` are described by hand below, bounded
only where DeepSpeed fails on the value (RUNTIME_BOUNDS); tests/test_key_tables.py holds every bound to
DeepSpeedConfig. ``"auto"`` (the Hugging Face convention) is allowed on scalars, and unknown top-level keys are
allowed because DeepSpeed ignores them (the adapter reports them); DeepSpeed's strict sections forbid unknown keys.
"""

from __future__ import annotations

import enum
import json
import os
import sys
import typing
from pathlib import Path
from typing import Any

AUTO = {"const": "auto"}
NUMBER = {"anyOf": [{"type": "number"}, AUTO]}
POSITIVE_INT = {"anyOf": [{"type": "integer", "minimum": 1}, AUTO]}
BATCH = {"anyOf": [*POSITIVE_INT["anyOf"], {"type": "null"}]}
INTEGER = {"anyOf": [{"type": "integer"}, AUTO]}
BOOLEAN = {"anyOf": [{"type": "boolean"}, AUTO]}
#: A top-level switch DeepSpeed reads with dict.get and only tests for truth: 0 and 1 mean what they say there
#: (DeepSpeed's own tests write ``"zero_allow_untested_optimizer": 1``); other numbers and text stay refused.
SWITCH = {"anyOf": [{"type": "boolean"}, {"enum": [0, 1]}, AUTO]}
OBJECT = {"type": "object"}
#: A number DeepSpeedConfig accepts whatever its sign, but the engine divides by (steps_per_print: ``global_steps %
#: steps_per_print`` at every step; gradient_predivide_factor: ``1 / factor``): only 0 is refused.
NONZERO = {"anyOf": [{"type": "number", "exclusiveMinimum": 0}, {"type": "number", "exclusiveMaximum": 0}, AUTO]}
#: Bounds kept although DeepSpeedConfig itself accepts the value, because DeepSpeed's engine then fails; each says
#: why. Every other bound in the schema is one DeepSpeedConfig enforces (a test checks both).
RUNTIME_BOUNDS = {
    "steps_per_print": "the engine computes global_steps % steps_per_print at every step (ZeroDivisionError)",
    "gradient_predivide_factor": "the engine divides the gradients by it (ZeroDivisionError)",
}
#: Bounds of DeepSpeed's the schema deliberately leaves wider, each with the reason.
LENIENT_BOUNDS = {
    "zero_optimization.reduce_bucket_size": "0 is found in real files; the reader reports it and drops it",
}
DTYPE = {"anyOf": [{"enum": ["fp16", "bf16", "fp32", "float16", "bfloat16", "float32", "half", "float", "FP16",
                             "BF16", "FP32", "torch.float16", "torch.bfloat16", "torch.float32"]},
                   AUTO, {"type": "null"}]}  # fmt: skip


def field_schema(annotation: Any) -> dict:
    """The JSON Schema of one pydantic field annotation of a DeepSpeed config section."""
    from pydantic import BaseModel

    origin = typing.get_origin(annotation)
    if origin is typing.Union:
        args = typing.get_args(annotation)
        members = [field_schema(a) for a in args if a is not type(None)]
        inner = members[0] if len(members) == 1 else {"anyOf": members}
        return {"anyOf": [inner, {"type": "null"}]} if type(None) in args else inner
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(annotation))}
    if origin in (list, typing.List):  # noqa: UP006 - DeepSpeed annotates with typing.List
        return {"type": "array"}
    if origin in (dict, typing.Dict):  # noqa: UP006
        return {"type": "object"}
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return {"enum": [m.value[0] if isinstance(m.value, tuple) else m.value for m in annotation]}
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return model_schema(annotation)
    # int: "integer", which JSON Schema also grants 5e8-style floats with no fraction (as pydantic does); a fractional
    # value (min_loss_scale 1e-10) is refused, as DeepSpeed refuses it
    simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
    if annotation in simple:
        return {"type": simple[annotation]}
    return {"type": "string"} if str(annotation).endswith("Path'>") else {}


def _with_auto(schema: dict) -> dict:
    if schema.get("type") == "object" and "properties" in schema:
        return schema
    return {"anyOf": [schema, AUTO]} if schema else {}


#: pydantic's numeric constraints (annotated_types metadata) and the JSON Schema keyword each one becomes.
BOUND_KEYWORDS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "lt": "exclusiveMaximum"}


def _bounded(schema: dict, metadata: list) -> dict:
    """DeepSpeed's own bounds (``Field(ge=..., gt=..., le=..., lt=...)``) on a numeric field, so the schema refuses
    what DeepSpeedConfig refuses (zero_hpz_partition_size -5, offload_optimizer.ratio 1.5) and nothing more. In an
    optional field the bound goes on the numeric branch (null stays allowed)."""
    bounds = {BOUND_KEYWORDS[attr]: getattr(item, attr) for item in metadata for attr in BOUND_KEYWORDS
              if getattr(item, attr, None) is not None}  # fmt: skip
    if not bounds:
        return schema
    if schema.get("type") in ("integer", "number"):
        return {**schema, **bounds}
    if "anyOf" in schema:
        return {**schema, "anyOf": [_bounded(branch, metadata) for branch in schema["anyOf"]]}
    return schema


def model_schema(model: Any) -> dict:
    """A strict object schema for a DeepSpeed pydantic section (field names and aliases both accepted)."""
    properties = {}
    for name, field in model.model_fields.items():
        properties[name] = _with_auto(_bounded(field_schema(field.annotation), field.metadata))
        if field.alias:
            properties[field.alias] = properties[name]
    return {"type": "object", "properties": properties, "additionalProperties": False}


def _removed(instead: str) -> dict:
    return {"description": f"Removed in DeepSpeed 0.19.8 (DeepSpeedConfig raises): {instead}"}


def zero_schema() -> dict:
    """``zero_optimization``: DeepSpeed's strict section, plus the legacy boolean form and removed keys."""
    from deepspeed.runtime.zenflow.zenflow_config import ZenFlowConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    zero = model_schema(DeepSpeedZeroConfig)
    props = zero["properties"]
    props["offload_param"] = {**model_schema(DeepSpeedZeroOffloadParamConfig), "type": ["object", "null"]}
    props["offload_optimizer"] = {**model_schema(DeepSpeedZeroOffloadOptimizerConfig), "type": ["object", "null"]}
    zero["type"] = ["object", "boolean"]
    zero["description"] = "ZeRO settings; the legacy form true/false means stage 1/0."
    props["stage"] = {"anyOf": [{"enum": [0, 1, 2, 3]}, AUTO]}
    props["reduce_bucket_size"] = {"anyOf": [{"type": "number", "minimum": 0}, AUTO], "description": (
        "Elements per reduction bucket; DeepSpeed 0.19.8 requires > 0 (0 is reported and dropped).")}
    props["zenflow"] = {**model_schema(ZenFlowConfig), "type": ["object", "null"]}
    # DeepSpeed turns a lone string into a one-element list and null into the defaults
    names = {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "string"}]}
    props["leaf_module"] = {"type": ["object", "null"], "additionalProperties": False,
                            "properties": {"classes": names, "names": names, "name_suffixes": names}}
    for key in ("mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param"):
        props[key] = {"description": "Removed in DeepSpeed 0.19.8 (DeepSpeedConfig raises)."}
    return zero


def top_level() -> dict:
    """Every top-level key DeepSpeed 0.19.8 reads (or rejects as removed)."""
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.inference.config import WeightQuantConfig
    from deepspeed.runtime.config import HybridEngineConfig
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config

    bf16 = model_schema(DeepSpeedBF16Config)
    nullable = {"type": ["string", "null"]}
    return {
        # null is DeepSpeed's "not set" for the batch keys: it derives the value from the other two
        "train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": BATCH,
        "managed_gradient_accumulation": SWITCH,
        "steps_per_print": {"anyOf": [*NONZERO["anyOf"], {"type": "null"}]},
        "dump_state": SWITCH, "disable_python_gc": SWITCH, "disable_allgather": SWITCH,
        "communication_data_type": DTYPE, "seq_parallel_communication_data_type": DTYPE,
        "prescale_gradients": SWITCH,
        "gradient_predivide_factor": NONZERO,
        "gradient_allreduce_op": {"anyOf": [{"enum": ["mean", "sum", "MEAN", "SUM"]}, AUTO]},
        "gradient_clipping": NUMBER,  # DeepSpeed clips only when > 0: 0 and -1 both mean "no clipping"
        "zero_allow_untested_optimizer": SWITCH, "zero_force_ds_cpu_optimizer": SWITCH,
        "wall_clock_breakdown": SWITCH, "memory_breakdown": SWITCH, "dataloader_drop_last": SWITCH,
        "log_level": nullable, "vocabulary_size": {"type": ["integer", "null"]},
        "use_data_before_expert_parallelism": SWITCH, "sequence_parallel_size": {"type": "integer"},
        "data_parallel_size": {"type": "integer"}, "weight_quantization": model_schema(WeightQuantConfig),
        "expert_parallel": OBJECT,
        "fp16": model_schema(DeepSpeedFP16Config), "bf16": bf16, "bfloat16": bf16,
        "torch_autocast": {"type": "object", "properties": {
            "enabled": BOOLEAN, "dtype": DTYPE,
            "lower_precision_safe_modules": {"type": "array", "items": {"type": "string"}}},
            "additionalProperties": True},
        "data_types": {"type": "object", "properties": {
            "grad_accum_dtype": DTYPE, "param_dtype": DTYPE, "buffer_dtype": DTYPE,
            "keep_in_fp32_modules": {"anyOf": [AUTO, {"type": "array", "items": {"type": "string"}}]}},
            "additionalProperties": True},
        "zero_optimization": zero_schema(),
        "allgather_size": NUMBER,
        "optimizer": {"type": "object", "properties": {"type": {"type": "string"}, "params": OBJECT,
                                                       "legacy_fusion": BOOLEAN},
                      "required": ["type"], "additionalProperties": True},
        "scheduler": {"type": "object", "properties": {"type": {"type": "string"}, "params": OBJECT},
                      "required": ["type"], "additionalProperties": True},
        "activation_checkpointing": {"type": "object", "properties": {
            **{k: BOOLEAN for k in ("partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
                                    "synchronize_checkpoint_boundary", "profile")},
            "number_checkpoints": {"type": ["integer", "null"]}}, "additionalProperties": True},
        "tensorboard": model_schema(TensorBoardConfig), "wandb": model_schema(WandbConfig),
        "csv_monitor": model_schema(CSVConfig), "comet": model_schema(CometConfig),
        "comms_logger": model_schema(CommsLoggerConfig),
        "flops_profiler": {"type": "object", "properties": {
            # read with dict.get and never checked: profile_step -1 (never profile) is accepted, as is any int
            "enabled": BOOLEAN, "recompute_fwd_factor": NUMBER, "profile_step": INTEGER,
            "module_depth": {"type": "integer"}, "top_modules": INTEGER, "detailed": BOOLEAN,
            "output_file": nullable}, "additionalProperties": True},
        "checkpoint": {"type": "object", "properties": {
            "tag_validation": {"type": "string", "pattern": "^(?i:warn|ignore|fail)$"}, "load_universal": BOOLEAN,
            "use_node_local_storage": BOOLEAN, "parallel_write": OBJECT, "checkpoint_serialization": BOOLEAN,
            "writer": {"type": ["object", "null"]}}, "additionalProperties": True},
        "datastates_ckpt": OBJECT, "timers": OBJECT, "autotuning": OBJECT, "data_efficiency": OBJECT,
        "hybrid_engine": model_schema(HybridEngineConfig), "compile": model_schema(CompileConfig),
        "tensor_parallel": model_schema(TPTrainingConfig),
        "pipeline": OBJECT,
        "aio": {"type": "object", "properties": {
            "block_size": NUMBER, "queue_depth": NUMBER, "intra_op_parallelism": NUMBER,
            "single_submit": BOOLEAN, "overlap_events": BOOLEAN, "use_gds": BOOLEAN}, "additionalProperties": True},
        "amp": _removed("use bf16, fp16 or torch_autocast"), "elasticity": _removed("set the batch keys directly"),
        "compression_training": _removed("the compression library is gone"),
        "quantize_training": _removed("MoQ is gone"), "eigenvalue": _removed("MoQ is gone"),
        "sparse_gradients": _removed("sparse embeddings need no flag"),
        "sparse_attention": _removed("use scaled_dot_product_attention"), "nebula": _removed("use checkpoint"),
        "graph_harvesting": _removed("no replacement"), "curriculum_learning": _removed("use data_efficiency"),
        "progressive_layer_drop": _removed("no replacement"),
    }  # fmt: skip


def build() -> dict:
    """The whole schema."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "deepspeed.schema.json",
        "title": "DeepSpeed 0.19.8 config",
        "description": "The DeepSpeed 0.19.8 config surface (types and allowed values). Unknown top-level keys are "
        "allowed, as DeepSpeed ignores them (the torsh adapter reports them); sections that DeepSpeed validates "
        "strictly forbid unknown keys. \"auto\" (the Hugging Face convention) is accepted on scalar values.",
        "type": "object",
        "properties": top_level(),
        "additionalProperties": True,
    }


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("deepspeed.schema.json")
    out.write_text(json.dumps(build(), indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")
