"""Writing the core model as DeepSpeed JSON: one hook per concept that spans several DeepSpeed keys.

The derived reverse of ``FIELD_MAP`` writes the one-to-one keys; these hooks write precision (fp16/bf16,
loss scaling, data types), offload and hierarchical partitioning, the optimizer and scheduler, and clipping
(written out as 0.0 when off, since an absent key means 1.0 in DeepSpeed 0.19.8).
"""

from __future__ import annotations

import math

from torsh.config import DEEPSPEED_SCHEDULERS, TorshConfig
from torsh.deferred import AUTO, Deferred
from torsh.translate import Fidelity, Hook, WriteContext

EXACT, APPROXIMATE, DEFAULTED = Fidelity.EXACT, Fidelity.APPROXIMATE, Fidelity.DEFAULTED
IGNORED, UNSUPPORTED = Fidelity.IGNORED, Fidelity.UNSUPPORTED


def _write_precision(cfg: TorshConfig, ctx: WriteContext) -> None:
    p, stage = cfg.precision, cfg.sharding.stage
    param = p.param_dtype
    ext = cfg.extensions.get("deepspeed", {})
    if isinstance(param, Deferred):
        if not {"fp16.enabled", "bf16.enabled", "bfloat16.enabled"} & set(ext):  # else the kept flags say which
            for key in ("fp16.enabled", "bf16.enabled"):
                ctx.put(key, AUTO, "precision.param_dtype")
    elif p.autocast:
        ctx.put("torch_autocast.enabled", True, "precision.autocast")
        ctx.put("torch_autocast.dtype", {"bf16": "bfloat16", "fp16": "float16"}[param], "precision.param_dtype")
        _note_autocast_loss_scaling(cfg, ctx)
    elif param in ("fp16", "bf16"):
        ctx.put(f"{param}.enabled", True, "precision.param_dtype", EXACT,
                "DeepSpeed casts the parameters to it and keeps fp32 master weights")
    fp16_section = param == "fp16" and not p.autocast or isinstance(param, Deferred) and p.loss_scaling.mode != "none"
    if fp16_section:
        _write_loss_scaling(cfg, ctx)
        if p.cast_forward_inputs:
            ctx.put("fp16.auto_cast", True, "precision.cast_forward_inputs")
    elif p.cast_forward_inputs:
        ctx.note("precision.cast_forward_inputs", UNSUPPORTED, "DeepSpeed casts inputs only in fp16 (auto_cast)", True)
    mixed = param in ("fp16", "bf16") and not p.autocast
    if p.master_dtype != "fp32":
        if mixed and p.master_dtype == param and stage >= 1:
            ctx.put(f"{param}.{param}_master_weights_and_grads", True, "precision.master_dtype")
        else:
            ctx.note("precision.master_dtype", UNSUPPORTED, "DeepSpeed keeps low-precision master weights only with "
                     "fp16/bf16 of the same dtype under ZeRO 1-3", p.master_dtype)  # fmt: skip
    if p.optimizer_state_dtype != "fp32":
        if param == "bf16" and p.optimizer_state_dtype == "bf16" and p.master_dtype == "bf16" and stage >= 1:
            ctx.put("bf16.bf16_optimizer_states", True, "precision.optimizer_state_dtype")
        else:
            ctx.note("precision.optimizer_state_dtype", UNSUPPORTED, "DeepSpeed keeps bf16 optimizer state only "
                     "with bf16 master weights under ZeRO 1-3", p.optimizer_state_dtype)  # fmt: skip
    if isinstance(param, Deferred):
        follows = None
    else:
        follows = param if mixed else "fp32"
    if p.grad_accum_dtype is not None and (follows is None or p.grad_accum_dtype != follows):
        ctx.put("data_types.grad_accum_dtype", p.grad_accum_dtype, "precision.grad_accum_dtype")
    reduce = p.reduce_dtype or (param if not isinstance(param, Deferred) else None)
    if reduce is not None and reduce != follows:
        ctx.put("communication_data_type", reduce, "precision.reduce_dtype")
    if p.buffer_dtype is not None:
        ctx.put("data_types.buffer_dtype", p.buffer_dtype, "precision.buffer_dtype")
    _write_compression(cfg, ctx, written_reduce=reduce is not None and reduce != follows)
    if param == "bf16" and not p.autocast:
        if not p.skip_step_on_nonfinite:
            ctx.put("bf16.check_grad_overflow", False, "precision.skip_step_on_nonfinite")
    elif param == "fp32" and p.skip_step_on_nonfinite:
        ctx.note("precision.skip_step_on_nonfinite", UNSUPPORTED, "DeepSpeed checks for overflow only in fp16/bf16",
                 True)  # fmt: skip


#: torch.amp.GradScaler() defaults: what DeepSpeed's torch_autocast builds for fp16 at stage 0.
_GRAD_SCALER_DEFAULTS = {"mode": "dynamic", "semantics": "torch_grad_scaler", "initial_scale": 65536.0,
                         "growth_interval": 2000, "growth_factor": 2.0, "backoff_factor": 0.5}  # fmt: skip


def _note_autocast_loss_scaling(cfg: TorshConfig, ctx: WriteContext) -> None:
    """Under torch_autocast DeepSpeed scales fp16 losses with GradScaler() defaults at stage 0, and not at all under
    ZeRO; the fp16 section's scaling keys do not apply there."""
    ls = cfg.precision.loss_scaling
    if ls.mode == "none" and cfg.precision.param_dtype != "fp16":
        return
    value = ls.model_dump(mode="json", include=set(_GRAD_SCALER_DEFAULTS))
    if cfg.sharding.stage == 0 and cfg.precision.param_dtype == "fp16" and value == _GRAD_SCALER_DEFAULTS:
        ctx.note("precision.loss_scaling", EXACT, "DeepSpeed's torch_autocast scales fp16 losses with "
                 "torch.amp.GradScaler() defaults at stage 0", value)  # fmt: skip
    elif cfg.sharding.stage == 0 and cfg.precision.param_dtype == "fp16":
        ctx.note("precision.loss_scaling", APPROXIMATE, "DeepSpeed's torch_autocast uses torch.amp.GradScaler() "
                 "with its defaults (init 65536, growth interval 2000); these settings are not carried", value)
    else:
        ctx.note("precision.loss_scaling", UNSUPPORTED, "DeepSpeed scales losses under torch_autocast only for fp16 "
                 "at stage 0", value)  # fmt: skip


def _write_compression(cfg: TorshConfig, ctx: WriteContext, *, written_reduce: bool) -> None:
    """fp16/bf16 compression of the reduction is DeepSpeed's communication_data_type; nothing else has a key."""
    c = cfg.compression
    if c.method in ("fp16", "bf16") and not written_reduce:
        ctx.put("communication_data_type", c.method, "compression.method", APPROXIMATE,
                "DeepSpeed reduces in this dtype (no compression hook, no period or warm-up)")  # fmt: skip
    elif c.method != "none":
        ctx.note("compression", UNSUPPORTED, f"DeepSpeed 0.19.8 has no {c.method} gradient compression (its 1-bit "
                 "optimizers were removed)", c.model_dump(mode="json", exclude_defaults=True))  # fmt: skip


def _write_loss_scaling(cfg: TorshConfig, ctx: WriteContext) -> None:
    ls, stage = cfg.precision.loss_scaling, cfg.sharding.stage
    if ls.mode == "static":
        ctx.put("fp16.loss_scale", ls.static_scale, "precision.loss_scaling.static_scale")
    else:
        if ls.mode == "none":
            ctx.note("precision.loss_scaling.mode", APPROXIMATE, "DeepSpeed fp16 always scales the loss; written as "
                     "dynamic scaling", "none")  # fmt: skip
        ctx.put("fp16.loss_scale", 0, "precision.loss_scaling.mode", reason="0 = dynamic")
    power = math.log2(ls.initial_scale)
    fidelity = EXACT if power.is_integer() else APPROXIMATE
    ctx.put("fp16.initial_scale_power", int(round(power)), "precision.loss_scaling.initial_scale", fidelity,
            "" if fidelity is EXACT else "DeepSpeed starts at a power of two")  # fmt: skip
    ctx.put("fp16.loss_scale_window", ls.growth_interval, "precision.loss_scaling.growth_interval")
    ctx.put("fp16.hysteresis", ls.hysteresis, "precision.loss_scaling.hysteresis")
    ctx.put("fp16.consecutive_hysteresis", ls.consecutive_hysteresis, "precision.loss_scaling.consecutive_hysteresis")
    min_scale = int(ls.min_scale) if float(ls.min_scale).is_integer() else ls.min_scale
    ctx.put("fp16.min_loss_scale", min_scale, "precision.loss_scaling.min_scale")
    expected = "deepspeed_zero" if stage >= 1 else "deepspeed_stage0"
    if ls.semantics != expected:
        ctx.note("precision.loss_scaling.semantics", APPROXIMATE, f"DeepSpeed at stage {stage} follows "
                 f"{expected}'s rules (hysteresis and growth timing differ from {ls.semantics})", ls.semantics)
    if ls.growth_factor != 2.0 or ls.backoff_factor != 0.5:
        ctx.note("precision.loss_scaling.growth_factor", UNSUPPORTED, "DeepSpeed always doubles and halves",
                 [ls.growth_factor, ls.backoff_factor])  # fmt: skip


def _write_sharding(cfg: TorshConfig, ctx: WriteContext) -> None:
    o, s = cfg.offload, cfg.sharding
    for part, device in (("optimizer", o.optimizer), ("param", o.params)):
        if device == "none":
            continue
        core = "offload.optimizer" if part == "optimizer" else "offload.params"
        if s.stage == 0 or (part == "param" and s.stage < 3):
            where = "parameters only at stage 3" if part == "param" else "only under ZeRO (stage >= 1)"
            ctx.note(core, UNSUPPORTED, f"DeepSpeed offloads {where}", device)
            continue
        ctx.put(f"zero_optimization.offload_{part}.device", device, core,
                APPROXIMATE if part == "optimizer" else EXACT,
                "DeepSpeed steps DeepSpeedCPUAdam on the offloaded state" if part == "optimizer" else "")
        kept = cfg.extensions.get("deepspeed", {})  # a second section's own value, when it differed on reading
        for sub, value in (("pin_memory", o.pin_memory), ("nvme_path", o.nvme_path)):
            if sub == "pin_memory" or device == "nvme":
                key = f"zero_optimization.offload_{part}.{sub}"
                ctx.put(key, kept.get(key, value), f"offload.{sub}")
    if s.hybrid_shard_size is not None:
        if s.stage == 3:
            ctx.put("zero_optimization.zero_hpz_partition_size", s.hybrid_shard_size, "sharding.hybrid_shard_size",
                    APPROXIMATE, "ZeRO++ hpZ: a secondary partition per group of this size")  # fmt: skip
        else:
            ctx.note("sharding.hybrid_shard_size", UNSUPPORTED, "DeepSpeed partitions hierarchically only at stage 3",
                     s.hybrid_shard_size)  # fmt: skip
    if s.reshard_after_forward is not None and s.reshard_after_forward != (s.stage == 3):
        ctx.note("sharding.reshard_after_forward", UNSUPPORTED, f"DeepSpeed stage {s.stage} always "
                 f"{'re-partitions' if s.stage == 3 else 'keeps'} parameters after forward", s.reshard_after_forward)
    if s.wrap.module_classes or s.wrap.min_num_params:
        ctx.note("sharding.wrap", IGNORED, "DeepSpeed partitions per parameter, not per wrapped module",
                 s.wrap.model_dump())  # fmt: skip
    for key in ("backward_prefetch", "forward_prefetch"):
        if getattr(s, key) not in (None, False):
            ctx.note(f"sharding.{key}", IGNORED, "DeepSpeed prefetches by its own bucket settings", getattr(s, key))
    if not s.sync_module_states:
        ctx.note("sharding.sync_module_states", UNSUPPORTED, "DeepSpeed always broadcasts the model from rank 0",
                 False)  # fmt: skip


def _write_optimizer(cfg: TorshConfig, ctx: WriteContext) -> None:
    o = cfg.optimizer
    if o is None:
        return
    if o.name is None:
        ctx.note("optimizer", UNSUPPORTED, "DeepSpeed uses a client optimizer as given; it cannot apply "
                 "hyper-parameters to it", o.model_dump(mode="json", exclude_defaults=True))  # fmt: skip
        return
    ctx.put("optimizer.type", o.name, "optimizer.name")
    if o.name == "Adam":
        ctx.put("optimizer.params.adam_w_mode", False, "optimizer.name", EXACT,
                "DeepSpeed's Adam is AdamW unless adam_w_mode is false")  # fmt: skip
    ctx.put("optimizer.params.lr", o.lr, "optimizer.lr")
    weight_decay = o.weight_decay
    if weight_decay is None and o.name in ("Adam", "AdamW", "SGD", "Adagrad"):
        weight_decay = 0.01 if o.name == "AdamW" else 0.0
        ctx.put("optimizer.params.weight_decay", weight_decay, "optimizer.weight_decay", DEFAULTED,
                f"torch.optim.{o.name}'s default, written out: DeepSpeed's FusedAdam default is 0")  # fmt: skip
    elif weight_decay is not None:
        ctx.put("optimizer.params.weight_decay", weight_decay, "optimizer.weight_decay")
    for key in ("betas", "eps", "momentum"):
        value = getattr(o, key)
        if value is not None:
            ctx.put(f"optimizer.params.{key}", list(value) if isinstance(value, tuple) else value, f"optimizer.{key}")
    for key, value in o.kwargs.items():
        ctx.put(f"optimizer.params.{key}", value, f"optimizer.kwargs.{key}")


def _write_scheduler(cfg: TorshConfig, ctx: WriteContext) -> None:
    s = cfg.scheduler
    if s is None:
        return
    ctx.put("scheduler.type", s.name, "scheduler.name")
    if s.name in DEEPSPEED_SCHEDULERS:
        for key, value in s:
            if key != "name" and value is not None:
                ctx.put(f"scheduler.params.{key}", value, f"scheduler.{key}")
    else:
        for key, value in s.kwargs.items():
            ctx.put(f"scheduler.params.{key}", value, f"scheduler.kwargs.{key}")


def _write_clipping(cfg: TorshConfig, ctx: WriteContext) -> None:
    value = cfg.gradients.clip_max_norm
    if value is None:
        ctx.put("gradient_clipping", 0.0, "gradients.clip_max_norm", EXACT,
                "no clipping, written out: DeepSpeed clips at 1.0 when the key is absent")  # fmt: skip
    else:
        ctx.put("gradient_clipping", value, "gradients.clip_max_norm")


def _write_pipeline_stages(cfg: TorshConfig, ctx: WriteContext) -> None:
    if cfg.pipeline.stages is not None:
        ctx.put("pipeline.stages", cfg.pipeline.stages, "pipeline.stages", APPROXIMATE,
                "used only with a DeepSpeed PipelineModule")  # fmt: skip


#: One write hook per concept that spans several DeepSpeed keys (keyed by a name, not a DeepSpeed path).
WRITE_HOOKS = {
    "<precision>": Hook(write=_write_precision, claims=("precision", "compression")),
    "<sharding>": Hook(write=_write_sharding, claims=("offload", "sharding.hybrid_shard_size",
                       "sharding.reshard_after_forward", "sharding.wrap", "sharding.backward_prefetch",
                       "sharding.forward_prefetch", "sharding.sync_module_states")),  # fmt: skip
    "<optimizer>": Hook(write=_write_optimizer, claims=("optimizer",)),
    "<scheduler>": Hook(write=_write_scheduler, claims=("scheduler",)),
    "<clipping>": Hook(write=_write_clipping, claims=("gradients.clip_max_norm",)),
    "<pipeline>": Hook(write=_write_pipeline_stages, claims=("pipeline.stages",)),
}
