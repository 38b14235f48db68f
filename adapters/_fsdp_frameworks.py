"""FSDP settings as trainer frameworks spell them, read by the ``fsdp`` dialect (read only; it writes FSDP1/FSDP2).

* ``hf_trainer``: Hugging Face ``TrainingArguments`` - ``fsdp: "full_shard auto_wrap offload"``,
  ``fsdp_config``, the legacy ``fsdp_transformer_layer_cls_to_wrap`` / ``fsdp_min_num_params``, ``fp16``/``bf16``,
  ``gradient_checkpointing``;
* ``torchtune``: the distributed / memory / precision keys of a torchtune recipe YAML;
* ``torchtitan``: a torchtitan job config (``[parallelism]``, ``[training]``, ``[activation_checkpoint]``, ...).

Only the keys that bear on distributed training are known; any other key is an error with a suggestion, as usual.
"""

from __future__ import annotations

from typing import Any

from torsh.concepts import sharding
from torsh.concepts.precision import GRAD_SCALER, GRAD_SCALER_RULES
from torsh.config import AUTO, get_path
from torsh.translate import NOTHING, Fidelity, FieldMap, Hook, Ignored, ReadContext, To, Unsupported

from ._sniff import Shape
from ._torch_names import NO_SHARD_REASON, dtype, to_bool

#: The Trainer's ``fsdp`` options: a strategy (``torsh.concepts.sharding.TRAINER_OPTIONS``) or one of these.
_TRAINER_SWITCHES = ("offload", "auto_wrap")
_NOT_DISTRIBUTED = "not a distributed-training setting"


def _state(ctx: Any) -> dict[str, Any]:
    return ctx.__dict__.setdefault("_frameworks", {})


# ---- Hugging Face TrainingArguments ------------------------------------------------------------------------------


def _trainer_options(value: Any) -> list[str] | None:
    """The Trainer's fsdp options (a space-separated string or a list); None when they are not all known."""
    options = value.split() if isinstance(value, str) else list(value) if isinstance(value, list) else None
    known = {*sharding.TRAINER_OPTIONS, *_TRAINER_SWITCHES}
    return options if options is not None and all(isinstance(o, str) and o in known for o in options) else None


def _trainer_fsdp(value: Any, ctx: ReadContext, path: str) -> None:
    options = _trainer_options(value)
    if options is None:
        ctx.problem(path, value, f"expected options among {', '.join([*sharding.TRAINER_OPTIONS, *_TRAINER_SWITCHES])}")
        return
    strategy = next((o for o in options if o in sharding.TRAINER_OPTIONS), "full_shard")
    stage, hybrid = sharding.FSDP1_LAYOUTS[sharding.TRAINER_OPTIONS[strategy]]
    ctx.set("sharding.stage", stage, path, Fidelity.APPROXIMATE if stage == 0 else Fidelity.EXACT,
            NO_SHARD_REASON if stage == 0 else f"{strategy}: ZeRO-{stage}")  # fmt: skip
    if hybrid:
        ctx.set("sharding.hybrid_shard_size", AUTO, path, Fidelity.DEFERRED, "shards within each node")
    if "offload" in options:
        ctx.set("offload.params", "cpu", path, Fidelity.EXACT, "parameters and gradients on the CPU", note=False)
        ctx.set("offload.optimizer", "cpu", path, Fidelity.EXACT, "the optimizer step runs on the CPU", note=False)
    _state(ctx)["auto_wrap"] = "auto_wrap" in options


def _trainer_classes(value: Any, ctx: ReadContext, path: str) -> None:
    classes = [c.strip() for c in value.split(",")] if isinstance(value, str) else value
    ctx.set("sharding.wrap.module_classes", classes, path, Fidelity.EXACT, "with the auto_wrap option")


def _trainer_precision(dtype_name: str):
    def hook(value: Any, ctx: ReadContext, path: str) -> None:
        if not to_bool(value, ctx, path):
            ctx.note(path, Fidelity.EXACT, "off", value)
            return
        # The Trainer hands FSDP to Accelerate: MixedPrecision with every dtype the same, GradScaler for fp16.
        for core_path, item in (("precision.param_dtype", dtype_name), ("precision.reduce_dtype", dtype_name),
                                ("precision.buffer_dtype", dtype_name), ("precision.cast_forward_inputs", True)):
            ctx.set(core_path, item, path, note=core_path == "precision.param_dtype")
        if dtype_name == "fp16":
            for key in GRAD_SCALER_RULES:
                ctx.set(f"precision.loss_scaling.{key}", GRAD_SCALER[key], path, note=False)

    return hook


HF_TRAINER_MAP = {
    "fsdp": Hook(read=_trainer_fsdp),
    "fsdp_transformer_layer_cls_to_wrap": Hook(read=_trainer_classes),
    "fsdp_min_num_params": To("sharding.wrap.min_num_params"),
    "fsdp_config.transformer_layer_cls_to_wrap": Hook(read=_trainer_classes),
    "fsdp_config.min_num_params": To("sharding.wrap.min_num_params", write=False),
    "fsdp_config.backward_prefetch": Hook(read=lambda v, c, p: c.set(
        "sharding.backward_prefetch", {"no_prefetch": "none"}.get(str(v).lower(), str(v).lower()), p)),
    "fsdp_config.forward_prefetch": To("sharding.forward_prefetch"),
    "fsdp_config.sync_module_states": To("sharding.sync_module_states"),
    "fsdp_config.activation_checkpointing": To("activation_checkpointing.enabled"),
    "fsdp_config.limit_all_gathers": Ignored("a rate limiter of FSDP1's all-gathers: memory, not results"),
    "fsdp_config.use_orig_params": Ignored("exposes the original parameters; FSDP2 always does"),
    "fsdp_config.cpu_ram_efficient_loading": Ignored("rank 0 loads the weights: how the script loads the model"),
    "fp16": Hook(read=_trainer_precision("fp16")),
    "bf16": Hook(read=_trainer_precision("bf16")),
    "gradient_checkpointing": To("activation_checkpointing.enabled", write=False),
    "per_device_train_batch_size": To("batch.micro_batch_size"),
    "gradient_accumulation_steps": To("batch.gradient_accumulation_steps"),
    "max_grad_norm": To("gradients.clip_max_norm"),
}


def _trainer_finalize(ctx: ReadContext) -> None:
    wrap = get_path(ctx.core, "sharding.wrap", {}) or {}
    if _state(ctx).get("auto_wrap") and not wrap:
        ctx.note("fsdp", Fidelity.APPROXIMATE, "auto_wrap with no class names wraps the model's _no_split_modules "
                 "(known only with the model); torsh wraps each direct child", "auto_wrap")  # fmt: skip


# ---- torchtune recipes --------------------------------------------------------------------------------------------


def _torchtune_dtype(value: Any, ctx: ReadContext, path: str) -> None:
    core = dtype(value, ctx, path)
    if core is None:
        return
    ctx.set("precision.param_dtype", core, path, Fidelity.EXACT, "torchtune trains in this dtype throughout: "
            "parameters, gradients and optimizer state")  # fmt: skip
    ctx.set("precision.master_dtype", core, path, note=False)
    ctx.set("precision.optimizer_state_dtype", core, path, note=False)


def _torchtune_offload(value: Any, ctx: ReadContext, path: str) -> None:
    flag = to_bool(value, ctx, path)
    if flag:
        ctx.set("offload.params", "cpu", path, Fidelity.EXACT, "CPUOffloadPolicy: parameters, gradients, optimizer")
        ctx.set("offload.optimizer", "cpu", path, note=False)
    elif flag is False:
        ctx.note(path, Fidelity.EXACT, "no offload", value, "offload")


def _torchtune_finalize(ctx: ReadContext) -> None:
    if get_path(ctx.core, "sharding.stage", NOTHING) is NOTHING:
        ctx.set("sharding.stage", 3, "fsdp_reshard_after_forward", Fidelity.DEFAULTED, "torchtune's distributed "
                "recipes apply fully_shard with reshard_after_forward=True by default")  # fmt: skip


TORCHTUNE_MAP = {
    "fsdp_cpu_offload": Hook(read=_torchtune_offload),
    "fsdp_reshard_after_forward": Hook(read=lambda v, c, p: c.set(
        "sharding.stage", 3 if to_bool(v, c, p) else 2, p, Fidelity.EXACT, "fully_shard(reshard_after_forward=...)")),
    "enable_activation_checkpointing": To("activation_checkpointing.enabled"),
    "enable_activation_offloading": To("activation_checkpointing.cpu_offload"),
    "custom_sharded_layers": Ignored("module names sharded on their own besides the layers; torsh shards each direct "
                                     "child, these included"),
    "dtype": Hook(read=_torchtune_dtype),
    "compile": Unsupported("torch.compile; torsh does not compile the model"),
    "device": Ignored("the device comes from the launcher"),
    "batch_size": To("batch.micro_batch_size"),
    "gradient_accumulation_steps": To("batch.gradient_accumulation_steps"),
}


# ---- torchtitan job configs ---------------------------------------------------------------------------------------


def _titan_degree(value: Any, ctx: ReadContext, path: str) -> None:
    name = path.rsplit(".", 1)[-1]
    if name in ("data_parallel_replicate_degree", "data_parallel_shard_degree"):
        _state(ctx)[name] = value
        ctx.note(path, Fidelity.EXACT, "data-parallel mesh size (-1: the remaining ranks)", value)
    elif value in (1, -1):
        ctx.note(path, Fidelity.EXACT, "1: no such parallelism", value)
    else:
        ctx.keep(path, value)
        ctx.note(path, Fidelity.UNSUPPORTED, "tensor / pipeline / context parallelism; torsh runs data parallel jobs",
                 value)  # fmt: skip


def _titan_reshard(value: Any, ctx: ReadContext, path: str) -> None:
    if not isinstance(value, str) or value not in sharding.TORCHTITAN_RESHARD:
        ctx.problem(path, value, "expected default, always or never")
    elif sharding.TORCHTITAN_RESHARD[value] is False:
        ctx.set("sharding.stage", 2, path, Fidelity.EXACT, "never: ZeRO-2")
    else:
        ctx.set("sharding.stage", 3, path, Fidelity.EXACT, "ZeRO-3 (default: not resharded under pipelining)")


TORCHTITAN_MAP = {
    "parallelism.*": Hook(read=_titan_degree),
    "parallelism.fsdp_reshard_after_forward": Hook(read=_titan_reshard),
    "activation_checkpoint.mode": Hook(read=lambda v, c, p: c.set(
        "activation_checkpointing.enabled", v != "none", p, Fidelity.EXACT if v in ("none", "full") else
        Fidelity.APPROXIMATE, "" if v in ("none", "full") else "selective: torsh checkpoints whole blocks")),
    "activation_checkpoint.*": Ignored("how activation checkpointing selects operators"),
    "float8.*": Unsupported("float8 training; torsh computes in bf16/fp16"),
    "training.local_batch_size": To("batch.micro_batch_size"),
    "training.global_batch_size": To("batch.global_batch_size"),
    "training.max_norm": To("gradients.clip_max_norm"),
    "training.mixed_precision_param": Hook(read=lambda v, c, p: c.set("precision.param_dtype", dtype(v, c, p), p)),
    "training.mixed_precision_reduce": Hook(read=lambda v, c, p: c.set("precision.reduce_dtype", dtype(v, c, p), p)),
    "training.seq_len": Ignored(_NOT_DISTRIBUTED),
    "training.steps": Ignored(_NOT_DISTRIBUTED),
    "training.dataset": Ignored(_NOT_DISTRIBUTED),
}


def _titan_finalize(ctx: ReadContext) -> None:
    state = _state(ctx)
    replicate, shard = state.get("data_parallel_replicate_degree", 1), state.get("data_parallel_shard_degree", -1)
    if get_path(ctx.core, "sharding.stage", NOTHING) is NOTHING:
        ctx.set("sharding.stage", 3 if shard != 1 else 0, "parallelism.data_parallel_shard_degree", Fidelity.DEFAULTED,
                "torchtitan applies fully_shard over the data-parallel shard dimension")  # fmt: skip
    if sharding.hybrid_degrees(replicate, shard) == "hybrid":
        ctx.set("sharding.hybrid_shard_size", shard, "parallelism.data_parallel_shard_degree", Fidelity.EXACT, "HSDP")


#: layout -> (its map, its finalizer, the keys that identify it)
LAYOUTS = {
    "hf_trainer": (HF_TRAINER_MAP, _trainer_finalize),
    "torchtune": (TORCHTUNE_MAP, _torchtune_finalize),
    "torchtitan": (TORCHTITAN_MAP, _titan_finalize),
}


#: Each framework's file, by the keys that identify it among the ones its map knows: above the native seed layout
#: (0.9), which also has a [training] section, below torchtune's and torchtitan's own dialects (0.97).
SHAPES = {
    "hf_trainer": Shape(0.95, ({"fsdp"},), HF_TRAINER_MAP, where=lambda raw: isinstance(raw["fsdp"], (str, list))),
    "torchtitan": Shape(0.95, ({"parallelism"},), TORCHTITAN_MAP, tables={"parallelism"}),
    "torchtune": Shape(0.95, ({"fsdp_cpu_offload", "custom_sharded_layers", "enable_activation_checkpointing"},),
                       TORCHTUNE_MAP),
}


def layout(raw: dict) -> str | None:
    """The framework whose vocabulary ``raw`` uses, or None."""
    if isinstance(raw.get("fsdp"), (str, list)):
        return "hf_trainer"
    if isinstance(raw.get("parallelism"), dict):
        return "torchtitan"
    if {"fsdp_cpu_offload", "custom_sharded_layers", "enable_activation_checkpointing"} & set(raw):
        return "torchtune"
    return None


def field_map(name: str) -> FieldMap:
    """The compiled map of one framework layout."""
    return FieldMap(LAYOUTS[name][0])
