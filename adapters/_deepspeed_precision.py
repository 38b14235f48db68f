"""DeepSpeed's precision contract, one group: ``fp16`` / ``bf16`` / ``torch_autocast``, ``data_types``,
``communication_data_type`` and fp16 loss scaling, read and written together.

DeepSpeed casts the parameters to the fp16/bf16 mode and keeps fp32 master weights; it reduces and accumulates in
the mode's dtype unless told otherwise; its fp16 scaler follows ZeRO's rules from stage 1 and FP16_Optimizer's at
stage 0; ``torch_autocast`` with fp16 at stage 0 builds ``torch.amp.GradScaler()``. Absent keys are made explicit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torsh.concepts import precision as pc
from torsh.concepts.dtypes import normalise as _dtype
from torsh.config import TorshConfig
from torsh.deferred import AUTO, Deferred, is_deferred
from torsh.translate import WriteContext, get_path

from ._deepspeed_rules import APPROXIMATE, DEFERRED, DEFERRED_SOURCES, EXACT, UNSUPPORTED, _group, _Seen, _stage

#: Keys outside DeepSpeed's pydantic sections: DeepSpeed passes "auto" through raw and fails on it later.
_AUTO_FAILS = ("communication_data_type", "torch_autocast.enabled", "torch_autocast.dtype", "data_types.param_dtype",
               "data_types.grad_accum_dtype", "data_types.buffer_dtype")  # fmt: skip
_KEEPS_FP32 = "DeepSpeed keeps fp32 master weights unless this is set"


@dataclass(frozen=True)
class _Mode:
    """What the enabled flags say: the parameter dtype, and which sections apply."""

    param: Any
    fp16: bool
    """The fp16 section applies (fp16 on, or "auto")."""
    bf16: bool
    autocast: bool
    autocast_dtype: str

    @property
    def low(self) -> str:
        """The dtype DeepSpeed reduces and accumulates in when nothing else is said."""
        return pc.deepspeed_follows(self.param, self.autocast)


def _read_precision(seen: _Seen) -> None:
    mode = None if _refuse_auto(seen) else _mode(seen)
    if mode is None:
        return
    stage = _stage(seen)
    _enabled_flags(seen, mode)
    if mode.fp16:
        _read_fp16(seen, stage)
    _inert_section(seen, "fp16")
    if mode.bf16:
        _read_bf16(seen, mode)
    _inert_section(seen, "bf16")
    _read_autocast(seen, mode, stage)
    _read_data_types(seen, mode)
    if not mode.fp16 and not mode.bf16 and not mode.autocast:
        seen.ctx.set("precision.skip_step_on_nonfinite", False, "fp16.enabled", note=False)


def _refuse_auto(seen: _Seen) -> bool:
    for key in [k for k in _AUTO_FAILS if seen.has(k) and is_deferred(seen.items[k][1])]:
        seen.ctx.problem(seen.items[key][0], "auto", "DeepSpeed does not accept \"auto\" here (it fails when it "
                         "uses the value) and no trainer fills it; give a value or remove the key")
    return bool(seen.ctx.problems)


def _inert_section(seen: _Seen, section: str) -> None:
    for key in [k for k in seen.items if k.startswith(section + ".")]:
        seen.inert(key, f"{section} is off; no effect")


def _mode(seen: _Seen) -> _Mode | None:
    fp16_on, bf16_on = seen.items.get("fp16.enabled", (0, False))[1], seen.items.get("bf16.enabled", (0, False))[1]
    if fp16_on is True and bf16_on is True:
        seen.ctx.problem("bf16.enabled", True, "bfloat16 and fp16 modes cannot be simultaneously enabled "
                         "(DeepSpeed asserts); enable one")  # fmt: skip
        return None
    autocast, autocast_dtype = seen.value("torch_autocast.enabled", False), _dtype(
        seen.value("torch_autocast.dtype", "bfloat16"))
    flags = {"fp16": fp16_on, "bf16": bf16_on}
    param = _param_dtype(flags, autocast_dtype if autocast else "fp32")
    fp16, bf16 = (param == name or (param is AUTO and is_deferred(flags[name])) for name in flags)
    return _Mode(param, fp16, bf16, bool(autocast), autocast_dtype)


def _param_dtype(flags: dict[str, Any], otherwise: str) -> Any:
    on = next((name for name, flag in flags.items() if flag is True), None)
    return on or (AUTO if any(map(is_deferred, flags.values())) else otherwise)


def _enabled_flags(seen: _Seen, mode: _Mode) -> None:
    """The enabled flags: one core value (param_dtype); an "auto" flag stays "auto" in the DeepSpeed export."""
    for key in ("fp16.enabled", "bf16.enabled"):
        if not seen.has(key):
            continue
        if is_deferred(seen.items[key][1]):
            reason = DEFERRED_SOURCES["precision.param_dtype"]
            if mode.param is not AUTO:
                reason += f"; with {mode.param} on it can only resolve to false (DeepSpeed rejects both)"
            seen.keep(key, DEFERRED, reason, "precision.param_dtype")
        else:
            path, raw = seen.items.pop(key)
            seen.ctx.note(path, EXACT, "", raw, "precision.param_dtype")
    seen.ctx.set("precision.param_dtype", mode.param, "fp16.enabled" if mode.fp16 else "bf16.enabled", note=False)


def _read_fp16(seen: _Seen, stage: int) -> None:
    _read_loss_scaling(seen, stage)
    seen.set("fp16.auto_cast", "precision.cast_forward_inputs", seen.value("fp16.auto_cast", False), default=False)
    master = seen.value("fp16.fp16_master_weights_and_grads", False)
    if master and stage == 0:  # DeepSpeedConfig asserts it
        seen.ctx.problem("fp16.fp16_master_weights_and_grads", master, "DeepSpeed 0.19.8 refuses fp16 master weights "
                         "without ZeRO: set zero_optimization.stage to 1, 2 or 3, or remove the key")  # fmt: skip
    seen.set("fp16.fp16_master_weights_and_grads", "precision.master_dtype", "fp16" if master else "fp32",
             default="fp32", reason="" if seen.has("fp16.fp16_master_weights_and_grads") else _KEEPS_FP32)


def _read_bf16(seen: _Seen, mode: _Mode) -> None:
    seen.set("bf16.check_grad_overflow", "precision.skip_step_on_nonfinite",
             seen.value("bf16.check_grad_overflow", True), default=True)  # fmt: skip
    if mode.param == "bf16":
        master = seen.value("bf16.bf16_master_weights_and_grads", False)
        seen.set("bf16.bf16_master_weights_and_grads", "precision.master_dtype", "bf16" if master else "fp32",
                 default="fp32", reason="" if seen.has("bf16.bf16_master_weights_and_grads") else _KEEPS_FP32)
    states = seen.value("bf16.bf16_optimizer_states", False)
    seen.set("bf16.bf16_optimizer_states", "precision.optimizer_state_dtype", "bf16" if states else "fp32",
             default="fp32")  # fmt: skip


def _read_autocast(seen: _Seen, mode: _Mode, stage: int) -> None:
    if not mode.autocast:
        seen.inert("torch_autocast.enabled", "torch_autocast is off")
        seen.inert("torch_autocast.dtype", "torch_autocast is off")
        return
    seen.set("torch_autocast.enabled", "precision.autocast", True)
    seen.set("torch_autocast.dtype", "precision.param_dtype", mode.autocast_dtype, default=mode.autocast_dtype)
    if mode.autocast_dtype == "fp16" and stage == 0:
        # DeepSpeed builds torch.amp.GradScaler() with its defaults
        for key in ("mode", "semantics", "initial_scale", "growth_interval"):
            seen.ctx.set(f"precision.loss_scaling.{key}", pc.GRAD_SCALER[key], "torch_autocast.dtype", note=False)
        seen.ctx.set("precision.skip_step_on_nonfinite", True, "torch_autocast.dtype", note=False)


def _read_data_types(seen: _Seen, mode: _Mode) -> None:
    """data_types and communication_data_type: absent means "follow the mode" - made explicit."""
    low, concrete = mode.low, mode.param is not AUTO
    _restated_param_dtype(seen, low, concrete)
    if concrete or seen.has("data_types.grad_accum_dtype"):
        seen.set("data_types.grad_accum_dtype", "precision.grad_accum_dtype",
                 _dtype(seen.value("data_types.grad_accum_dtype", low)), default=low,
                 reason="" if seen.has("data_types.grad_accum_dtype") else
                 "DeepSpeed accumulates gradients in the model dtype unless data_types.grad_accum_dtype is set")
    if seen.has("data_types.buffer_dtype"):
        seen.set("data_types.buffer_dtype", "precision.buffer_dtype", _dtype(seen.value("data_types.buffer_dtype")))
    if _sequence_parallel(seen):
        _read_seq_parallel_reduce(seen)
        return
    seen.inert(_SEQ_COMM, "applies only under sequence parallelism (sequence_parallel_size above 1)")
    comm = seen.value("communication_data_type")
    if concrete or comm is not None:
        seen.set("communication_data_type", "precision.reduce_dtype", _dtype(comm) if comm else low, default=low,
                 reason="" if comm else f"DeepSpeed reduces in {low} when communication_data_type is not set")


_SEQ_COMM = "seq_parallel_communication_data_type"


def _sequence_parallel(seen: _Seen) -> bool:
    sp = get_path(seen.ctx.core, "parallelism.sp", 1)
    return isinstance(sp, int) and sp > 1


def _read_seq_parallel_reduce(seen: _Seen) -> None:
    """Under sequence parallelism DeepSpeed's engine reduces gradients in ``seq_parallel_communication_data_type``
    (fp32 unless set), whatever ``communication_data_type`` says."""
    seen.inert("communication_data_type", f"under sequence parallelism DeepSpeed reduces in {_SEQ_COMM} instead")
    given = seen.value(_SEQ_COMM)
    seen.set(_SEQ_COMM, "precision.reduce_dtype", _dtype(given) if given else "fp32", default="fp32",
             reason="" if given else f"DeepSpeed reduces in fp32 under sequence parallelism unless {_SEQ_COMM} is set")


def _restated_param_dtype(seen: _Seen, low: str, concrete: bool) -> None:
    if seen.has("data_types.param_dtype"):
        given = _dtype(seen.value("data_types.param_dtype"))
        if concrete and given != low:
            seen.ctx.problem(seen.items["data_types.param_dtype"][0], given, f"does not match the fp16/bf16 mode "
                             f"({low}); DeepSpeed rejects the mismatch")  # fmt: skip
        seen.drop("data_types.param_dtype", "restates the fp16/bf16 mode (precision.param_dtype)", EXACT)


def _read_loss_scaling(seen: _Seen, stage: int) -> None:
    semantics = pc.deepspeed_semantics(stage)
    static = seen.value("fp16.loss_scale", 0)
    seen.ctx.set("precision.loss_scaling.semantics", semantics, "fp16.enabled", note=False)
    seen.ctx.set("precision.skip_step_on_nonfinite", True, "fp16.enabled", note=False)
    if static:
        seen.set("fp16.loss_scale", "precision.loss_scaling.static_scale", float(static))
        seen.ctx.set("precision.loss_scaling.mode", "static", "fp16.loss_scale", note=False)
    else:
        seen.set("fp16.loss_scale", "precision.loss_scaling.mode", "dynamic", default="dynamic",
                 reason=f"0 means dynamic: {pc.SEMANTICS[semantics]}")  # fmt: skip
    _initial_scale(seen, seen.value("fp16.initial_scale_power", 16), pc.MAX_SCALE_POWER)
    for key, core in pc.DEEPSPEED_SCALER_FIELDS.items():
        default = pc.DEEPSPEED_FP16[key]
        reason = "read only by ZeRO's scaler; stage 0 ignores hysteresis" if key == "hysteresis" and stage < 1 else ""
        seen.set(f"fp16.{key}", f"precision.loss_scaling.{core}", seen.value(f"fp16.{key}", default), default=default,
                 reason=reason)  # fmt: skip
    seen.set("fp16.min_loss_scale", "precision.loss_scaling.min_scale", float(seen.value("fp16.min_loss_scale", 1)),
             default=1.0)  # fmt: skip


def _initial_scale(seen: _Seen, power: Any, limit: int) -> None:
    if isinstance(power, float) and power.is_integer() and abs(power) <= limit:
        power = int(power)  # DeepSpeed's pydantic field takes a whole float as its int
    if isinstance(power, int) and not isinstance(power, bool) and abs(power) <= limit:
        seen.set("fp16.initial_scale_power", "precision.loss_scaling.initial_scale", float(2**power),
                 default=float(2**16), reason=f"2**{power}")  # fmt: skip
    else:  # 2**power of a huge power overflows a float (or takes minutes as an int): refuse it before computing
        seen.ctx.problem("fp16.initial_scale_power", power, f"the initial loss scale is 2**initial_scale_power: give "
                         f"a whole number from -{limit} to {limit} (DeepSpeed's default is 16)")


# ---- writing ---------------------------------------------------------------------------------------


def _write_precision(cfg: TorshConfig, ctx: WriteContext) -> None:
    p, param = cfg.precision, cfg.precision.param_dtype
    _write_mode(cfg, ctx)
    _write_fp16(cfg, ctx)
    _write_low_precision_state(cfg, ctx)
    _write_compression(cfg, ctx, written_reduce=_write_data_types(cfg, ctx))
    if param == "bf16" and not p.autocast and not p.skip_step_on_nonfinite:
        ctx.put("bf16.check_grad_overflow", False, "precision.skip_step_on_nonfinite")
    elif param == "fp32" and p.skip_step_on_nonfinite:
        ctx.note("precision.skip_step_on_nonfinite", UNSUPPORTED, "DeepSpeed checks for overflow only in fp16/bf16",
                 True)  # fmt: skip


def _write_fp16(cfg: TorshConfig, ctx: WriteContext) -> None:
    p = cfg.precision
    deferred_scaled = isinstance(p.param_dtype, Deferred) and p.loss_scaling.mode != "none"
    if p.param_dtype == "fp16" and not p.autocast or deferred_scaled:
        _write_loss_scaling(cfg, ctx)
        if p.cast_forward_inputs:
            ctx.put("fp16.auto_cast", True, "precision.cast_forward_inputs")
    elif p.cast_forward_inputs:
        ctx.note("precision.cast_forward_inputs", UNSUPPORTED, "DeepSpeed casts inputs only in fp16 (auto_cast)", True)


def _write_data_types(cfg: TorshConfig, ctx: WriteContext) -> bool:
    """Dtypes that differ from what the mode implies; True when communication_data_type is written."""
    p, param = cfg.precision, cfg.precision.param_dtype
    deferred = isinstance(param, Deferred)
    follows = None if deferred else pc.deepspeed_follows(param, p.autocast)
    if p.grad_accum_dtype not in (None, follows) or deferred and p.grad_accum_dtype is not None:
        ctx.put("data_types.grad_accum_dtype", p.grad_accum_dtype, "precision.grad_accum_dtype")
    reduce = p.reduce_dtype or (None if deferred else param)
    if cfg.parallelism.sp > 1:  # DeepSpeed reduces in this key's dtype (fp32 by default) under sequence parallelism
        if reduce not in (None, "fp32"):
            ctx.put("seq_parallel_communication_data_type", reduce, "precision.reduce_dtype")
        reduce = follows
    if reduce not in (None, follows):
        ctx.put("communication_data_type", reduce, "precision.reduce_dtype")
    if p.buffer_dtype is not None:
        ctx.put("data_types.buffer_dtype", p.buffer_dtype, "precision.buffer_dtype")
    return reduce not in (None, follows)


def _write_mode(cfg: TorshConfig, ctx: WriteContext) -> None:
    p, param = cfg.precision, cfg.precision.param_dtype
    if isinstance(param, Deferred):
        if not {"fp16.enabled", "bf16.enabled", "bfloat16.enabled"} & set(cfg.extensions.get("deepspeed", {})):
            for key in ("fp16.enabled", "bf16.enabled"):  # (else the kept flags say which)
                ctx.put(key, AUTO, "precision.param_dtype")
    elif p.autocast:
        ctx.put("torch_autocast.enabled", True, "precision.autocast")
        ctx.put("torch_autocast.dtype", {"bf16": "bfloat16", "fp16": "float16"}[param], "precision.param_dtype")
        _note_autocast_loss_scaling(cfg, ctx)
    elif param in ("fp16", "bf16"):
        ctx.put(f"{param}.enabled", True, "precision.param_dtype", EXACT,
                "DeepSpeed casts the parameters to it and keeps fp32 master weights")


def _write_low_precision_state(cfg: TorshConfig, ctx: WriteContext) -> None:
    p = cfg.precision
    master_ok, states_ok = pc.deepspeed_keeps_low_precision(p.param_dtype, p.autocast, p.master_dtype,
                                                            p.optimizer_state_dtype, cfg.sharding.stage)
    if p.master_dtype != "fp32":
        if master_ok:
            ctx.put(f"{p.param_dtype}.{p.param_dtype}_master_weights_and_grads", True, "precision.master_dtype")
        else:
            ctx.note("precision.master_dtype", UNSUPPORTED, "DeepSpeed keeps low-precision master weights only with "
                     "fp16/bf16 of the same dtype under ZeRO 1-3", p.master_dtype)  # fmt: skip
    if p.optimizer_state_dtype != "fp32":
        if states_ok:
            ctx.put("bf16.bf16_optimizer_states", True, "precision.optimizer_state_dtype")
        else:
            ctx.note("precision.optimizer_state_dtype", UNSUPPORTED, "DeepSpeed keeps bf16 optimizer state only "
                     "with bf16 master weights under ZeRO 1-3", p.optimizer_state_dtype)  # fmt: skip


def _note_autocast_loss_scaling(cfg: TorshConfig, ctx: WriteContext) -> None:
    """Under torch_autocast DeepSpeed scales fp16 losses with GradScaler() defaults at stage 0, and not at all under
    ZeRO; the fp16 section's scaling keys do not apply there."""
    ls = cfg.precision.loss_scaling
    if ls.mode == "none" and cfg.precision.param_dtype != "fp16":
        return
    value = ls.model_dump(mode="json", include=set(pc.GRAD_SCALER))
    if cfg.sharding.stage == 0 and cfg.precision.param_dtype == "fp16" and value == pc.GRAD_SCALER:
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
    for key, core in pc.DEEPSPEED_SCALER_FIELDS.items():
        ctx.put(f"fp16.{key}", getattr(ls, core), f"precision.loss_scaling.{core}")
    min_scale = int(ls.min_scale) if float(ls.min_scale).is_integer() else ls.min_scale
    ctx.put("fp16.min_loss_scale", min_scale, "precision.loss_scaling.min_scale")
    expected = pc.deepspeed_semantics(stage)
    if ls.semantics != expected:
        ctx.note("precision.loss_scaling.semantics", APPROXIMATE, f"DeepSpeed at stage {stage} follows "
                 f"{expected}'s rules (hysteresis and growth timing differ from {ls.semantics})", ls.semantics)
    if ls.growth_factor != pc.GRAD_SCALER["growth_factor"] or ls.backoff_factor != pc.GRAD_SCALER["backoff_factor"]:
        ctx.note("precision.loss_scaling.growth_factor", UNSUPPORTED, "DeepSpeed always doubles and halves",
                 [ls.growth_factor, ls.backoff_factor])  # fmt: skip


_KEYS = (*(f"fp16.{k}" for k in pc.DEEPSPEED_FP16), *(f"bf16.{k}" for k in pc.DEEPSPEED_BF16),
         "torch_autocast.enabled", "torch_autocast.dtype", "data_types.param_dtype", "data_types.grad_accum_dtype",
         "data_types.buffer_dtype", "communication_data_type", "seq_parallel_communication_data_type")  # fmt: skip
PRECISION = _group("precision and loss scaling", _KEYS, ("precision", "compression"), _read_precision,
                   _write_precision)  # fmt: skip
