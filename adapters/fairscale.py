"""FairScale 0.4.13: ``FullyShardedDataParallel`` kwargs, ``OSS`` (ZeRO-1), ``OSS`` + ``ShardedDataParallel`` (ZeRO-2)
and ``ShardedGradScaler``, as one mapping of the constructors' keyword arguments:

``{"fsdp": {...}}`` or ``{"oss": {"optim": "AdamW", "lr": 1e-4, ...}, "sdp": {...}}``, each with an optional
``"scaler": {...}``. ``oss`` forwards every key it does not know to the optimizer class, as FairScale does.
Writing picks the layout from the stage: 1 → OSS, 2 → OSS + ShardedDataParallel (FairScale FSDP with
``reshard_after_forward=False`` when parameters are offloaded), 3 → FSDP. FairScale has no plain DDP (stage 0).
"""

from __future__ import annotations

from typing import Any

from torsh.concepts import dtypes, sharding
from torsh.concepts.precision import GRAD_SCALER, GRAD_SCALER_KWARGS
from torsh.config import AUTO, TorshConfig, get_path
from torsh.dialect import Dialect, Prepared
from torsh.translate import (
    NOTHING,
    Alias,
    Dropped,
    Fidelity,
    FieldMap,
    Hook,
    Ignored,
    ReadContext,
    To,
    WriteContext,
    settle_auto,
)

from ._sniff import Shape, best
from ._torch_names import (
    AUTO_SETTERS,
    SCRIPT_SIDE,
    dtype,
    explain_unsupported,
    prune_defaults,
    split_expressions,
    to_bool,
)

NAME = "fairscale"
VERSIONS = ("0.4.13",)
DEFAULT_FORMAT = "json"
_TORCH = dtypes.TORCH
_SDP_DEFAULT_BUFFER = 2**23


def _state(ctx: Any) -> dict[str, Any]:
    return ctx.__dict__.setdefault("_fairscale", {})


def _remember(key: str, convert=lambda v, ctx, path: v):
    def hook(value: Any, ctx: ReadContext, path: str) -> None:
        converted = convert(value, ctx, path)
        if converted is not None or value is None:
            _state(ctx)[key] = (converted, path, value)

    return hook


def _read_reshard(value: Any, ctx: ReadContext, path: str) -> None:
    flag = to_bool(value, ctx, path)
    if flag is not None:
        stage = sharding.stage_of_reshard(flag)
        ctx.set("sharding.stage", stage, path, Fidelity.EXACT, f"ZeRO-{stage}")
        ctx.keep(path, flag)  # so ZeRO-2 is written back as FairScale FSDP, not OSS + ShardedDataParallel


def _flag_unsupported(reason: str):
    """A boolean whose default (False) is exact and whose True has no torsh counterpart."""

    def hook(value: Any, ctx: ReadContext, path: str) -> None:
        if to_bool(value, ctx, path):
            ctx.keep(path, value)
            ctx.note(path, Fidelity.UNSUPPORTED, reason, value)
        else:
            ctx.note(path, Fidelity.EXACT, "off (the default)", value)

    return hook


def _read_grads_to_cpu(value: Any, ctx: ReadContext, path: str) -> None:
    if value is None:
        ctx.note(path, Fidelity.EXACT, "None: follows move_params_to_cpu", None)
    else:
        _state(ctx)["grads_to_cpu"] = (to_bool(value, ctx, path), path, value)


def _read_predivide(value: Any, ctx: ReadContext, path: str) -> None:
    if value is None:
        ctx.note(path, Fidelity.EXACT, "None: the largest power of two f with f^2 < world size (FSDP1 does the "
                 "same); only the rounding of the mean changes", None)  # fmt: skip
    else:
        ctx.set("gradients.predivide_factor", value, path)


def _read_optim(value: Any, ctx: ReadContext, path: str) -> None:
    name = str(value).rsplit(".", 1)[-1] if isinstance(value, str) else None
    if not name or not name.isidentifier():
        ctx.problem(path, value, "expected an optimizer class name such as \"torch.optim.AdamW\"")
        return
    ctx.set("optimizer.name", name, path, Fidelity.EXACT, "the local optimizer each rank steps on its shard")


def _read_optim_kwarg(value: Any, ctx: ReadContext, path: str) -> None:
    ctx.set(f"optimizer.kwargs.{path.rsplit('.', 1)[-1]}", value, path, Fidelity.EXACT,
            "forwarded to the optimizer class, as OSS does")  # fmt: skip


_NOT_RESULTS = "communication or memory layout, not results"
FIELD_MAP = {
    "fsdp.reshard_after_forward": Hook(read=_read_reshard),
    "fsdp.disable_reshard_on_root": Ignored("the root keeps its parameters after forward (default True), as the "
                                            "torsh FSDP2 root does"),
    "fsdp.mixed_precision": Hook(read=_remember("mixed_precision", to_bool)),
    "fsdp.fp32_reduce_scatter": Hook(read=_remember("fp32_reduce_scatter", to_bool)),
    "fsdp.compute_dtype": Hook(read=_remember("compute_dtype", dtype)),
    "fsdp.buffer_dtype": Hook(read=_remember("buffer_dtype", dtype)),
    "fsdp.flatten_parameters": Ignored("flat parameters are a memory layout; FSDP2 never flattens"),
    "fsdp.move_params_to_cpu": Hook(read=_remember("offload", to_bool)),
    "fsdp.move_grads_to_cpu": Hook(read=_read_grads_to_cpu),
    "fsdp.bucket_cap_mb": Ignored("the reduce-scatter bucket: " + _NOT_RESULTS),
    "fsdp.compute_device": Ignored("the device comes from the launcher (LOCAL_RANK)"),
    "fsdp.state_dict_device": Ignored("where the full state dict is assembled"),
    "fsdp.no_broadcast_optim_state": Ignored("MoE optimizer-state consolidation detail"),
    "fsdp.clear_autocast_cache": Ignored("frees autocast's cache after forward: memory, not results"),
    "fsdp.force_input_to_fp32": Hook(read=_flag_unsupported("casts the forward inputs to fp32; torsh casts them to "
                                                            "param_dtype or leaves them")),
    "fsdp.verbose": Ignored("repr detail"),
    "fsdp.state_dict_on_rank_0_only": Ignored("where the full state dict is assembled"),
    "fsdp.gradient_predivide_factor": Hook(read=_read_predivide),
    "fsdp.allow_reset_parameters": Ignored("allows reset_parameters() on a wrapped module"),
    "fsdp.process_group": Ignored("the process group object: all ranks"),
    "fsdp.process_group_reduce_scatter": Ignored("a separate reduce-scatter group for overlap: " + _NOT_RESULTS),
    "oss.optim": Hook(read=_read_optim),
    "oss.lr": "optimizer.lr",
    "oss.weight_decay": "optimizer.weight_decay",
    "oss.betas": "optimizer.betas",
    "oss.eps": "optimizer.eps",
    "oss.momentum": "optimizer.momentum",
    "oss.*": Hook(read=_read_optim_kwarg),
    "oss.group": Ignored("the process group object: all ranks"),
    "oss.broadcast_buffer_size": Dropped("deprecated and unused in FairScale 0.4.13"),
    "oss.broadcast_fp16": Hook(read=_flag_unsupported("broadcasts the updated shards in fp16; torsh's ZeRO-1 "
                                                      "(ZeroRedundancyOptimizer) broadcasts them in full precision")),
    "oss.force_broadcast_object": Ignored("how the state is broadcast: " + _NOT_RESULTS),
    "sdp.broadcast_buffers": "ddp.broadcast_buffers",
    "sdp.sync_models_at_startup": "sharding.sync_module_states",
    "sdp.reduce_buffer_size": Hook(read=_remember("reduce_buffer_size")),
    "sdp.reduce_fp16": Hook(read=_remember("reduce_fp16", to_bool)),
    "sdp.auto_refresh_trainable": Ignored("re-checks which parameters are trainable"),
    "sdp.warn_on_trainable_params_changed": Ignored("a warning"),
    "sdp.process_group": Ignored("the process group object: all ranks"),
    **{f"scaler.{kwarg}": To(f"precision.loss_scaling.{field}", default=GRAD_SCALER[field])
       for kwarg, field in GRAD_SCALER_KWARGS.items()},
    "scaler.enabled": Hook(read=_remember("scaler_enabled", to_bool)),
    "scaler.process_group": Ignored("the process group object: all ranks"),
}
VALUE_MAPS: dict[str, dict] = {}
ALIASES = {"fsdp.cpu_offload": Alias("fsdp.move_params_to_cpu", "0.4.13 keeps cpu_offload as a deprecated alias")}


# ---- reading: the keys that decide one core field together -----------------------------------------------


def _finalize(ctx: ReadContext) -> None:
    raw, state = ctx.raw, _state(ctx)
    if "fsdp" in raw and ({"oss", "sdp"} & set(raw)):
        ctx.problem("fsdp", None, "FairScale FSDP shards the optimizer state itself: OSS / ShardedDataParallel are "
                    "for DDP-style training; give one")  # fmt: skip
        return
    if "sdp" in raw and "oss" not in raw:
        ctx.problem("sdp", raw["sdp"], "ShardedDataParallel needs an OSS optimizer: add \"oss\"")
        return
    if "fsdp" in raw:
        _finalize_fsdp(ctx, state)
    elif "oss" in raw:
        _finalize_oss(ctx, state, "oss+sdp" if "sdp" in raw else "oss")
    if "scaler" in raw:
        _finalize_scaler(ctx, state)


#: FairScale's stage of each of its layouts (``torsh.concepts.sharding.FAIRSCALE_LAYOUTS``, reversed).
_LAYOUT_STAGE = {layout: stage for stage, layout in sharding.FAIRSCALE_LAYOUTS.items()}
#: The OSS layouts: the key that says it, its name as a ZeRO stage, and what a reader adds.
_OSS_LAYOUTS = {"oss": ("oss", "OSS: ZeRO-1", " (optimizer state sharded)"),
                "oss+sdp": ("sdp", "OSS + ShardedDataParallel: ZeRO-2", "")}  # fmt: skip


def _finalize_oss(ctx: ReadContext, state: dict, layout: str) -> None:
    key, zero, detail = _OSS_LAYOUTS[layout]
    ctx.set("sharding.stage", _LAYOUT_STAGE[layout], key, Fidelity.EXACT, zero + detail)
    if get_path(ctx.core, "optimizer.name", NOTHING) is NOTHING:
        ctx.set("optimizer.name", "SGD", "oss.optim", Fidelity.DEFAULTED, "OSS's default optimizer class")
    _finalize_sdp(ctx, state)


def _finalize_scaler(ctx: ReadContext, state: dict) -> None:
    enabled = state.get("scaler_enabled", (True,))[0]
    ctx.set("precision.loss_scaling.mode", "dynamic" if enabled else "none", "scaler", Fidelity.EXACT,
            "ShardedGradScaler: torch GradScaler rules" if enabled else "disabled")  # fmt: skip
    if enabled:
        ctx.set("precision.loss_scaling.semantics", "torch_grad_scaler", "scaler", note=False)


def _finalize_fsdp(ctx: ReadContext, state: dict) -> None:
    if get_path(ctx.core, "sharding.stage", NOTHING) is NOTHING:
        ctx.set("sharding.stage", 3, "fsdp.reshard_after_forward", Fidelity.DEFAULTED, "FairScale default True: ZeRO-3")
    mp = state.get("mixed_precision", (False, "fsdp.mixed_precision", None))
    fp32_rs = state.get("fp32_reduce_scatter")
    if fp32_rs and fp32_rs[0] and not mp[0]:
        ctx.problem(fp32_rs[1], fp32_rs[2], "FairScale raises: fp32_reduce_scatter needs mixed_precision=True")
        return
    if mp[0]:
        _read_mixed_precision(ctx, state, mp, fp32_rs)
    else:
        ctx.note(mp[1], Fidelity.EXACT, "full precision", mp[2], "precision.param_dtype")
        for key in ("compute_dtype", "buffer_dtype", "fp32_reduce_scatter"):
            if key in state:
                ctx.keep(state[key][1], state[key][2])
                ctx.note(state[key][1], Fidelity.IGNORED, "read only with mixed_precision=True", state[key][2])
    _read_fsdp_offload(ctx, state)


def _read_mixed_precision(ctx: ReadContext, state: dict, mp: tuple, fp32_rs: tuple | None) -> None:
    """FSDP(mixed_precision=True): the compute, reduce and buffer dtypes with FairScale's defaults."""
    compute = state.get("compute_dtype")
    param = compute[0] if compute else "fp16"
    ctx.set("precision.param_dtype", param, compute[1] if compute else mp[1], Fidelity.EXACT if compute else
            Fidelity.DEFAULTED, "" if compute else "FairScale mixed_precision computes in fp16 by default")
    ctx.set("precision.reduce_dtype", "fp32" if fp32_rs and fp32_rs[0] else param, fp32_rs[1] if fp32_rs else
            mp[1], Fidelity.EXACT, "gradients reduced in fp32" if fp32_rs and fp32_rs[0] else "")  # fmt: skip
    buffer = state.get("buffer_dtype")
    ctx.set("precision.buffer_dtype", buffer[0] if buffer and buffer[0] else param, buffer[1] if buffer else mp[1],
            Fidelity.EXACT, "" if buffer else "FairScale default: the compute dtype")  # fmt: skip
    ctx.set("precision.cast_forward_inputs", True, mp[1], Fidelity.EXACT, "the root casts its inputs")


def _read_fsdp_offload(ctx: ReadContext, state: dict) -> None:
    """move_params_to_cpu (with move_grads_to_cpu, which torsh offloads together)."""
    offload = state.get("offload")
    if offload:
        if offload[0]:
            ctx.set("offload.params", "cpu", offload[1], Fidelity.EXACT, "parameters and gradients on the CPU")
            ctx.set("offload.optimizer", "cpu", offload[1], Fidelity.EXACT, "the optimizer step runs on the CPU")
        else:
            ctx.note(offload[1], Fidelity.EXACT, "no offload", offload[2], "offload")
    grads = state.get("grads_to_cpu")
    if grads and grads[0] != bool(offload and offload[0]):
        ctx.keep(grads[1], grads[2])
        ctx.note(grads[1], Fidelity.UNSUPPORTED, "gradients and parameters offload together in torsh", grads[2])
    elif grads:
        ctx.note(grads[1], Fidelity.EXACT, "as move_params_to_cpu", grads[2])


def _finalize_sdp(ctx: ReadContext, state: dict) -> None:
    size = state.get("reduce_buffer_size")
    fp16 = state.get("reduce_fp16")
    if size:
        ctx.keep(size[1], size[2])
        ctx.note(size[1], Fidelity.IGNORED, "bucket size in elements: " + _NOT_RESULTS, size[2])
    buffer = size[0] if size else _SDP_DEFAULT_BUFFER
    if fp16 and fp16[0] and not _is_number(buffer):  # an expression of the script: its value decides
        ctx.keep(fp16[1], fp16[2])
        ctx.note(fp16[1], Fidelity.APPROXIMATE, "FairScale reduces in fp16 only when reduce_buffer_size is 0, and "
                 f"reduce_buffer_size is {buffer!r}, a value of the script: not carried", fp16[2])  # fmt: skip
    elif fp16 and fp16[0]:
        if buffer > 0:
            ctx.keep(fp16[1], fp16[2])
            ctx.note(fp16[1], Fidelity.DROPPED, "FairScale silently disables reduce_fp16 when reduce_buffer_size > 0 "
                     "(the default is 2**23): gradients are reduced uncompressed", fp16[2])  # fmt: skip
        else:
            ctx.set("compression.method", "fp16", fp16[1], Fidelity.EXACT, "gradients reduced in fp16")
    elif fp16:
        ctx.note(fp16[1], Fidelity.EXACT, "no compression", fp16[2], "compression.method")


_SECTIONS = ("fsdp", "oss", "sdp", "scaler")
#: FairScale: top-level ``fsdp`` / ``oss`` / ``sdp`` / ``scaler`` mappings.
SHAPES = (Shape(1.0, (_SECTIONS,), FIELD_MAP, tables=_SECTIONS),)


# ---- writing ------------------------------------------------------------------------------------------------


def _layout(cfg: TorshConfig) -> str:
    s = cfg.sharding
    from_fsdp = any(k.startswith("fsdp.") for k in cfg.extensions.get(NAME, {}))
    needs_fsdp = (cfg.offload.params != "none" or cfg.precision.param_dtype != "fp32"
                  or s.reshard_after_forward is not None)
    if s.stage == 3 or (s.stage == 2 and (needs_fsdp or from_fsdp)):
        return "fsdp"
    return sharding.fairscale_layout(s.stage)


def _write_sharding(cfg: TorshConfig, ctx: WriteContext) -> None:
    layout, s = _layout(cfg), cfg.sharding
    if layout == "none":
        ctx.note("sharding.stage", Fidelity.UNSUPPORTED, "FairScale has no plain data parallel: use torch "
                 "DistributedDataParallel for stage 0", 0)  # fmt: skip
    elif layout == "fsdp":
        ctx.put("fsdp.reshard_after_forward", bool(s.effective_reshard_after_forward), "sharding.stage")
    else:
        _write_oss(cfg, ctx, layout)
    if s.hybrid_shard_size is not None:
        ctx.note("sharding.hybrid_shard_size", Fidelity.UNSUPPORTED, "FairScale has no hybrid sharding",
                 s.hybrid_shard_size)  # fmt: skip
    if s.wrap.module_classes or s.wrap.min_num_params:
        ctx.note("sharding.wrap", Fidelity.UNSUPPORTED, "FairScale wraps with enable_wrap/auto_wrap in the script, not "
                 "with an FSDP argument", s.wrap.model_dump())  # fmt: skip


def _write_oss(cfg: TorshConfig, ctx: WriteContext, layout: str) -> None:
    """OSS (ZeRO-1), with ShardedDataParallel over it for ZeRO-2."""
    zero = _OSS_LAYOUTS[layout][1]
    if cfg.optimizer and cfg.optimizer.name:
        ctx.put("oss.optim", f"torch.optim.{cfg.optimizer.name}", "sharding.stage", Fidelity.EXACT, zero)
    else:
        ctx.put("oss.optim", "torch.optim.SGD", "sharding.stage", Fidelity.APPROXIMATE, zero + "; OSS builds the "
                "optimizer from its class and the script's is not in the config: SGD, OSS's default, written")
    if layout != "oss+sdp":
        return
    ctx.put("sdp", {}, "sharding.stage", Fidelity.EXACT, "ShardedDataParallel over the OSS optimizer")
    ctx.put("sdp.broadcast_buffers", cfg.ddp.broadcast_buffers, "ddp.broadcast_buffers")
    ctx.put("sdp.sync_models_at_startup", cfg.sharding.sync_module_states, "sharding.sync_module_states")
    if cfg.compression.method == "fp16":
        ctx.put("sdp.reduce_fp16", True, "compression.method", Fidelity.EXACT, "with reduce_buffer_size 0, or "
                "FairScale silently ignores it")  # fmt: skip
        ctx.put("sdp.reduce_buffer_size", 0, "compression.method")


def _write_fsdp_precision(cfg: TorshConfig, ctx: WriteContext) -> None:
    if _layout(cfg) != "fsdp":
        if cfg.precision.param_dtype != "fp32":
            ctx.note("precision.param_dtype", Fidelity.UNSUPPORTED, "OSS / ShardedDataParallel keep the model's dtype: "
                     "mixed precision is torch.autocast in the script", cfg.precision.param_dtype)  # fmt: skip
        return
    p = cfg.precision
    if p.param_dtype is AUTO:
        ctx.note("precision.param_dtype", Fidelity.DEFERRED, "\"auto\": FairScale has no such value; not written: "
                 + AUTO_SETTERS["precision"], AUTO)  # fmt: skip
        return
    if p.param_dtype == "fp32":
        if p.reduce_dtype not in (None, "fp32"):
            ctx.note("precision.reduce_dtype", Fidelity.UNSUPPORTED, "FairScale reduces in fp32 without "
                     "mixed_precision", p.reduce_dtype)  # fmt: skip
        return
    ctx.put("fsdp.mixed_precision", True, "precision.param_dtype")
    if p.param_dtype != "fp16":
        ctx.put("fsdp.compute_dtype", _TORCH[p.param_dtype], "precision.param_dtype")
    if p.effective_reduce_dtype == "fp32":
        ctx.put("fsdp.fp32_reduce_scatter", True, "precision.reduce_dtype")
    elif p.effective_reduce_dtype != p.param_dtype:
        ctx.note("precision.reduce_dtype", Fidelity.UNSUPPORTED, "FairScale reduces in the compute dtype or fp32",
                 p.reduce_dtype)  # fmt: skip
    if p.buffer_dtype != p.param_dtype:
        ctx.put("fsdp.buffer_dtype", _TORCH[p.buffer_dtype or "fp32"], "precision.buffer_dtype", Fidelity.EXACT if
                p.buffer_dtype else Fidelity.APPROXIMATE, "" if p.buffer_dtype else "buffers kept as loaded: "
                "written as fp32 (FairScale casts them to the compute dtype otherwise)")  # fmt: skip
    if not p.cast_forward_inputs:
        ctx.note("precision.cast_forward_inputs", Fidelity.APPROXIMATE, "FairScale mixed precision casts the root's "
                 "inputs to the compute dtype", False)  # fmt: skip


def _write_fsdp_offload(cfg: TorshConfig, ctx: WriteContext) -> None:
    o = cfg.offload
    if o.params == "none" and o.optimizer == "none":
        return
    if _layout(cfg) != "fsdp" or "nvme" in (o.params, o.optimizer) or o.params == "none":
        ctx.note("offload", Fidelity.UNSUPPORTED, "FairScale offloads parameters, gradients and optimizer to CPU "
                 "together, and only in FSDP", f"{o.params}/{o.optimizer}")  # fmt: skip
        return
    ctx.put("fsdp.move_params_to_cpu", True, "offload.params", Fidelity.EXACT if o.optimizer == "cpu" else
            Fidelity.APPROXIMATE, "" if o.optimizer == "cpu" else "FairScale offload also moves the optimizer step")


def _write_predivide(cfg: TorshConfig, ctx: WriteContext) -> None:
    factor = cfg.gradients.predivide_factor
    if factor != 1.0 and _layout(cfg) == "fsdp":
        ctx.put("fsdp.gradient_predivide_factor", factor, "gradients.predivide_factor")
    elif factor != 1.0:
        ctx.note("gradients.predivide_factor", Fidelity.UNSUPPORTED, "only FairScale FSDP has a predivide factor",
                 factor)


def _write_scaler(cfg: TorshConfig, ctx: WriteContext) -> None:
    ls = cfg.precision.loss_scaling
    if ls.mode == "none":
        return
    if ls.mode == "static":
        ctx.note("precision.loss_scaling.mode", Fidelity.UNSUPPORTED, "ShardedGradScaler is dynamic only", "static")
        return
    fidelity = Fidelity.EXACT if ls.semantics == "torch_grad_scaler" else Fidelity.APPROXIMATE
    reason = "" if fidelity is Fidelity.EXACT else ("ShardedGradScaler halves on every overflow (no hysteresis, no "
                                                    "minimum scale) and grows after exactly growth_interval steps")
    if fidelity is not Fidelity.EXACT:
        ctx.note("precision.loss_scaling.semantics", fidelity, reason, ls.semantics)
    ctx.put("scaler.init_scale", ls.initial_scale, "precision.loss_scaling.initial_scale")
    ctx.put("scaler.growth_factor", ls.growth_factor, "precision.loss_scaling.growth_factor")
    ctx.put("scaler.backoff_factor", ls.backoff_factor, "precision.loss_scaling.backoff_factor")
    ctx.put("scaler.growth_interval", ls.growth_interval, "precision.loss_scaling.growth_interval")


def _write_optimizer(cfg: TorshConfig, ctx: WriteContext) -> None:
    opt = cfg.optimizer
    if opt is None:
        return
    if _layout(cfg) not in ("oss", "oss+sdp"):
        ctx.note("optimizer", Fidelity.UNSUPPORTED, "FairScale FSDP takes the optimizer the script builds",
                 opt.model_dump(mode="json", exclude_none=True))  # fmt: skip
        return
    for key in ("lr", "weight_decay", "betas", "eps", "momentum"):
        value = getattr(opt, key)
        if value is not None:
            ctx.put(f"oss.{key}", list(value) if isinstance(value, tuple) else value, f"optimizer.{key}")
    for key, value in opt.kwargs.items():
        ctx.put(f"oss.{key}", value, f"optimizer.kwargs.{key}")


_WRITE_MAP = FieldMap({
    "fsdp.reshard_after_forward": Hook(write=_write_sharding, claims=(
        "sharding", "ddp.broadcast_buffers", "compression.method")),
    "fsdp.mixed_precision": Hook(write=_write_fsdp_precision, claims=(
        "precision.param_dtype", "precision.reduce_dtype", "precision.buffer_dtype", "precision.cast_forward_inputs")),
    "fsdp.move_params_to_cpu": Hook(write=_write_fsdp_offload, claims=("offload",)),
    "fsdp.gradient_predivide_factor": Hook(write=_write_predivide, claims=("gradients.predivide_factor",)),
    "scaler.init_scale": Hook(write=_write_scaler, claims=("precision.loss_scaling",)),
    "oss.lr": Hook(write=_write_optimizer, claims=("optimizer",)),
})  # fmt: skip


_WRITE_DEFAULTS = {"sdp.broadcast_buffers": True, "sdp.sync_models_at_startup": True,
                   **{f"scaler.{kwarg}": GRAD_SCALER[field] for kwarg, field in GRAD_SCALER_KWARGS.items()}}


def _finalize_write(ctx: WriteContext) -> None:
    settle_auto(ctx, AUTO_SETTERS)
    prune_defaults(ctx, _WRITE_DEFAULTS)
    explain_unsupported(ctx, SCRIPT_SIDE)


# ---- the dialect ---------------------------------------------------------------------------------------------


class FairScale(Dialect):
    """FairScale constructor kwargs: script expressions are reported and kept, the rest walks the map; writing picks
    OSS (stage 1), OSS + ShardedDataParallel (stage 2) or FSDP (stage 3)."""

    NAME, VERSIONS = NAME, VERSIONS
    FIELD_MAP, VALUE_MAPS, ALIASES = FIELD_MAP, VALUE_MAPS, ALIASES

    def normalise(self, raw: Any, prepared: Prepared) -> Prepared:
        prepared.data, prepared.notes, prepared.kept = split_expressions(raw, prepared.field_map, NAME)
        return prepared

    def finalize(self, ctx: ReadContext, prepared: Prepared) -> None:
        _finalize(ctx)

    def write_map(self, version: str | None) -> FieldMap:
        return _WRITE_MAP

    def finish_write(self, ctx: WriteContext, version: str | None) -> None:
        _finalize_write(ctx)

    def sniff(self, raw: Any) -> float:
        return best(SHAPES, raw)


DIALECT = FairScale()
globals().update(DIALECT.exports())


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
