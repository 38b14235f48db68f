"""DeepSpeed rules a key-by-key map cannot say: keys whose meaning depends on other keys.

The map's ``record()`` hooks collect those keys; :func:`finalize` then sets the core values with DeepSpeed
0.19.8's effective defaults made explicit (precision contract and loss scaling, offload, optimizer, scheduler).
Writing is in ``_deepspeed_write.py``.
Facts come from DeepSpeed 0.19.8's ``runtime/config.py``, ``precision_config.py``, ``zero/config.py``,
``engine.py`` (optimizer construction) and ``lr_schedules.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torsh import schemas
from torsh.config import (
    LRRangeTest,
    OneCycle,
    TorshConfig,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    get_path,
    set_path,
)
from torsh.deferred import AUTO, is_deferred
from torsh.errors import Problem, did_you_mean
from torsh.translate import Fidelity, FieldMap, Hook, Note, ReadContext, Status, To, WriteContext

#: Largest |fp16.initial_scale_power|: the core model caps loss scales at 2**64.
MAX_SCALE_POWER = 64

EXACT, APPROXIMATE, DEFAULTED = Fidelity.EXACT, Fidelity.APPROXIMATE, Fidelity.DEFAULTED
DEFERRED, IGNORED, DROPPED, UNSUPPORTED = Fidelity.DEFERRED, Fidelity.IGNORED, Fidelity.DROPPED, Fidelity.UNSUPPORTED
DEFAULT_REASON = "not set; DeepSpeed 0.19.8 default"

FP16_DEFAULTS = {"enabled": False, "auto_cast": False, "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": False,
                 "min_loss_scale": 1, "fp16_master_weights_and_grads": False}  # fmt: skip
BF16_DEFAULTS = {"enabled": False, "check_grad_overflow": True, "bf16_master_weights_and_grads": False,
                 "bf16_optimizer_states": False}  # fmt: skip

#: Where a deferred ("auto") core value will come from.
DEFERRED_SOURCES = {
    "batch.global_batch_size": "micro batch x accumulation steps x data-parallel world size (HF: "
    "per_device_train_batch_size x gradient_accumulation_steps x world size)",
    "batch.micro_batch_size": "the dataloader's batch size (HF: per_device_train_batch_size)",
    "batch.gradient_accumulation_steps": "the other two batch values and the world size (HF: "
    "gradient_accumulation_steps)",
    "gradients.clip_max_norm": "the training arguments (HF: max_grad_norm)",
    "precision.param_dtype": "the training arguments (HF: --fp16 / --bf16)",
    "optimizer.lr": "the training arguments (HF: learning_rate)",
    "optimizer.weight_decay": "the training arguments (HF: weight_decay)",
    "optimizer.betas": "the training arguments (HF: adam_beta1, adam_beta2)",
    "optimizer.eps": "the training arguments (HF: adam_epsilon)",
    "scheduler.warmup_min_lr": "the training arguments (HF: 0)",
    "scheduler.warmup_max_lr": "the training arguments (HF: learning_rate)",
    "scheduler.warmup_num_steps": "the training arguments (HF: warmup_steps or warmup_ratio x total steps)",
    "scheduler.total_num_steps": "the run length (HF: total optimizer steps)",
}
#: "auto" on keys the core model keeps only in extensions: who fills it, and what DeepSpeed alone does.
_AUTO_IN_EXTENSIONS = {
    "reduce_bucket_size": "HF: hidden_size^2; DeepSpeed alone uses its default 5e8",
    "prefetch_bucket_size": "HF: 0.9 x hidden_size^2; DeepSpeed alone uses its default 5e7",
    "param_persistence_threshold": "HF: 10 x hidden_size; DeepSpeed alone uses its default 1e5",
    "gather_16bit_weights_on_model_save": "Accelerate: zero3_save_16bit_model; DeepSpeed alone uses false",
}
#: Keys whose DeepSpeed default *is* the string "auto" (not the Hugging Face convention).
_DEEPSPEED_OWN_AUTO = ("pipeline.stages", "data_types.keep_in_fp32_modules", "zero_optimization.zenflow")

# ------------------------------------------------------------------------------------------------
# small hook factories used by the map


def _scratch(ctx: ReadContext) -> dict[str, tuple[str, Any]]:
    # ReadContext has no per-dialect state; the recorded keys of this read live on the context instance.
    return ctx.__dict__.setdefault("deepspeed_seen", {})


def _canon(path: str) -> str:
    return "bf16" + path[len("bfloat16"):] if path.startswith("bfloat16") else path


def record() -> Hook:
    """Remember a key for :func:`finalize` (its meaning depends on other keys)."""

    def read(value: Any, ctx: ReadContext, path: str) -> None:
        _scratch(ctx)[_canon(path)] = (path, value)

    return Hook(read=read)


def _status(ctx: ReadContext, path: str, value: Any, status: Status) -> None:
    if status.keep:
        ctx.keep(_canon(path), value)
    ctx.note(path, status.fidelity, status.reason, value)


def unless_default(default: Any, status: Status) -> Hook:
    """``status`` when the value differs from DeepSpeed's default; ignored (and kept) when it is the default."""

    def read(value: Any, ctx: ReadContext, path: str) -> None:
        same = value == default and type(value) is type(default) or is_deferred(value)
        _status(ctx, path, value, Status(IGNORED, "DeepSpeed's default; no effect", True) if same else status)

    return Hook(read=read)


def unless_disabled(status: Status) -> Hook:
    """``status`` for a section whose ``enabled`` is true; ignored (and kept) when it is off."""

    def read(value: Any, ctx: ReadContext, path: str) -> None:
        on = isinstance(value, Mapping) and value.get("enabled") is True
        _status(ctx, path, value, status if on else Status(IGNORED, "disabled; no effect", True))

    return Hook(read=read)


def unless_default_section(key: str, default: Any, status: Status) -> Hook:
    """``status`` for a section whose ``key`` differs from its default; ignored (and kept) otherwise."""

    def read(value: Any, ctx: ReadContext, path: str) -> None:
        on = isinstance(value, Mapping) and value.get(key, default) != default
        _status(ctx, path, value, status if on else Status(IGNORED, f"{key} is off; no effect", True))

    return Hook(read=read)


def positive_or_drop(status: Status, default: str) -> Hook:
    """``status`` for a positive value; 0 (which DeepSpeed 0.19.8 rejects) is dropped so its default applies."""

    def read(value: Any, ctx: ReadContext, path: str) -> None:
        if value == 0:
            ctx.note(path, DROPPED, f"DeepSpeed 0.19.8 requires a value > 0 (validation error); dropped so its "
                     f"default {default} applies", value)  # fmt: skip
        else:
            _status(ctx, path, value, status)

    return Hook(read=read)


def _tensor_parallel(value: Any, ctx: ReadContext, path: str) -> None:
    tp = value.get("autotp_size", 0) if isinstance(value, Mapping) else 0
    if not isinstance(tp, int) or isinstance(tp, bool):
        ctx.problem(f"{path}.autotp_size", tp, "DeepSpeed reads an integer here (<= 1: no tensor parallelism)")
        return
    status = (Status(UNSUPPORTED, "AutoTP tensor parallelism is not run by torsh", True) if tp and tp > 1
              else Status(IGNORED, "no tensor parallelism (autotp_size <= 1); no effect", True))  # fmt: skip
    _status(ctx, path, value, status)


def _pipeline_stages(value: Any, ctx: ReadContext, path: str) -> None:
    if value == "auto":
        _status(ctx, path, value, Status(IGNORED, "DeepSpeed's default: taken from the PipelineModule", True))
    else:
        ctx.set("pipeline.stages", value, path, APPROXIMATE, "carried; torsh does not run pipelines yet")


def _save_full_read(value: Any, ctx: ReadContext, path: str) -> None:
    if is_deferred(value):
        _status(ctx, path, value, Status(DEFERRED, _AUTO_IN_EXTENSIONS["gather_16bit_weights_on_model_save"], True))
    else:
        ctx.set("checkpoint.save_full_weights", value, path)


def _save_full_write(cfg: TorshConfig, ctx: WriteContext) -> None:
    if cfg.checkpoint.save_full_weights:
        ctx.put("zero_optimization.gather_16bit_weights_on_model_save", True, "checkpoint.save_full_weights")


TENSOR_PARALLEL = Hook(read=_tensor_parallel)
PIPELINE_STAGES = Hook(read=_pipeline_stages)
SAVE_FULL_WEIGHTS = Hook(read=_save_full_read, write=_save_full_write, claims=("checkpoint.save_full_weights",))
CLIPPING = To("gradients.clip_max_norm", default=1.0)
HPZ = record()

# ------------------------------------------------------------------------------------------------
# passes around the map driver


def legacy_forms(raw: dict) -> tuple[dict, list[Note]]:
    """Rewrite the legacy ``"zero_optimization": true|false`` form; returns the new dict and its note."""
    zero = raw.get("zero_optimization")
    if not isinstance(zero, bool):
        return raw, []
    note = Note("zero_optimization", "sharding.stage", zero, EXACT,
                f"legacy boolean form: {str(zero).lower()} means stage {int(zero)}")
    return {**raw, "zero_optimization": {"stage": int(zero)}}, [note]


def split_unknown(raw: Mapping[str, Any], fmap: FieldMap, actual: str = "",
                  canonical: str = "") -> tuple[dict, list[Note]]:  # fmt: skip
    """Separate keys nobody reads: each becomes a DROPPED note with a did-you-mean, never silence."""
    known: dict[str, Any] = {}
    notes: list[Note] = []
    for key, value in raw.items():
        path = f"{actual}.{key}" if actual else key
        canon = f"{canonical}.{key}" if canonical else key
        if canon in fmap.aliases:
            canon = fmap.aliases[canon].current
        if fmap.lookup(canon) is not None:
            known[key] = value
        elif isinstance(value, Mapping) and not value and fmap.has_children(canon):
            notes.append(Note(path, None, {}, IGNORED, "empty section: DeepSpeed's defaults apply"))
        elif isinstance(value, Mapping) and fmap.has_children(canon):
            known[key], inner = split_unknown(value, fmap, path, canon)
            notes += inner
        else:
            suggestion = did_you_mean(key, fmap.children(canonical))
            where = ("DeepSpeed 0.19.8 ignores unknown top-level keys, so it has no effect there" if not actual
                     else "DeepSpeed 0.19.8 does not read it (in its strict sections it is a validation error)")
            hint = f"; did you mean '{suggestion}'?" if suggestion else ""
            notes.append(Note(path, None, value, DROPPED, f"unknown key: {where}; dropped{hint}"))
    return known, notes


def unknown_in_whole_sections(raw: Mapping[str, Any], fmap: FieldMap, schema: Mapping[str, Any]) -> tuple[dict, list[Note]]:
    """Sections kept whole (no core meaning: ``autotuning``, ``compile``, ...) are still checked against DeepSpeed's
    schema: a key DeepSpeed does not know inside one becomes a DROPPED note with a did-you-mean, and is not kept
    (DeepSpeed's strict section models would refuse it)."""
    import copy

    out, notes = copy.deepcopy(dict(raw)), []
    if schemas.conforms(raw, schema):  # no key outside the schema anywhere: jsonschema is not needed
        return out, notes
    import jsonschema

    for err in jsonschema.Draft202012Validator(schema).iter_errors(raw):
        path = [str(p) for p in err.absolute_path]
        if err.validator != "additionalProperties" or not path or not isinstance(_rule_above(path, fmap), (Status, Hook)):
            continue
        known = list(err.schema.get("properties", {}))
        node = out
        for part in path:
            node = node[part]
        for key in [k for k in err.instance if k not in known]:
            del node[key]
            suggestion = did_you_mean(key, known)
            hint = f"; did you mean '{suggestion}'?" if suggestion else ""
            notes.append(Note(".".join([*path, key]), None, err.instance[key], DROPPED,
                              f"unknown key: DeepSpeed 0.19.8 would refuse it in this section; dropped{hint}"))
    return out, notes


#: Sections DeepSpeed 0.19.8 parses with pydantic models that forbid extra keys (DeepSpeedConfigModel,
#: ``extra="forbid"``): an unknown key inside one makes ``DeepSpeedConfig`` raise a ValidationError at start-up.
#: Checked against DeepSpeed 0.19.8 itself (tests/test_consumer_deepspeed_validate.py).
STRICT_SECTIONS = ("zero_optimization", "fp16", "bf16", "bfloat16", "tensorboard", "wandb", "csv_monitor", "comet",
                   "compile", "hybrid_engine", "tensor_parallel", "comms_logger", "weight_quantization")


def refused_unknown_keys(notes: list[Note]) -> list[Problem]:
    """The unknown-key notes DeepSpeed would refuse (inside a strict section), as problems naming the key."""
    problems = []
    for note in notes:
        top = note.source_path.split(".", 1)[0]
        if top in STRICT_SECTIONS and "." in note.source_path and note.reason.startswith("unknown key"):
            hint = note.reason.rsplit("did you mean '", 1)
            suggestion = hint[1].rstrip("'?") if len(hint) == 2 else None
            problems.append(Problem(note.source_path, note.value, f"unknown key: DeepSpeed 0.19.8 refuses the whole "
                                    f"config for it (its {top} section forbids extra keys); fix its spelling or "
                                    "remove it", suggestion))  # fmt: skip
    return problems


def _rule_above(path: list[str], fmap: FieldMap) -> Any:
    """The map rule of the nearest enclosing key of ``path`` that has one (None when none has)."""
    for end in range(1, len(path) + 1):
        rule = fmap.lookup(".".join(path[:end]))
        if rule is not None:
            return rule
    return None


def mark_auto(notes: list[Note]) -> list[Note]:
    """Notes for ``"auto"`` values kept in extensions become DEFERRED, saying who resolves them."""
    out = []
    for note in notes:
        if (note.fidelity in (IGNORED, EXACT, UNSUPPORTED) and note.value == "auto"
                and not note.source_path.endswith(_DEEPSPEED_OWN_AUTO)):  # fmt: skip
            leaf = note.source_path.rsplit(".", 1)[-1].removeprefix("stage3_")
            why = _AUTO_IN_EXTENSIONS.get(leaf, "filled by HF Trainer/Accelerate; DeepSpeed alone uses its default")
            note = Note(note.source_path, note.target_path, note.value, DEFERRED, why)
        out.append(note)
    return out


# ------------------------------------------------------------------------------------------------
# finalize: cross-key rules, after every key has been seen


class _Seen:
    """The recorded keys of one read, with helpers that note each key exactly once."""

    def __init__(self, ctx: ReadContext):
        self.ctx = ctx
        self.items = _scratch(ctx)

    def section(self, prefix: str) -> dict[str, tuple[str, Any]]:
        return {k[len(prefix) + 1:]: v for k, v in self.items.items() if k.startswith(prefix + ".")}

    def has(self, key: str) -> bool:
        return key in self.items

    def value(self, key: str, default: Any = None) -> Any:
        """The value, or DeepSpeed's default when absent or "auto" on a key that cannot defer."""
        if key not in self.items:
            return default
        value = self.items[key][1]
        return default if is_deferred(value) else value

    def set(self, key: str, core: str, value: Any, fidelity: Fidelity = EXACT, reason: str = "",
            *, default: Any = None) -> None:  # fmt: skip
        """Set a core value from a recorded key, or from DeepSpeed's default (DEFAULTED) when absent."""
        if key in self.items:
            path, raw = self.items.pop(key)
            if is_deferred(raw) and not _deferrable(core):
                self.ctx.keep(key, raw)
                self.ctx.set(core, value, path, note=False)
                self.ctx.note(path, DEFERRED, f"filled by HF Trainer/Accelerate; DeepSpeed alone uses {value!r}",
                              raw, core)  # fmt: skip
                return
            self.ctx.set(core, raw if is_deferred(raw) else value, path, fidelity, reason)
        else:
            self.ctx.set(core, value if default is None else default, key, DEFAULTED, reason or DEFAULT_REASON)

    def inert(self, key: str, reason: str) -> None:
        """A recorded key with no effect in this configuration: kept for round trips, noted as ignored."""
        if key in self.items:
            path, raw = self.items.pop(key)
            self.ctx.keep(key, raw)
            self.ctx.note(path, IGNORED, reason, raw)

    def drop(self, key: str, reason: str, fidelity: Fidelity = DROPPED) -> None:
        if key in self.items:
            path, raw = self.items.pop(key)
            self.ctx.note(path, fidelity, reason, raw)


def _deferrable(core_path: str) -> bool:
    return core_path in DEFERRED_SOURCES or core_path.startswith(("scheduler.", "optimizer.", "batch."))


def finalize(ctx: ReadContext) -> None:
    """Set the core values that depend on several DeepSpeed keys, with DeepSpeed's defaults explicit."""
    seen = _Seen(ctx)
    _stage_auto(ctx)
    stage = get_path(ctx.core, "sharding.stage", 0)
    _precision(seen, stage)
    _offload(seen, stage)
    _hierarchical_partitioning(seen, stage)
    _optimizer(seen)
    _scheduler(seen)
    for key in [] if ctx.problems else list(seen.items):  # a recorded key nobody claimed is a defect here
        raise AssertionError(f"deepspeed adapter: recorded key {key} was not handled")


#: The ZeRO stage Accelerate's DeepSpeed plugin puts in place of "auto" (ACCELERATE_DEEPSPEED_ZERO_STAGE's default;
#: the HF Trainer builds the same plugin). DeepSpeed alone rejects "auto" here.
ACCELERATE_DEFAULT_STAGE = 2


def _stage_auto(ctx: ReadContext) -> None:
    """``"zero_optimization.stage": "auto"``: read as the stage Accelerate fills in, with a note saying so."""
    if get_path(ctx.core, "sharding.stage", 0) is not AUTO:
        return
    set_path(ctx.core, "sharding.stage", ACCELERATE_DEFAULT_STAGE)
    ctx.notes[:] = [n for n in ctx.notes if n.target_path != "sharding.stage"]
    ctx.note("zero_optimization.stage", APPROXIMATE, f"\"auto\": Accelerate's DeepSpeed plugin (also under the HF "
             f"Trainer) fills it with its zero_stage, {ACCELERATE_DEFAULT_STAGE} unless "
             "ACCELERATE_DEEPSPEED_ZERO_STAGE says otherwise; DeepSpeed alone rejects \"auto\" here. Read as "
             f"{ACCELERATE_DEFAULT_STAGE}", "auto", "sharding.stage")  # fmt: skip


#: Keys outside DeepSpeed's pydantic sections: DeepSpeed passes "auto" through raw and fails on it later.
_AUTO_FAILS = ("communication_data_type", "torch_autocast.enabled", "torch_autocast.dtype", "data_types.param_dtype",
               "data_types.grad_accum_dtype", "data_types.buffer_dtype")  # fmt: skip


def _precision(seen: _Seen, stage: int) -> None:
    for key in _AUTO_FAILS:
        if seen.has(key) and is_deferred(seen.items[key][1]):
            seen.ctx.problem(seen.items[key][0], "auto", "DeepSpeed does not accept \"auto\" here (it fails when it "
                             "uses the value) and no trainer fills it; give a value or remove the key")
    if seen.ctx.problems:
        return
    fp16_on, bf16_on = seen.items.get("fp16.enabled", (0, False))[1], seen.items.get("bf16.enabled", (0, False))[1]
    autocast_on = seen.value("torch_autocast.enabled", False)
    if fp16_on is True and bf16_on is True:
        seen.ctx.problem("bf16.enabled", True, "bfloat16 and fp16 modes cannot be simultaneously enabled "
                         "(DeepSpeed asserts); enable one")  # fmt: skip
        return
    autocast_dtype = _dtype(seen.value("torch_autocast.dtype", "bfloat16"))
    if fp16_on is True:
        param: Any = "fp16"
    elif bf16_on is True:
        param = "bf16"
    elif is_deferred(fp16_on) or is_deferred(bf16_on):
        param = AUTO
    elif autocast_on:
        param = autocast_dtype
    else:
        param = "fp32"
    fp16_possible = param == "fp16" or (param is AUTO and is_deferred(fp16_on))
    bf16_possible = param == "bf16" or (param is AUTO and is_deferred(bf16_on))
    # enabled flags: one core value (param_dtype); an "auto" flag stays "auto" in the DeepSpeed export
    for key in ("fp16.enabled", "bf16.enabled"):
        if not seen.has(key):
            continue
        path, raw = seen.items.pop(key)
        if is_deferred(raw):
            seen.ctx.keep(key, raw)
            reason = DEFERRED_SOURCES["precision.param_dtype"]
            if param is not AUTO:
                reason += f"; with {param} on it can only resolve to false (DeepSpeed rejects both)"
            seen.ctx.note(path, DEFERRED, reason, raw, "precision.param_dtype")
        else:
            seen.ctx.note(path, EXACT, "", raw, "precision.param_dtype")
    seen.ctx.set("precision.param_dtype", param, "fp16.enabled" if fp16_possible else "bf16.enabled", note=False)
    mixed = param in ("fp16", "bf16") and not autocast_on
    # fp16 section
    if fp16_possible:
        _loss_scaling(seen, stage)
        seen.set("fp16.auto_cast", "precision.cast_forward_inputs", seen.value("fp16.auto_cast", False),
                 default=False)  # fmt: skip
        master = seen.value("fp16.fp16_master_weights_and_grads", False)
        seen.set("fp16.fp16_master_weights_and_grads", "precision.master_dtype", "fp16" if master else "fp32",
                 default="fp32", reason="DeepSpeed keeps fp32 master weights unless this is set"
                 if not seen.has("fp16.fp16_master_weights_and_grads") else "")  # fmt: skip
    for key in [k for k in seen.items if k.startswith("fp16.")]:
        seen.inert(key, "fp16 is off; no effect")
    # bf16 section
    if bf16_possible:
        seen.set("bf16.check_grad_overflow", "precision.skip_step_on_nonfinite",
                 seen.value("bf16.check_grad_overflow", True), default=True)  # fmt: skip
        master = seen.value("bf16.bf16_master_weights_and_grads", False)
        if param == "bf16":
            seen.set("bf16.bf16_master_weights_and_grads", "precision.master_dtype", "bf16" if master else "fp32",
                     default="fp32", reason="DeepSpeed keeps fp32 master weights unless this is set"
                     if not seen.has("bf16.bf16_master_weights_and_grads") else "")  # fmt: skip
        states = seen.value("bf16.bf16_optimizer_states", False)
        seen.set("bf16.bf16_optimizer_states", "precision.optimizer_state_dtype", "bf16" if states else "fp32",
                 default="fp32")  # fmt: skip
    for key in [k for k in seen.items if k.startswith("bf16.")]:
        seen.inert(key, "bf16 is off; no effect")
    # torch_autocast
    if autocast_on:
        if mixed:
            seen.ctx.problem("torch_autocast.enabled", True, "torsh cannot combine torch_autocast with fp16/bf16 "
                             "parameter casting; use one")  # fmt: skip
        seen.set("torch_autocast.enabled", "precision.autocast", True)
        seen.set("torch_autocast.dtype", "precision.param_dtype", autocast_dtype, default=autocast_dtype)
        if autocast_dtype == "fp16" and stage == 0:
            _grad_scaler_defaults(seen)
    else:
        seen.inert("torch_autocast.enabled", "torch_autocast is off")
        seen.inert("torch_autocast.dtype", "torch_autocast is off")
    # data_types and communication_data_type: absent means "follow the mode" - made explicit
    low = param if mixed else "fp32"
    if seen.has("data_types.param_dtype"):
        given = _dtype(seen.value("data_types.param_dtype"))
        if param is not AUTO and given != low:
            seen.ctx.problem(seen.items["data_types.param_dtype"][0], given, f"does not match the fp16/bf16 mode "
                             f"({low}); DeepSpeed rejects the mismatch")  # fmt: skip
        seen.drop("data_types.param_dtype", "restates the fp16/bf16 mode (precision.param_dtype)", EXACT)
    concrete = param is not AUTO
    accum = _dtype(seen.value("data_types.grad_accum_dtype", low))
    if concrete or seen.has("data_types.grad_accum_dtype"):
        seen.set("data_types.grad_accum_dtype", "precision.grad_accum_dtype", accum, default=low,
                 reason="" if seen.has("data_types.grad_accum_dtype") else
                 "DeepSpeed accumulates gradients in the model dtype unless data_types.grad_accum_dtype is set")
    if seen.has("data_types.buffer_dtype"):
        seen.set("data_types.buffer_dtype", "precision.buffer_dtype", _dtype(seen.value("data_types.buffer_dtype")))
    comm = seen.value("communication_data_type")
    if concrete or comm is not None:
        seen.set("communication_data_type", "precision.reduce_dtype", _dtype(comm) if comm else low, default=low,
                 reason="" if comm else f"DeepSpeed reduces in {low} when communication_data_type is not set")
    if not fp16_possible and not bf16_possible and not autocast_on:
        seen.ctx.set("precision.skip_step_on_nonfinite", False, "fp16.enabled", note=False)


def _loss_scaling(seen: _Seen, stage: int) -> None:
    semantics = "deepspeed_zero" if stage >= 1 else "deepspeed_stage0"
    rule = {"deepspeed_zero": "ZeRO's dynamic scaler (hysteresis, growth after window+1 clean steps)",
            "deepspeed_stage0": "stage 0's FP16_Optimizer scaler (no hysteresis)"}[semantics]
    static = seen.value("fp16.loss_scale", 0)
    seen.ctx.set("precision.loss_scaling.semantics", semantics, "fp16.enabled", note=False)
    seen.ctx.set("precision.skip_step_on_nonfinite", True, "fp16.enabled", note=False)
    if static:
        seen.set("fp16.loss_scale", "precision.loss_scaling.static_scale", float(static))
        seen.ctx.set("precision.loss_scaling.mode", "static", "fp16.loss_scale", note=False)
    else:
        seen.set("fp16.loss_scale", "precision.loss_scaling.mode", "dynamic", default="dynamic",
                 reason=f"0 means dynamic: {rule}")  # fmt: skip
    power = seen.value("fp16.initial_scale_power", 16)
    if isinstance(power, float) and power.is_integer() and abs(power) <= MAX_SCALE_POWER:
        power = int(power)  # DeepSpeed's pydantic field takes a whole float as its int
    if isinstance(power, int) and not isinstance(power, bool) and abs(power) <= MAX_SCALE_POWER:
        seen.set("fp16.initial_scale_power", "precision.loss_scaling.initial_scale", float(2**power),
                 default=float(2**16), reason=f"2**{power}")  # fmt: skip
    else:  # 2**power of a huge power overflows a float (or takes minutes as an int): refuse it before computing
        seen.ctx.problem("fp16.initial_scale_power", power, f"the initial loss scale is 2**initial_scale_power: give "
                         f"a whole number from -{MAX_SCALE_POWER} to {MAX_SCALE_POWER} (DeepSpeed's default is 16)")
    seen.set("fp16.loss_scale_window", "precision.loss_scaling.growth_interval",
             seen.value("fp16.loss_scale_window", 1000), default=1000)  # fmt: skip
    seen.set("fp16.hysteresis", "precision.loss_scaling.hysteresis", seen.value("fp16.hysteresis", 2), default=2,
             reason="" if stage >= 1 else "read only by ZeRO's scaler; stage 0 ignores hysteresis")
    seen.set("fp16.consecutive_hysteresis", "precision.loss_scaling.consecutive_hysteresis",
             seen.value("fp16.consecutive_hysteresis", False), default=False)  # fmt: skip
    seen.set("fp16.min_loss_scale", "precision.loss_scaling.min_scale", float(seen.value("fp16.min_loss_scale", 1)),
             default=1.0)  # fmt: skip


def _grad_scaler_defaults(seen: _Seen) -> None:
    """torch_autocast + fp16 without ZeRO: DeepSpeed builds ``torch.amp.GradScaler()`` with its defaults."""
    for path, value in (("mode", "dynamic"), ("semantics", "torch_grad_scaler"), ("initial_scale", 65536.0),
                        ("growth_interval", 2000)):  # fmt: skip
        seen.ctx.set(f"precision.loss_scaling.{path}", value, "torch_autocast.dtype", note=False)
    seen.ctx.set("precision.skip_step_on_nonfinite", True, "torch_autocast.dtype", note=False)


_OFFLOAD_PARTS = (("optimizer", "offload.optimizer", "zero_optimization.cpu_offload"),
                  ("param", "offload.params", "zero_optimization.cpu_offload_param"))  # fmt: skip
_LEGACY_OFFLOAD = "deprecated spelling of offload_optimizer/offload_param {device: cpu}"


def _offload(seen: _Seen, stage: int) -> None:
    active = []
    for part, core, legacy_key in _OFFLOAD_PARTS:
        prefix = f"zero_optimization.offload_{part}"
        if seen.has(f"{prefix}.device"):
            source, device = f"{prefix}.device", seen.value(f"{prefix}.device", "none")
            seen.drop(legacy_key, f"{_LEGACY_OFFLOAD}; offload_{part} takes precedence", IGNORED)
        else:
            source, device = legacy_key, "cpu" if seen.value(legacy_key) else "none"
        applies = stage == 3 if part == "param" else stage >= 1
        if device == "none" or not applies:
            why = ("no offload" if device == "none" else "DeepSpeed offloads parameters only at ZeRO stage 3"
                   if part == "param" else "DeepSpeed offloads only under ZeRO (stage >= 1)")  # fmt: skip
            for key in (f"{prefix}.device", f"{prefix}.nvme_path", f"{prefix}.pin_memory", legacy_key):
                seen.inert(key, why)
            continue
        reason = "" if part == "param" else (
            "DeepSpeed steps DeepSpeedCPUAdam on the offloaded state; torsh offloads with FSDP2's CPUOffloadPolicy "
            "(which also offloads parameters and gradients)")  # fmt: skip
        seen.set(source, core, device, EXACT if part == "param" else APPROXIMATE,
                 f"{_LEGACY_OFFLOAD}; {reason}".rstrip("; ") if source == legacy_key else reason)
        active.append(prefix)
        if device != "nvme":
            seen.inert(f"{prefix}.nvme_path", f"offload device is {device}; nvme_path is unused")
    # One core pin_memory / nvme_path for both offload sections: the first active section's value wins, and a
    # second section that disagrees is kept for DeepSpeed and reported as approximate.
    if not active:
        seen.inert("zero_optimization.cpu_offload_use_pin_memory", "no offload")
        return
    first_pin = "zero_optimization.cpu_offload_use_pin_memory"
    candidates = [first_pin] + [f"{prefix}.pin_memory" for prefix in active]
    for sub, core, default in (("pin_memory", "offload.pin_memory", True), ("nvme_path", "offload.nvme_path", None)):
        keys = [k for k in (candidates if sub == "pin_memory" else [f"{p}.nvme_path" for p in active]) if seen.has(k)]
        if not keys:
            if default is not None:
                seen.ctx.set(core, default, "zero_optimization", note=False)
            continue
        chosen = seen.value(keys[0])
        seen.set(keys[0], core, chosen)
        for key in keys[1:]:
            if seen.value(key) == chosen:
                seen.drop(key, f"-> {core} (same value as {keys[0]})", EXACT)
            else:
                path, raw = seen.items.pop(key)
                seen.ctx.keep(key, raw)
                seen.ctx.note(path, APPROXIMATE, f"torsh has one {core}; {keys[0]}={chosen!r} is used", raw)


def _hierarchical_partitioning(seen: _Seen, stage: int) -> None:
    hpz = seen.value("zero_optimization.zero_hpz_partition_size", 1)
    if hpz and hpz > 1 and stage == 3:
        seen.set("zero_optimization.zero_hpz_partition_size", "sharding.hybrid_shard_size", hpz, APPROXIMATE,
                 "ZeRO++ hpZ keeps a secondary parameter partition per group; FSDP2 HSDP shards within groups of "
                 "this size and replicates across them")  # fmt: skip
    else:
        seen.inert("zero_optimization.zero_hpz_partition_size", "hierarchical partitioning is off (or not ZeRO-3)")


_REMOVED_OPTIMIZERS = {"onebitadam": "AdamW", "zerooneadam": "AdamW", "onebitlamb": "Lamb"}
_REMOVED_OPTIMIZER_PARAMS = {"freeze_step", "cuda_aware", "comm_backend_name", "coeff_beta", "factor_max",
                             "factor_min", "factor_threshold", "var_freeze_step", "var_update_scaler",
                             "local_step_scaler", "local_step_clipper"}  # fmt: skip
_DEEPSPEED_ONLY_OPTIMIZERS = {"lamb": "Lamb", "lion": "Lion", "muadam": "MuAdam", "muadamw": "MuAdamW",
                              "musgd": "MuSGD", "muon": "Muon"}  # fmt: skip
_TORCH_OPTIMIZERS = ("ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "LBFGS", "Muon", "NAdam",
                     "RAdam", "RMSprop", "Rprop", "SGD", "SparseAdam")  # fmt: skip
_TYPED_PARAMS = ("lr", "weight_decay", "betas", "eps", "momentum")


def _optimizer(seen: _Seen) -> None:
    params = seen.section("optimizer.params")
    if not seen.has("optimizer.type"):
        for name in params:
            seen.drop(f"optimizer.params.{name}", "DeepSpeed ignores optimizer.params without optimizer.type")
        return
    path, given = seen.items["optimizer.type"]
    lower = str(given).lower()
    adam_w_mode = seen.value("optimizer.params.adam_w_mode", True)
    torch_adam = seen.value("optimizer.params.torch_adam", False)
    if lower in _REMOVED_OPTIMIZERS:
        name = _REMOVED_OPTIMIZERS[lower]
        seen.drop("optimizer.type", f"{given} was removed in DeepSpeed 0.19.8 (AssertionError); replaced by {name}, "
                  f"its uncompressed update rule - set optimizer.type to {name} (torch_adam: true for torch's)")
        seen.ctx.set("optimizer.name", name, path, note=False)
        for key in [k for k in params if k in _REMOVED_OPTIMIZER_PARAMS]:
            seen.drop(f"optimizer.params.{key}", f"a {given} setting; {given} was removed in DeepSpeed 0.19.8")
    elif lower in ("adam", "adamw"):
        name = "AdamW" if lower == "adamw" or adam_w_mode else "Adam"
        why = ("DeepSpeed's \"Adam\" is AdamW (decoupled weight decay) unless adam_w_mode is false"
               if lower == "adam" and name == "AdamW" else "")  # fmt: skip
        seen.set("optimizer.type", "optimizer.name", name, EXACT, why)
        if lower == "adamw":
            seen.inert("optimizer.params.adam_w_mode", "DeepSpeed ignores adam_w_mode for AdamW")
        else:
            seen.drop("optimizer.params.adam_w_mode", f"-> optimizer.name {name}", EXACT)
    elif lower in _DEEPSPEED_ONLY_OPTIMIZERS:
        name = _DEEPSPEED_ONLY_OPTIMIZERS[lower]
        seen.set("optimizer.type", "optimizer.name", name, UNSUPPORTED,
                 f"{name} is DeepSpeed-only: the torsh engine cannot build it (DeepSpeed export keeps it)")
    elif given in _TORCH_OPTIMIZERS or lower == "adagrad":  # DeepSpeed matches its own names case-insensitively
        name = "Adagrad" if lower == "adagrad" else given
        seen.set("optimizer.type", "optimizer.name", name, EXACT, "built as torch.optim." + name)
    else:
        hint = did_you_mean(str(given), _TORCH_OPTIMIZERS + tuple(_DEEPSPEED_ONLY_OPTIMIZERS.values()))
        seen.ctx.problem(path, given, "not a DeepSpeed optimizer or a torch.optim class (DeepSpeed asserts)", hint)
        seen.items.clear()
        return
    if name in ("Adam", "AdamW"):
        _adam_defaults(seen, name, torch_adam)
    for key in list(seen.section("optimizer.params")):
        full = f"optimizer.params.{key}"
        if key == "max_grad_norm":
            seen.ctx.problem(seen.items.pop(full)[0], None, "DeepSpeed rejects optimizer.params.max_grad_norm; use "
                             "the top-level gradient_clipping")  # fmt: skip
        elif key in _TYPED_PARAMS:
            value = seen.items[full][1]
            seen.set(full, f"optimizer.{key}", tuple(value) if isinstance(value, list) else value)
        elif key in _REMOVED_OPTIMIZER_PARAMS:
            seen.drop(full, "a 1-bit optimizer setting; those optimizers were removed in DeepSpeed 0.19.8")
        elif key == "bias_correction" and name in ("Adam", "AdamW"):
            if seen.value(full, True) is True:
                seen.drop(full, "torch's Adam/AdamW always correct the bias", EXACT)
            else:
                path, raw = seen.items.pop(full)
                seen.ctx.keep(full, raw)
                seen.ctx.note(path, UNSUPPORTED, "Adam without bias correction has no torch equivalent; the torsh "
                              "engine corrects the bias (kept for DeepSpeed)", raw)  # fmt: skip
        else:
            seen.set(full, f"optimizer.kwargs.{key}", seen.items[full][1], EXACT, "passed to the constructor")


def _adam_defaults(seen: _Seen, name: str, torch_adam: bool) -> None:
    """DeepSpeed's FusedAdam defaults (weight decay 0, unlike torch's AdamW) made explicit."""
    seen.inert("optimizer.params.torch_adam", "torch's implementation instead of FusedAdam: same math (~1e-7)")
    default_wd = 0.01 if torch_adam and name == "AdamW" else 0.0
    wd_reason = ("torch.optim.AdamW's default (torch_adam: true)" if default_wd else
                 "DeepSpeed's FusedAdam default is 0 (torch's AdamW would use 0.01)")  # fmt: skip
    if not seen.has("optimizer.params.weight_decay"):
        seen.set("optimizer.params.weight_decay", "optimizer.weight_decay", None, default=default_wd,
                 reason=wd_reason)  # fmt: skip
    for key, default in (("lr", 1e-3), ("betas", (0.9, 0.999)), ("eps", 1e-8)):
        if not seen.has(f"optimizer.params.{key}"):
            seen.set(f"optimizer.params.{key}", f"optimizer.{key}", None, default=default)


_SCHEDULER_MODELS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
                     "OneCycle": OneCycle, "LRRangeTest": LRRangeTest}  # fmt: skip


def _scheduler(seen: _Seen) -> None:
    params = seen.section("scheduler.params")
    if not seen.has("scheduler.type"):
        for name in params:
            seen.drop(f"scheduler.params.{name}", "DeepSpeed ignores scheduler.params without scheduler.type")
        return
    given = seen.items["scheduler.type"][1]
    model = _SCHEDULER_MODELS.get(given)
    if model is None:
        seen.set("scheduler.type", "scheduler.name", given, EXACT, f"torch.optim.lr_scheduler.{given}")
        for key in params:
            seen.set(f"scheduler.params.{key}", f"scheduler.kwargs.{key}", params[key][1])
        return
    seen.set("scheduler.type", "scheduler.name", given)
    fields = [f for f in model.model_fields if f != "name"]
    for key in params:
        full = f"scheduler.params.{key}"
        if key == "last_batch_iteration":
            seen.inert(full, "a resume offset; torsh restores the scheduler from the checkpoint")
        elif key not in fields:
            hint = did_you_mean(key, fields)
            seen.drop(full, f"not a {given} argument (DeepSpeed fails when it builds the scheduler)"
                      + (f"; did you mean '{hint}'?" if hint else ""))  # fmt: skip
    for key in fields:
        full = f"scheduler.params.{key}"
        field = model.model_fields[key]
        if key == "warmup_type" and seen.has(full) and seen.value(full) not in ("log", "linear"):
            seen.set(full, "scheduler.warmup_type", "log", APPROXIMATE, "unknown type: DeepSpeed warns and uses log")
        elif seen.has(full):
            seen.set(full, f"scheduler.{key}", seen.items[full][1])
        elif field.is_required():
            seen.ctx.problem(full, None, f"{given} needs {key} (DeepSpeed fails when it builds the scheduler)")
        else:
            seen.set(full, f"scheduler.{key}", None, default=field.default,
                     reason="DeepSpeed default: each parameter group's lr" if field.default is None else "")


def _dtype(value: Any) -> Any:
    from torsh.config import _normalise_dtype

    return _normalise_dtype(value)
