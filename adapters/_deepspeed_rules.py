"""DeepSpeed concepts whose keys are read and written together: one :class:`~torsh.translate.Group` each.

Precision and loss scaling, offload, hierarchical partitioning, the optimizer and the scheduler read every one of
their keys at once, once the whole file is seen, with DeepSpeed 0.19.8's effective defaults made explicit; their
writers sit next to their readers. Facts come from DeepSpeed 0.19.8's ``runtime/config.py``,
``precision_config.py``, ``zero/config.py``, ``engine.py`` (optimizer construction) and ``lr_schedules.py``;
the shared tables are in ``torsh.concepts`` (``precision``, ``optim``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torsh.concepts.offload import deepspeed_offloads
from torsh.config import OffloadConfig, TorshConfig, get_path, set_path
from torsh.deferred import AUTO, is_deferred
from torsh.translate import Fidelity, Group, Hook, ReadContext, Seen, Status, To, WriteContext

EXACT, APPROXIMATE, DEFAULTED = Fidelity.EXACT, Fidelity.APPROXIMATE, Fidelity.DEFAULTED
DEFERRED, IGNORED, DROPPED, UNSUPPORTED = Fidelity.DEFERRED, Fidelity.IGNORED, Fidelity.DROPPED, Fidelity.UNSUPPORTED
DEFAULT_REASON = "not set; DeepSpeed 0.19.8 default"

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
    "sharding.buckets.reduce_bucket_size": "HF: hidden_size^2; DeepSpeed alone uses its default 5e8",
    "sharding.buckets.prefetch_bucket_size": "HF: 0.9 x hidden_size^2; DeepSpeed alone uses its default 5e7",
    "sharding.buckets.param_persistence_threshold": "HF: 10 x hidden_size; DeepSpeed alone uses its default 1e5",
}


class _Seen(Seen):
    """Seen with DeepSpeed's wording: ``"auto"`` where no trainer defers it is read as DeepSpeed's own default."""

    def __init__(self, ctx: ReadContext):
        super().__init__(ctx, DEFAULT_REASON, _deferrable)

    def set(self, key: str, core: str, value: Any, fidelity: Fidelity = EXACT, reason: str = "",
            *, default: Any = None) -> None:  # fmt: skip
        if key in self.items and is_deferred(self.items[key][1]) and not _deferrable(core):
            path, raw = self.items.pop(key)
            self.ctx.keep(key, raw)
            self.ctx.set(core, value, path, note=False)
            self.ctx.note(path, DEFERRED, f"filled by HF Trainer/Accelerate; DeepSpeed alone uses {value!r}", raw, core)
            return
        super().set(key, core, value, fidelity, reason, default=default)

    def keep(self, key: str, fidelity: Fidelity, reason: str, target: str | None = None) -> None:
        """A recorded key kept for DeepSpeed with a note of its own."""
        path, raw = self.items.pop(key)
        self.ctx.keep(key, raw)
        self.ctx.note(path, fidelity, reason, raw, target)


def _deferrable(core_path: str) -> bool:
    return core_path in DEFERRED_SOURCES or core_path.startswith(("scheduler.", "optimizer.", "batch."))


def _stage(seen: Seen) -> int:
    return get_path(seen.ctx.core, "sharding.stage", 0)


def _group(name: str, keys: tuple[str, ...], targets: tuple[str, ...], read: Callable[[_Seen], None] | None,
           write: Callable[[TorshConfig, WriteContext], None] | None) -> Group:  # fmt: skip
    return Group(name, keys, targets, None if read is None else lambda seen: read(_Seen(seen.ctx)), write)


# ------------------------------------------------------------------------------------------------
# single keys: statuses that depend on the value


def _status(ctx: ReadContext, path: str, value: Any, status: Status) -> None:
    if status.keep:
        ctx.keep("bf16" + path[len("bfloat16"):] if path.startswith("bfloat16") else path, value)
    ctx.note(path, status.fidelity, status.reason, value)


def _when(on: Callable[[Any], bool], status: Status, off: str) -> Hook:
    return Hook(read=lambda value, ctx, path: _status(ctx, path, value, status if on(value) else Status(IGNORED, off)))


def unless_default(default: Any, status: Status) -> Hook:
    """``status`` when the value differs from DeepSpeed's default; ignored (and kept) when it is the default."""
    return _when(lambda v: not (v == default and type(v) is type(default) or is_deferred(v)), status,
                 "DeepSpeed's default; no effect")  # fmt: skip


def unless_disabled(status: Status) -> Hook:
    """``status`` for a section whose ``enabled`` is true; ignored (and kept) when it is off."""
    return _when(lambda v: isinstance(v, Mapping) and v.get("enabled") is True, status, "disabled; no effect")


def unless_default_section(key: str, default: Any, status: Status) -> Hook:
    """``status`` for a section whose ``key`` differs from its default; ignored (and kept) otherwise."""
    return _when(lambda v: isinstance(v, Mapping) and v.get(key, default) != default, status,
                 f"{key} is off; no effect")  # fmt: skip


def positive_or_drop(key: str, to: To, default: str) -> Hook:
    """DeepSpeed's ``key`` read and written as ``to`` says, but 0 (which DeepSpeed 0.19.8 rejects) is dropped so its
    default applies."""

    def read(value: Any, ctx: ReadContext, path: str) -> None:
        if value == 0:
            ctx.note(path, DROPPED, f"DeepSpeed 0.19.8 requires a value > 0 (validation error); dropped so its "
                     f"default {default} applies", value)  # fmt: skip
        else:
            ctx.set(to.path, value, path, to.fidelity, to.reason)

    def write(cfg: TorshConfig, ctx: WriteContext) -> None:
        value = get_path(cfg.model_dump(), to.path, None)
        if value is not None:
            ctx.put(key, value, to.path, to.fidelity, to.reason)

    return Hook(read=read, write=write, claims=(to.path,))


#: The keys of DeepSpeed 0.19.8's ``tensor_parallel`` section (``TPTrainingConfig``) besides ``autotp_size``, read when
#: AutoTP is on: (fidelity, reason); each is kept for a DeepSpeed round trip.
_TP_KEYS = {
    "tp_overlap_comm": (IGNORED, "overlaps AutoTP's all-reduce with computation; no numerical effect"),
    "vocab_parallel_ce_backend": (IGNORED, "the cross-entropy kernel of a vocabulary-parallel head; the head stays "
                                  "replicated"),
    "dtype": (IGNORED, "AutoTP's model dtype for inference; training precision comes from bf16 / fp16"),
    "injection_policy_tuple": (IGNORED, "an inference kernel-injection policy"),
    "keep_module_on_host": (IGNORED, "where inference checkpoints are loaded"),
    "replace_with_kernel_inject": (IGNORED, "inference kernel injection"),
    "kernel_inject": (IGNORED, "inference kernel injection"),
    "preset_model": (APPROXIMATE, "DeepSpeed's per-architecture preset; the default plan splits the same "
                     "Hugging Face-style names (q/k/v/gate/up colwise, o/down rowwise)"),
    "partition_config": (UNSUPPORTED, "DeepSpeed's layer specs (regular expressions over parameter names): write the "
                         "plan as parallelism.tp_plan (module-name patterns -> colwise / rowwise)"),
}


def _tensor_parallel(value: Any, ctx: ReadContext, path: str) -> None:
    tp = value.get("autotp_size", 0) if isinstance(value, Mapping) else 0
    if tp == "auto":  # DeepSpeed's config models drop "auto" values: the default, 0 (no tensor parallelism)
        tp = 0
    if not isinstance(tp, int) or isinstance(tp, bool):
        ctx.problem(f"{path}.autotp_size", tp, "DeepSpeed reads an integer here (<= 1: no tensor parallelism)")
        return
    if tp <= 1:
        _status(ctx, path, value, Status(IGNORED, "no tensor parallelism (autotp_size <= 1, or \"auto\", which "
                                                 "DeepSpeed's config model reads as its default 0); no effect", True))
        return
    ctx.set("parallelism.tp", tp, f"{path}.autotp_size", APPROXIMATE, "DTensor tensor parallelism over groups of "
            "this many ranks, composed with FSDP2 on the data-parallel ranks; the default plan splits the Hugging "
            "Face-style names AutoTP recognises (q/k/v/gate/up colwise, o/down rowwise); AutoTP also splits a fused "
            "qkv and the lm_head, which stay replicated here")  # fmt: skip
    for key, sub in value.items():
        where = f"{path}.{key}"
        if key == "autotp_size":
            continue
        if key in ("tp", "tensor_parallel") and isinstance(sub, Mapping):
            size = sub.get("tp_size", 1)
            if size not in (1, tp):
                ctx.problem(f"{where}.tp_size", size, f"DeepSpeed raises when it is neither 1 nor autotp_size ({tp})")
                continue
            ctx.keep(where, sub)
            ctx.note(where, EXACT, "the inference TP group: 1 or autotp_size, which it follows", sub)
        elif key == "vocab_parallel_lm_head":
            ctx.keep(where, sub)
            fidelity = UNSUPPORTED if sub is True else EXACT if sub is False else APPROXIMATE
            ctx.note(where, fidelity, "the lm_head stays replicated over the tp ranks" + (
                "; a vocabulary-parallel head is not run" if sub is True else
                " (DeepSpeed's null splits a tied Hugging Face head by vocabulary)" if sub is None else ""), sub)
        else:
            fidelity, reason = _TP_KEYS.get(key, (UNSUPPORTED, "not a key of DeepSpeed 0.19.8's tensor_parallel"))
            ctx.keep(where, sub)
            ctx.note(where, fidelity, reason, sub)


def _write_tensor_parallel(cfg: TorshConfig, ctx: WriteContext) -> None:
    par = cfg.parallelism
    if par.tp > 1:
        ctx.put("tensor_parallel.autotp_size", par.tp, "parallelism.tp")
    if par.tp_plan:
        ctx.note("parallelism.tp_plan", UNSUPPORTED, "DeepSpeed's partition_config takes regular expressions over "
                 "parameter names; not written: AutoTP's own parser chooses the layers", par.tp_plan)  # fmt: skip
    for key, value in (("dp_replicate", par.dp_replicate), ("cp", par.cp)):
        if value not in (None, 1):
            ctx.note(f"parallelism.{key}", UNSUPPORTED, "DeepSpeed derives the data-parallel replicas from the world "
                     "size and ZeRO++ hpZ" if key == "dp_replicate" else "DeepSpeed's sequence parallelism "
                     "(Ulysses) is not context parallelism", value)  # fmt: skip


def _pipeline_stages(value: Any, ctx: ReadContext, path: str) -> None:
    if value == "auto":
        _status(ctx, path, value, Status(IGNORED, "DeepSpeed's default: taken from the PipelineModule", True))
    else:
        ctx.set("parallelism.pp", value, path, APPROXIMATE, "the pipeline-parallel degree; DeepSpeed uses it only "
                "with a PipelineModule")  # fmt: skip


def _write_pipeline_stages(cfg: TorshConfig, ctx: WriteContext) -> None:
    pp = cfg.parallelism.pp
    if pp != 1:
        ctx.put("pipeline.stages", pp, "parallelism.pp", APPROXIMATE, "used only with a DeepSpeed PipelineModule")


#: "auto" on keys kept in extensions: who fills it, and what DeepSpeed alone does (the ZeRO sizes, core fields
#: now, say it in DEFERRED_SOURCES).
AUTO_IN_EXTENSIONS = {
    "gather_16bit_weights_on_model_save": "Accelerate: zero3_save_16bit_model; DeepSpeed alone uses false",
}


def _save_full_read(value: Any, ctx: ReadContext, path: str) -> None:
    if is_deferred(value):
        _status(ctx, path, value, Status(DEFERRED, AUTO_IN_EXTENSIONS["gather_16bit_weights_on_model_save"], True))
    else:
        ctx.set("checkpoint.save_full_weights", value, path)


def _save_full_write(cfg: TorshConfig, ctx: WriteContext) -> None:
    if cfg.checkpoint.save_full_weights:
        ctx.put("zero_optimization.gather_16bit_weights_on_model_save", True, "checkpoint.save_full_weights")


def _write_clipping(cfg: TorshConfig, ctx: WriteContext) -> None:
    """An absent gradient_clipping means 1.0 in DeepSpeed 0.19.8: no clipping is written out as 0.0."""
    value = cfg.gradients.clip_max_norm
    if value is None:
        ctx.put("gradient_clipping", 0.0, "gradients.clip_max_norm", EXACT,
                "no clipping, written out: DeepSpeed clips at 1.0 when the key is absent")  # fmt: skip
    else:
        ctx.put("gradient_clipping", value, "gradients.clip_max_norm")


TENSOR_PARALLEL = Hook(read=_tensor_parallel)
PIPELINE_STAGES = Hook(read=_pipeline_stages)
SAVE_FULL_WEIGHTS = Hook(read=_save_full_read)
CLIPPING = To("gradients.clip_max_norm", default=1.0)

# ------------------------------------------------------------------------------------------------
# stage "auto"

#: The ZeRO stage Accelerate's DeepSpeed plugin puts in place of "auto" (ACCELERATE_DEEPSPEED_ZERO_STAGE's default;
#: the HF Trainer builds the same plugin). DeepSpeed alone rejects "auto" here.
ACCELERATE_DEFAULT_STAGE = 2


def _stage_auto(seen: Seen) -> None:
    """``"zero_optimization.stage": "auto"``: read as the stage Accelerate fills in, with a note saying so."""
    ctx = seen.ctx
    if get_path(ctx.core, "sharding.stage", 0) is not AUTO:
        return
    set_path(ctx.core, "sharding.stage", ACCELERATE_DEFAULT_STAGE)
    ctx.notes[:] = [n for n in ctx.notes if n.target_path != "sharding.stage"]
    ctx.note("zero_optimization.stage", APPROXIMATE, f"\"auto\": Accelerate's DeepSpeed plugin (also under the HF "
             f"Trainer) fills it with its zero_stage, {ACCELERATE_DEFAULT_STAGE} unless "
             "ACCELERATE_DEEPSPEED_ZERO_STAGE says otherwise; DeepSpeed alone rejects \"auto\" here. Read as "
             f"{ACCELERATE_DEFAULT_STAGE}", "auto", "sharding.stage")  # fmt: skip


STAGE_AUTO = _group("stage auto", (), (), _stage_auto, None)

# ------------------------------------------------------------------------------------------------
# offload

_OFFLOAD_PARTS = (("optimizer", "offload.optimizer", "zero_optimization.cpu_offload"),
                  ("param", "offload.params", "zero_optimization.cpu_offload_param"))  # fmt: skip
_LEGACY_OFFLOAD = "deprecated spelling of offload_optimizer/offload_param {device: cpu}"
_OPTIMIZER_OFFLOAD = ("DeepSpeed steps DeepSpeedCPUAdam on the offloaded state; torsh offloads with FSDP2's "
                      "CPUOffloadPolicy (which also offloads parameters and gradients)")  # fmt: skip


_PARAM_NVME = ("torsh keeps the parameters in CPU memory (FSDP2's CPUOffloadPolicy), not in files under nvme_path: "
               "NVMe parameter swapping is done as CPU offload (the optimizer state is swapped to NVMe)")


_PIPELINE_KEYS = tuple(f"zero_optimization.offload_optimizer.pipeline_{k}" for k in ("read", "write"))


def _read_pipeline(seen: _Seen) -> None:
    """DeepSpeed pipelines the swapping when either of ``pipeline_read`` / ``pipeline_write`` is true (one switch in
    torsh: ``offload.nvme_pipeline``)."""
    present = [k for k in _PIPELINE_KEYS if seen.has(k)]
    if not present:
        seen.set(_PIPELINE_KEYS[0], "offload.nvme_pipeline", False)
        return
    values = [bool(seen.value(k, False)) for k in _PIPELINE_KEYS]  # an absent key is DeepSpeed's default, false
    pipeline = any(values)
    if values[0] == values[1]:
        fidelity, reason = EXACT, "pipeline_read or pipeline_write, as DeepSpeed" if len(present) > 1 else ""
    else:  # DeepSpeed overlaps only the reads, or only the writes; torsh's one switch overlaps both
        only = "reads" if values[0] else "writes"
        fidelity, reason = APPROXIMATE, (f"DeepSpeed overlaps only the {only} with the step; torsh overlaps reads and "
                                         "writes together (the same values, other timing)")
    seen.set(present[0], "offload.nvme_pipeline", pipeline, fidelity, reason)
    for key in present[1:]:
        seen.drop(key, f"-> offload.nvme_pipeline (or of {present[0]})", fidelity)


def _read_offload(seen: _Seen) -> None:
    _read_pipeline(seen)
    active = [prefix for part, core, legacy in _OFFLOAD_PARTS
              if (prefix := _offload_part(seen, _stage(seen), part, core, legacy))]  # fmt: skip
    # One core pin_memory / nvme_path for both offload sections: the first active section's value wins, and a
    # second section that disagrees is kept for DeepSpeed and reported as approximate.
    if not active:
        seen.inert("zero_optimization.cpu_offload_use_pin_memory", "no offload")
        return
    pins = ["zero_optimization.cpu_offload_use_pin_memory"] + [f"{prefix}.pin_memory" for prefix in active]
    _one_value(seen, [k for k in pins if seen.has(k)], "offload.pin_memory", True)
    _one_value(seen, [f"{p}.nvme_path" for p in active if seen.has(f"{p}.nvme_path")], "offload.nvme_path", None)


def _offload_part(seen: _Seen, stage: int, part: str, core: str, legacy_key: str) -> str | None:
    """Read one offload section (or its legacy flag); its prefix when it offloads."""
    prefix = f"zero_optimization.offload_{part}"
    source, device = _offload_device(seen, prefix, legacy_key)
    if device == "none" or not deepspeed_offloads(part, stage):
        why = ("no offload" if device == "none" else "DeepSpeed offloads parameters only at ZeRO stage 3"
               if part == "param" else "DeepSpeed offloads only under ZeRO (stage >= 1)")  # fmt: skip
        for key in (f"{prefix}.device", f"{prefix}.nvme_path", f"{prefix}.pin_memory", legacy_key):
            seen.inert(key, why)
        return None
    reason = (_PARAM_NVME if device == "nvme" else "") if part == "param" else _OPTIMIZER_OFFLOAD
    seen.set(source, core, device, EXACT if part == "param" and device != "nvme" else APPROXIMATE,
             f"{_LEGACY_OFFLOAD}; {reason}".rstrip("; ") if source == legacy_key else reason)
    if device != "nvme":
        seen.inert(f"{prefix}.nvme_path", f"offload device is {device}; nvme_path is unused")
    return prefix


def _offload_device(seen: _Seen, prefix: str, legacy_key: str) -> tuple[str, Any]:
    """The key that says the device (the section's, or else the legacy flag's), and the device."""
    if seen.has(f"{prefix}.device"):
        seen.drop(legacy_key, f"{_LEGACY_OFFLOAD}; {prefix.rsplit('.', 1)[1]} takes precedence", IGNORED)
        return f"{prefix}.device", seen.value(f"{prefix}.device", "none")
    return legacy_key, "cpu" if seen.value(legacy_key) else "none"


def _one_value(seen: _Seen, keys: list[str], core: str, default: Any) -> None:
    if not keys:
        if default is not None:
            seen.ctx.set(core, default, "zero_optimization", note=False)
        return
    chosen = seen.value(keys[0])
    seen.set(keys[0], core, chosen)
    for key in keys[1:]:
        if seen.value(key) == chosen:
            seen.drop(key, f"-> {core} (same value as {keys[0]})", EXACT)
        else:
            seen.keep(key, APPROXIMATE, f"torsh has one {core}; {keys[0]}={chosen!r} is used")


def _write_offload(cfg: TorshConfig, ctx: WriteContext) -> None:
    o = cfg.offload
    for part, device, core in (("optimizer", o.optimizer, "offload.optimizer"), ("param", o.params, "offload.params")):
        if device == "none":
            continue
        if not deepspeed_offloads(part, cfg.sharding.stage):
            where = "parameters only at stage 3" if part == "param" else "only under ZeRO (stage >= 1)"
            ctx.note(core, UNSUPPORTED, f"DeepSpeed offloads {where}", device)
        else:
            _write_offload_part(cfg, ctx, part, device, core)
    _write_nvme_io(cfg, ctx)


#: NVMe offload's I/O settings by DeepSpeed's key (written when they differ from DeepSpeed's defaults, the config
#: model's, whatever the offload device: DeepSpeed reads sub_group_size at every ZeRO-3 step and the aio section on
#: its own)
NVME_IO = {"zero_optimization.sub_group_size": "nvme_sub_group_size", "aio.block_size": "nvme_block_size",
           "aio.intra_op_parallelism": "nvme_threads"}  # fmt: skip


def nvme_default(field: str) -> Any:
    """DeepSpeed's default of an NVMe I/O setting: the config model's field default."""
    return OffloadConfig.model_fields[field].default


def _write_nvme_io(cfg: TorshConfig, ctx: WriteContext) -> None:
    o = cfg.offload
    for key, field in NVME_IO.items():
        value = getattr(o, field)
        if value != nvme_default(field):
            ctx.put(key, value, f"offload.{field}")
    if o.nvme_pipeline and o.optimizer != "none":
        for key in ("pipeline_read", "pipeline_write"):
            ctx.put(f"zero_optimization.offload_optimizer.{key}", True, "offload.nvme_pipeline")


def _write_offload_part(cfg: TorshConfig, ctx: WriteContext, part: str, device: str, core: str) -> None:
    o = cfg.offload
    kept = cfg.extensions.get("deepspeed", {})  # a second section's own value, when it differed on reading
    ctx.put(f"zero_optimization.offload_{part}.device", device, core, APPROXIMATE if part == "optimizer" else
            EXACT, "DeepSpeed steps DeepSpeedCPUAdam on the offloaded state" if part == "optimizer" else "")
    for sub, value in (("pin_memory", o.pin_memory), ("nvme_path", o.nvme_path)):
        if sub == "pin_memory" or device == "nvme":
            key = f"zero_optimization.offload_{part}.{sub}"
            ctx.put(key, kept.get(key, value), f"offload.{sub}")


_OFFLOAD_KEYS = tuple(f"zero_optimization.offload_{part}.{key}" for part in ("param", "optimizer")
                      for key in ("device", "nvme_path", "pin_memory")) + (
    "zero_optimization.cpu_offload", "zero_optimization.cpu_offload_param",
    "zero_optimization.cpu_offload_use_pin_memory", *_PIPELINE_KEYS)  # fmt: skip
OFFLOAD = _group("offload", _OFFLOAD_KEYS, ("offload",), _read_offload, _write_offload)

# ------------------------------------------------------------------------------------------------
# ZeRO++ (hpZ, qwZ, qgZ) and what else ZeRO says about the sharding layout

_HPZ = "zero_optimization.zero_hpz_partition_size"
#: The ZeRO++ quantisation switches (read at ZeRO-3 only, as DeepSpeed does): what the engine does instead, with
#: the loss difference measured against a reference of DeepSpeed's quantisation (tests/test_zeropp.py; DeepSpeed
#: 0.19.8 has no CPU quantizer kernel, so it cannot be compared on the CPU).
ZEROPP_QUANTIZATION = {
    "zero_optimization.zero_quantized_weights": (
        "parameters are all-gathered unquantized, not as DeepSpeed's blockwise symmetric int8 of each rank's "
        "partition: the losses are those of unquantized ZeRO-3, which differ from a reference of DeepSpeed's "
        "quantisation (each parameter's partition in its own groups; DeepSpeed's groups also span the parameters it "
        "gathers together) by up to 1.2e-3 relative (small model, 2 ranks, 6 steps)"),
    "zero_optimization.zero_quantized_nontrainable_weights": (
        "frozen parameters are kept and all-gathered unquantized, not stored as DeepSpeed's blockwise int8: more "
        "memory for them, and the losses of unquantized ZeRO-3, which differ from a reference of DeepSpeed's "
        "quantisation by up to 8.2e-4 relative (small model with its embedding and head frozen, 2 ranks, 6 steps)"),
    "zero_optimization.zero_quantized_gradients": (
        "gradients are reduce-scattered unquantized. DeepSpeed quantizes them (int4, two-stage all-to-all) only "
        "between nodes: on one node its losses are those of plain ZeRO-3 (measured equal on 2 ranks); across nodes "
        "they differ from a reference of its quantized reduction by up to 1.3e-3 relative (small model, 2 nodes of "
        "1 rank, 6 steps)"),
}  # fmt: skip


def _read_zeropp(seen: _Seen) -> None:
    stage3 = _stage(seen) == 3
    hpz = seen.value(_HPZ, 1)
    if hpz and hpz > 1 and stage3:
        seen.keep(_HPZ, APPROXIMATE, "ZeRO++ hpZ is run as plain ZeRO-3 over all data-parallel ranks: DeepSpeed's "
                  "losses and its sharding of optimizer state and gradients (measured equal on 4 ranks with groups "
                  "of 2; FSDP2 HSDP would keep twice the optimizer state per rank there). Only the backward "
                  "all-gather differs: it reads every rank's shard, not a secondary partition within groups of this "
                  "size (more inter-node traffic, no secondary copy in memory)")  # fmt: skip
    else:
        seen.inert(_HPZ, "hierarchical partitioning is off (or not ZeRO-3)")
    for key, instead in ZEROPP_QUANTIZATION.items():
        if seen.value(key, False) is True and stage3:
            seen.keep(key, APPROXIMATE, instead)
        else:
            seen.inert(key, "off, or not ZeRO-3 (DeepSpeed quantizes only ZeRO-3's communication); no effect")


def _write_hpz(cfg: TorshConfig, ctx: WriteContext) -> None:
    s = cfg.sharding
    if s.hybrid_shard_size is not None and s.stage == 3:
        ctx.put(_HPZ, s.hybrid_shard_size, "sharding.hybrid_shard_size", APPROXIMATE,
                "ZeRO++ hpZ: a secondary partition per group of this size")  # fmt: skip
    elif s.hybrid_shard_size is not None:
        ctx.note("sharding.hybrid_shard_size", UNSUPPORTED, "DeepSpeed partitions hierarchically only at stage 3",
                 s.hybrid_shard_size)  # fmt: skip
    _note_layout(cfg, ctx)


def _note_layout(cfg: TorshConfig, ctx: WriteContext) -> None:
    """FSDP's layout settings DeepSpeed has no key for: ZeRO decides them by its stage."""
    s = cfg.sharding
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


HIERARCHICAL = _group("ZeRO++ and hierarchical partitioning", (_HPZ, *ZEROPP_QUANTIZATION), (
    "sharding.hybrid_shard_size", "sharding.reshard_after_forward", "sharding.wrap", "sharding.backward_prefetch",
    "sharding.forward_prefetch", "sharding.sync_module_states"), _read_zeropp, _write_hpz)  # fmt: skip

# ------------------------------------------------------------------------------------------------
# keys read alone (hooks or the map) whose writers must run in DeepSpeed's key order

FULL_WEIGHTS = Group("full weights", (), ("checkpoint.save_full_weights",), None, _save_full_write)
CLIPPING_WRITE = Group("clipping", (), ("gradients.clip_max_norm",), None, _write_clipping)
PIPELINE_WRITE = Group("pipeline stages", (), ("parallelism.pp",), None, _write_pipeline_stages)
TENSOR_PARALLEL_WRITE = Group("tensor parallelism", (), ("parallelism.tp", "parallelism.tp_plan", "parallelism.cp",
                                                         "parallelism.dp_replicate"), None, _write_tensor_parallel)

#: Sections DeepSpeed 0.19.8 parses with pydantic models that forbid extra keys (DeepSpeedConfigModel,
#: ``extra="forbid"``): an unknown key inside one makes ``DeepSpeedConfig`` raise a ValidationError at start-up.
#: Checked against DeepSpeed 0.19.8 itself (tests/test_consumer_deepspeed_validate.py).
STRICT_SECTIONS = ("zero_optimization", "fp16", "bf16", "bfloat16", "tensorboard", "wandb", "csv_monitor", "comet",
                   "compile", "hybrid_engine", "tensor_parallel", "comms_logger", "weight_quantization")
