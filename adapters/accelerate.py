"""Hugging Face Accelerate: the ``accelerate config`` YAML (``distributed_type``, ``fsdp_config`` v1/v2,
``deepspeed_config`` inline or through ``deepspeed_config_file``), as ``accelerate launch`` (1.15) reads it.

Defaults are the launcher's, because a YAML is consumed by ``accelerate launch`` (its defaults differ from a bare
``FullyShardedDataParallelPlugin()``: ``sync_module_states``, ``use_orig_params``, ``cpu_ram_efficient_loading``
are true, ``min_num_params`` is 1e8). Known quirk: for FSDP1, ``accelerate config`` writes the sharding strategy
under ``fsdp_reshard_after_forward`` while the FSDP1 plugin reads only ``FSDP_SHARDING_STRATEGY`` (default
FULL_SHARD) - the writer emits both keys so the file means the same to every Accelerate version.

``write(cfg, version=...)``: ``"fsdp2"``, ``"fsdp1"``, ``"deepspeed"`` (inline ``deepspeed_config``) or ``"ddp"``
(``MULTI_GPU``); by default the backend follows the stage (0: ddp, 1: deepspeed - FSDP has no ZeRO-1 -, 2/3: FSDP
in the generation the config came from, else fsdp2; NVMe or optimizer-only offload, or a config read from
DeepSpeed: deepspeed).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from torsh.concepts import precision as pc
from torsh.config import AUTO, TorshConfig, get_path
from torsh.dialect import Dialect, Prepared
from torsh.errors import ConfigError, Problem
from torsh.translate import (
    NOTHING,
    Alias,
    Dropped,
    Fidelity,
    FieldMap,
    Hook,
    Ignored,
    Note,
    ReadContext,
    To,
    Translation,
    Unsupported,
    WriteContext,
    settle_auto,
    write_mapping,
)

from ._accelerate_launch import (
    _DDP_TYPES,
    _kind,
    _kind_of,
    _read_distributed_type,
    _read_gpu_ids,
    _read_nullable,
    _read_num_processes,
    _without_nulls,
)
from ._accelerate_fsdp import (
    FSDP_MAP,
    _finalize_fsdp,
    _fsdp_version,
    _remember,
    _state,
    _unread_by_version,
    _write_fsdp_rest,
    _write_fsdp_sharding,
)
from ._accelerate_parallelism import _check_parallelism_sizes, _read_megatron, _read_parallelism, write_degrees
from ._sniff import Shape, best
from ._torch_names import AUTO_SETTERS, SCRIPT_SIDE, explain_unsupported

NAME = "accelerate"
VERSIONS = ("fsdp2", "fsdp1", "deepspeed", "ddp")
DEFAULT_FORMAT = "yaml"
READS_RELATIVE_PATHS = True
_PRECISION = {"no": "fp32", "fp16": "fp16", "bf16": "bf16", "fp8": "bf16"}
# Keys Accelerate refuses next to deepspeed_config_file (ACCELERATE_CONFIG_DS_FIELDS, dataclasses.py:1507-1532).
_DS_FILE_EXCLUSIVE = ("zero_stage", "gradient_accumulation_steps", "gradient_clipping", "offload_optimizer_device",
                      "offload_param_device", "offload_optimizer_nvme_path", "offload_param_nvme_path",
                      "zero3_save_16bit_model")  # fmt: skip


# ---- reading hooks ---------------------------------------------------------------------------------


def _read_dynamo(value: Any, ctx: ReadContext, path: str) -> None:
    if value in (None, {}, "NO", "no") or (isinstance(value, dict) and str(value.get("dynamo_backend", "NO")).upper()
                                           == "NO" and set(value) <= {"dynamo_backend"}):  # fmt: skip
        ctx.note(path, Fidelity.EXACT, "no torch.compile", value)
        return
    ctx.keep(path, value)
    ctx.note(path, Fidelity.UNSUPPORTED, "torch.compile settings; torsh does not compile the model", value)


def _read_deepspeed_file(value: Any, ctx: ReadContext, path: str, base_dir: Any) -> None:
    """Read the DeepSpeed JSON the YAML points at through the deepspeed dialect; its notes are prefixed."""
    from torsh import adapters

    if "deepspeed" not in adapters.names():
        ctx.problem(path, value, "reading a DeepSpeed config file needs the deepspeed dialect, which is not "
                    "installed in this torsh; inline the settings under deepspeed_config instead")  # fmt: skip
        return
    file, where = _locate_deepspeed_file(str(value), base_dir)
    if file is None:
        ctx.problem(path, value, f"no such file: accelerate launch opens deepspeed_config_file relative to the "
                    f"working directory ({Path.cwd()}); give a path from there or an absolute one")  # fmt: skip
        return
    data = _deepspeed_json(file, ctx, path, value)
    if data is None:
        return
    if where:
        ctx.note(path, Fidelity.APPROXIMATE, where, value)
    try:
        inner = adapters.get("deepspeed").read(data)
    except ConfigError as exc:
        ctx.problems.extend(exc.with_prefix(f"{path}:{value}").problems)
        return
    ctx.note(path, Fidelity.EXACT, "read through the deepspeed dialect; its keys follow", value)
    dump = inner.result.model_dump(exclude_unset=True, exclude={"extensions"})
    from torsh.config import iter_leaves

    for core_path, item in iter_leaves(dump):
        ctx.set(core_path, item, f"{value}:{core_path}", note=False)
    for dialect, keys in inner.result.extensions.items():
        ctx.core.setdefault("extensions", {}).setdefault(dialect, {}).update(keys)
    ctx.notes.extend(replace(n, source_path=f"{value}:{n.source_path}") for n in inner.notes)


def _locate_deepspeed_file(value: str, base_dir: Any) -> tuple[Path | None, str]:
    """The file Accelerate opens (relative to the working directory), and a note when it is only found next to
    the YAML (read from there so the YAML can still be converted; accelerate launch would not find it)."""
    from torsh.formats import is_regular_file

    file = Path(value).expanduser()
    if is_regular_file(file):
        return file, ""
    if not file.is_absolute() and base_dir is not None and is_regular_file(Path(base_dir) / file):
        return Path(base_dir) / file, (f"accelerate launch opens this path relative to the working directory "
                                       f"({Path.cwd()}), where it does not exist; read from the YAML's folder: run "
                                       "accelerate launch from there or give an absolute path")  # fmt: skip
    return None, ""


def _deepspeed_json(file: Path, ctx: ReadContext, path: str, value: Any) -> dict | None:
    """The referenced file parsed as Accelerate parses it (``json.load``), or a problem that never quotes its
    content: the path may name any file (``/etc/passwd``), which must not be echoed key by key."""
    import json

    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        ctx.problem(path, value, f"cannot be read as a text file ({type(exc).__name__})")
        return None
    except json.JSONDecodeError as exc:
        ctx.problem(path, value, f"not a DeepSpeed JSON config: Accelerate reads it with json.load, which fails at "
                    f"line {exc.lineno} column {exc.colno} ({exc.msg}; comments and trailing commas are not JSON)")
        return None
    from torsh import adapters

    if not isinstance(data, dict) or adapters.get("deepspeed").sniff(data) <= 0:
        what = "a JSON object" if isinstance(data, dict) else f"a JSON {type(data).__name__}"
        ctx.problem(path, value, f"not a DeepSpeed config: the file holds {what} without DeepSpeed's keys "
                    "(train_batch_size, zero_optimization, fp16/bf16, ...)")  # fmt: skip
        return None
    return data


# ---- the map --------------------------------------------------------------------------------------

_LAUNCHER = "a launcher or environment setting, not a training setting"
TOP_MAP = {
    "compute_environment": Ignored("where the job runs (LOCAL_MACHINE, AMAZON_SAGEMAKER)"),
    "distributed_type": Hook(read=_read_distributed_type),
    "mixed_precision": Hook(read=_remember("mixed_precision", lambda v, c, p: _mixed(v, c, p))),
    "use_cpu": Ignored("runs on CPU: a device choice (torsh picks gloo without CUDA)"),
    "debug": Ignored("Accelerate's collective shape checks (ACCELERATE_DEBUG_MODE)"),
    "downcast_bf16": Ignored("TPU only"),
    "enable_cpu_affinity": Ignored(_LAUNCHER),
    "main_training_function": Ignored("the function notebook_launcher calls"),
    "num_processes": Hook(read=_read_num_processes),
    "num_machines": To("launch.nnodes"),
    "machine_rank": To("launch.node_rank"),
    "main_process_ip": Hook(read=_read_nullable("launch.master_addr")),
    "main_process_port": Hook(read=_read_nullable("launch.master_port")),
    "rdzv_backend": To("launch.rdzv_backend"),
    "same_network": Ignored("torchrun --master_addr when true, --rdzv_endpoint when false: same rendezvous"),
    **{key: Dropped(f"not a key of an Accelerate config file: accelerate launch 1.15 refuses the file (\"unknown "
                    f"keys\"); give it on the command line, accelerate launch --{key} N")
       for key in ("max_restarts", "monitor_interval", "num_cpu_threads_per_process")},
    "gpu_ids": Hook(read=lambda v, c, p: _read_gpu_ids(v, c, p)),
    "dynamo_backend": Hook(read=_read_dynamo),
    "dynamo_config": Hook(read=_read_dynamo),
    "ipex_config.*": Dropped("removed from Accelerate (IPEX is used when installed): accelerate launch 1.15 refuses a "
                             "config file with this key (\"unknown keys\"); delete it"),
    "mpirun_config.*": Ignored("mpirun launcher settings: " + _LAUNCHER),
    "megatron_lm_config.*": Hook(read=_read_megatron),
    "fp8_config.*": Unsupported("fp8 training recipes (Transformer Engine / torchao); torsh computes in bf16/fp16"),
    "parallelism_config.*": Hook(read=_read_parallelism),
    **{f"tpu_{k}": Ignored("TPU only") for k in ("env", "use_cluster", "use_sudo", "name", "zone")},
    "tpu_vm": Ignored("TPU only"),
    "commands": Ignored("TPU only"),
    "command_file": Ignored("TPU only"),
}
_NVME_REASON = ("accelerate launch does not pass this key on to the DeepSpeed plugin (no launcher exports "
                "ACCELERATE_DEEPSPEED_OFFLOAD_*_NVME_PATH); read as the file means it")
DS_MAP = {
    "deepspeed_config.deepspeed_config_file": Hook(read=_remember("ds_file")),
    "deepspeed_config.zero_stage": To("sharding.stage"),
    "deepspeed_config.offload_optimizer_device": To("offload.optimizer"),
    "deepspeed_config.offload_param_device": To("offload.params"),
    "deepspeed_config.offload_optimizer_nvme_path": To("offload.nvme_path", Fidelity.APPROXIMATE, _NVME_REASON),
    "deepspeed_config.offload_param_nvme_path": To("offload.nvme_path", Fidelity.APPROXIMATE, _NVME_REASON,
                                                   write=False),
    "deepspeed_config.gradient_accumulation_steps": To("batch.gradient_accumulation_steps"),
    "deepspeed_config.gradient_clipping": To("gradients.clip_max_norm"),
    "deepspeed_config.zero3_save_16bit_model": To("checkpoint.save_full_weights"),
    "deepspeed_config.zero3_init_flag": Ignored("deepspeed.zero.Init while the script builds the model: memory at "
                                                "start-up, not the training"),
    "deepspeed_config.deepspeed_moe_layer_cls_names": Unsupported("DeepSpeed MoE leaf modules; torsh has no MoE "
                                                                  "support"),
    "deepspeed_config.deepspeed_multinode_launcher": Ignored("pdsh / openmpi / ... : " + _LAUNCHER),
    "deepspeed_config.deepspeed_hostfile": Ignored("the hostfile path: " + _LAUNCHER),
    "deepspeed_config.deepspeed_exclusion_filter": To("launch.exclude"),
    "deepspeed_config.deepspeed_inclusion_filter": To("launch.include"),
}
FIELD_MAP = {**TOP_MAP, **FSDP_MAP, **DS_MAP}
VALUE_MAPS: dict[str, dict] = {}
#: ``accelerate launch`` adds the ``fsdp_`` prefix to fsdp_config keys that lack it (commands/launch.py:1257-1272).
ALIASES = {f"fsdp_config.{k.split('.', 1)[1].removeprefix('fsdp_')}": Alias(k, "accelerate launch adds the fsdp_ "
                                                                             "prefix") for k in FSDP_MAP}


def _mixed(value: Any, ctx: ReadContext, path: str) -> str | None:
    text = str(value).lower()
    if text not in _PRECISION:
        ctx.problem(path, value, "expected one of no, fp16, bf16, fp8")
        return None
    return text


# ---- finalizing a read: the keys that decide one core field together -----------------------------------------


_DS_DEFAULTS = {  # what Accelerate's DeepSpeed plugin uses when the YAML leaves a key out (dataclasses.py:1226-1320)
    "sharding.stage": ("deepspeed_config.zero_stage", 2, "Accelerate's default zero_stage"),
    "batch.gradient_accumulation_steps": ("deepspeed_config.gradient_accumulation_steps", AUTO, "Accelerate's "
                                          "default: the training arguments'"),
    "gradients.clip_max_norm": ("deepspeed_config.gradient_clipping", AUTO, "Accelerate's default: the training "
                                "arguments'"),
    "batch.micro_batch_size": ("deepspeed_config", AUTO, "Accelerate writes \"auto\": the dataloader's"),
    "batch.global_batch_size": ("deepspeed_config", AUTO, "Accelerate writes \"auto\": the dataloader's"),
}


def _finalize(ctx: ReadContext, base_dir: Any) -> None:
    kind, state = _kind(ctx), _state(ctx)
    _check_parallelism_sizes(ctx)
    if kind == "FSDP":
        _finalize_fsdp(ctx, state, _fsdp_version(ctx))
    elif kind == "DEEPSPEED" and "ds_file" in state:
        _read_deepspeed_file(state["ds_file"][0], ctx, state["ds_file"][1], base_dir)
    elif kind == "DEEPSPEED":
        for core_path, (source, value, reason) in _DS_DEFAULTS.items():
            if get_path(ctx.core, core_path, NOTHING) is NOTHING:
                ctx.set(core_path, value, source, Fidelity.DEFAULTED, reason)
    _finalize_precision(ctx, state, kind)


def _precision_contract(backend: str, dtype: str, stage: int) -> dict[str, Any]:
    """What ``mixed_precision: <dtype>`` means on each Accelerate backend, as core values (read sets them, write
    checks a config against them)."""
    if dtype == "fp32":
        return {}
    if backend == "ddp":  # fp32 parameters, forward under autocast
        out: dict[str, Any] = {"precision.autocast": True}
    elif backend == "deepspeed":  # parameters cast; DeepSpeed reduces in the same dtype by default
        out = {"precision.reduce_dtype": dtype, "precision.cast_forward_inputs": False}
    else:  # FSDP's MixedPrecision(Policy) with every dtype the same; v1 casts buffers too
        out = {"precision.reduce_dtype": dtype, "precision.cast_forward_inputs": True}
        if backend == "fsdp1":
            out["precision.buffer_dtype"] = dtype
    if dtype == "fp16" and backend == "deepspeed":
        out.update({"precision.loss_scaling.mode": "dynamic", "precision.loss_scaling.semantics":
                    pc.deepspeed_semantics(stage), "precision.loss_scaling.growth_interval":
                    pc.DEEPSPEED_FP16["loss_scale_window"]})  # fmt: skip
    elif dtype == "fp16":  # torch GradScaler with its defaults
        out.update({f"precision.loss_scaling.{key}": pc.GRAD_SCALER[key] for key in pc.GRAD_SCALER_RULES})
    return out


def _finalize_precision(ctx: ReadContext, state: dict, kind: str) -> None:
    found = state.get("mixed_precision")
    if found is None:
        return
    text, path, value = found
    if kind == "DEEPSPEED" and "ds_file" in state:
        ctx.note(path, Fidelity.APPROXIMATE, "with deepspeed_config_file, it fills only the file's \"auto\" fp16/bf16 "
                 "sections; the file decides", value)  # fmt: skip
        return
    reason = "fp8 runs as bf16 under FSDP/DeepSpeed (Accelerate's own fallback)" if text == "fp8" else ""
    ctx.set("precision.param_dtype", _PRECISION[text], path, Fidelity.APPROXIMATE if text == "fp8" else
            Fidelity.EXACT, reason)  # fmt: skip
    backend = {"FSDP": f"fsdp{_fsdp_version(ctx)}", "DEEPSPEED": "deepspeed"}.get(kind, "ddp")
    for core_path, item in _precision_contract(backend, _PRECISION[text], get_path(ctx.core, "sharding.stage", 0)
                                               ).items():  # fmt: skip
        ctx.set(core_path, item, path, note=False)


# ---- reading ------------------------------------------------------------------------------------------


#: An accelerate config: ``distributed_type`` or ``compute_environment``, or (less surely) its FSDP or DeepSpeed
#: section next to the launch keys.
SHAPES = tuple(Shape(ceiling, anchors, {*FIELD_MAP, *ALIASES}) for ceiling, anchors in (
    (1.0, ({"distributed_type", "compute_environment"},)),
    (0.8, ({"fsdp_config", "deepspeed_config"}, {"num_processes"}))))


def _check_ds_file_exclusive(raw: dict) -> None:
    ds = raw.get("deepspeed_config") or {}
    if _kind_of(raw.get("distributed_type", "")) == "DEEPSPEED" and "deepspeed_config_file" in ds:
        mixed = [k for k in _DS_FILE_EXCLUSIVE if k in ds]
        if mixed:
            raise ConfigError([Problem(f"deepspeed_config.{k}", ds[k], "Accelerate refuses this key next to "
                                       "deepspeed_config_file: set it in the DeepSpeed file") for k in mixed],
                              source=NAME)  # fmt: skip


def _unread_section_keys(key: str, section: dict) -> tuple[dict, list[Note], dict]:
    """Keys of an active section that no Accelerate code reads: ``accelerate launch`` copies every section key onto
    its arguments and accepts the file, so they are reported (with a did-you-mean) and kept, never refused."""
    from torsh.errors import did_you_mean

    known = {k.split(".", 1)[1] for k in FIELD_MAP if k.startswith(key + ".")}
    known |= {k.split(".", 1)[1] for k in ALIASES if k.startswith(key + ".")}
    clean, notes, kept = {}, [], {}
    for name, value in section.items():
        if name in known:
            clean[name] = value
            continue
        guess = did_you_mean(name, sorted(known))
        notes.append(Note(f"{key}.{name}", None, value, Fidelity.DROPPED, "Accelerate 1.15 reads no such key (it "
                          "accepts the file and ignores it)" + (f"; did you mean '{guess}'?" if guess else "")))
        kept[f"{key}.{name}"] = value
    return clean, notes, kept


def _inactive_sections(raw: dict) -> tuple[dict, list[Note], dict]:
    """Sections Accelerate does not read for this distributed_type, and empty ones: noted, kept, not mapped; keys of
    the active section that nothing reads: noted, kept, not mapped."""
    kind = _kind_of(raw.get("distributed_type", "NO"))
    active = {"fsdp_config": kind == "FSDP", "deepspeed_config": kind == "DEEPSPEED"}
    clean, notes, kept = {}, [], {}
    for key, value in raw.items():
        if isinstance(value, dict) and not value:
            notes.append(Note(key, None, value, Fidelity.EXACT, "empty: nothing set"))
        elif active.get(key) and isinstance(value, dict):
            clean[key], unread, unread_kept = _unread_section_keys(key, value)
            notes += unread
            kept.update(unread_kept)
        elif key in active and not active[key] and isinstance(value, dict):
            from torsh.config import iter_leaves

            for path, item in iter_leaves(value, key):
                notes.append(Note(path, None, item, Fidelity.IGNORED, f"Accelerate reads {key} only with "
                                  f"distributed_type {key.split('_')[0].upper()} (this is {kind})"))  # fmt: skip
                kept[path] = item
        else:
            clean[key] = value
    return clean, notes, kept


# ---- writing --------------------------------------------------------------------------------------------


def _backend(cfg: TorshConfig, version: str | None) -> str:
    """The Accelerate backend to write: asked for, else what the stage and offload need, else the source's."""
    if version is not None:
        return version
    s, o, sp = cfg.sharding, cfg.offload, cfg.parallelism.sp
    kept = cfg.extensions.get(NAME, {})
    if s.stage == 0 and sp == 1:
        return "ddp"
    if s.stage <= 1 or sp > 1 or "nvme" in (o.params, o.optimizer) or (o.optimizer != "none" and o.params == "none"):
        return "deepspeed"  # the only Accelerate backend with ZeRO-1, sequence parallelism (sp) and these offloads
    if kept.get("distributed_type") == "DEEPSPEED" or "deepspeed" in cfg.extensions:
        return "deepspeed"  # a DeepSpeed job stays on Accelerate's DeepSpeed backend
    return "fsdp1" if str(kept.get("fsdp_config.fsdp_version", 2)) == "1" else "fsdp2"


def _write_kind(backend: str):
    def hook(cfg: TorshConfig, ctx: WriteContext) -> None:
        stage = cfg.sharding.stage
        kept = cfg.extensions.get(NAME, {}).get("distributed_type")
        ddp_kind = kept if kept in _DDP_TYPES or (kept == "NO" and stage == 0) else "MULTI_GPU"
        kind = {"ddp": ddp_kind, "deepspeed": "DEEPSPEED"}.get(backend, "FSDP")
        if backend == "ddp" and stage > 0:
            ctx.put("distributed_type", kind, "sharding.stage", Fidelity.UNSUPPORTED, f"DDP replicates: ZeRO-{stage} "
                    "sharding is lost (write --to accelerate with the fsdp2 or deepspeed version)")  # fmt: skip
        elif backend.startswith("fsdp") and stage < 2:
            ctx.put("distributed_type", kind, "sharding.stage", Fidelity.APPROXIMATE, "FSDP cannot shard only the "
                    "optimizer state (ZeRO-1); written as ZeRO-2" if stage == 1 else "FSDP NO_SHARD (DDP-like)")
        else:
            ctx.put("distributed_type", kind, "sharding.stage", Fidelity.EXACT,
                    "" if backend != "deepspeed" else "zero_stage follows")  # fmt: skip
        if backend.startswith("fsdp"):
            ctx.put("fsdp_config.fsdp_version", int(backend[-1]), "sharding.stage")
            _write_fsdp_sharding(cfg, ctx, int(backend[-1]))
        elif backend == "deepspeed":
            ctx.put("deepspeed_config.zero_stage", stage, "sharding.stage")
            if cfg.sharding.hybrid_shard_size is not None:
                ctx.note("sharding.hybrid_shard_size", Fidelity.UNSUPPORTED, "the inline deepspeed_config has no "
                         "ZeRO++ keys: use deepspeed_config_file", cfg.sharding.hybrid_shard_size)  # fmt: skip

    return hook


def _write_deepspeed_rest(cfg: TorshConfig, ctx: WriteContext) -> None:
    o = cfg.offload
    ctx.put("deepspeed_config.offload_optimizer_device", o.optimizer, "offload.optimizer")
    ctx.put("deepspeed_config.offload_param_device", o.params, "offload.params")
    if o.nvme_path:
        for which in ("optimizer", "param"):
            if getattr(o, "params" if which == "param" else "optimizer") == "nvme":
                ctx.put(f"deepspeed_config.offload_{which}_nvme_path", o.nvme_path, "offload.nvme_path",
                        Fidelity.APPROXIMATE, _NVME_REASON)  # fmt: skip
    if not o.pin_memory and "none" not in (o.params, o.optimizer):
        ctx.note("offload.pin_memory", Fidelity.UNSUPPORTED, "the inline deepspeed_config pins offloaded memory", False)


def _write_precision(backend: str):
    def hook(cfg: TorshConfig, ctx: WriteContext) -> None:
        p = cfg.precision
        if p.param_dtype is AUTO:
            ctx.note("precision.param_dtype", Fidelity.DEFERRED, "\"auto\": mixed_precision left out (Accelerate "
                     "then runs fp32); pass accelerate launch --mixed_precision bf16|fp16, or the HF Trainer's "
                     "--bf16 / --fp16", AUTO)  # fmt: skip
            return
        name = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[p.param_dtype]
        ctx.put("mixed_precision", name, "precision.param_dtype")
        contract = _precision_contract(backend, p.param_dtype, cfg.sharding.stage)
        defaults = TorshConfig().model_dump()
        for path in _PRECISION_CLAIMS[1:]:
            want, have = contract.get(path, get_path(defaults, path)), get_path(cfg, path)
            if path == "precision.reduce_dtype":
                want, have = want or p.param_dtype, have or p.param_dtype
            if have != want:
                ctx.note(path, Fidelity.APPROXIMATE, f"Accelerate's {backend} mixed_precision={name} gives {want!r}; "
                         "set it in the script's plugin (FullyShardedDataParallelPlugin / DeepSpeedPlugin / "
                         "GradScalerKwargs) to keep it", have)  # fmt: skip

    return hook


def _write_num_processes(cfg: TorshConfig, ctx: WriteContext) -> None:
    """num_processes (and num_machines) whenever the config says how many; else a note naming the flag to pass.

    ``accelerate launch`` refuses a config file without num_processes ("You need to manually pass in
    --num_processes") unless the flag is given, so a file that cannot state it says so in its report.
    """
    from torsh.contract import config_world_size

    launch = cfg.launch
    stated = config_world_size(cfg)
    if stated is not None:
        source = "launch.world_size" if launch.world_size is not None else (
            "launch.nproc_per_node" if isinstance(launch.nproc_per_node, int) else "batch.global_batch_size")
        ctx.put("num_processes", stated[0], source, Fidelity.EXACT, f"{stated[1]}; Accelerate counts the processes "
                "of all machines")  # fmt: skip
    else:
        ctx.note("launch.world_size", Fidelity.DEFERRED, "the config does not say how many processes: num_processes "
                 "not written; pass accelerate launch --num_processes N (it refuses the file otherwise), or convert "
                 "with --world-size N", None)
    # num_machines: written from launch.nnodes when the config says; absent, Accelerate runs on one machine.


_PRECISION_CLAIMS = ("precision.param_dtype", "precision.reduce_dtype", "precision.buffer_dtype", "precision.autocast",
                     "precision.cast_forward_inputs", *(f"precision.loss_scaling.{k}" for k in (
                         "mode", "semantics", "static_scale", "initial_scale", "growth_interval", "growth_factor",
                         "backoff_factor", "hysteresis", "consecutive_hysteresis", "min_scale")))
_SHARDING_CLAIMS = ("sharding.stage", "sharding.reshard_after_forward", "sharding.hybrid_shard_size")


def _write_map(backend: str) -> FieldMap:
    common = {k: v for k, v in TOP_MAP.items() if isinstance(v, To)}
    hooks = {
        "distributed_type": Hook(write=_write_kind(backend), claims=_SHARDING_CLAIMS),
        "mixed_precision": Hook(write=_write_precision(backend), claims=_PRECISION_CLAIMS),
        "num_processes": Hook(write=_write_num_processes, claims=("launch.world_size", "launch.nproc_per_node")),
        "main_process_ip": Hook(write=lambda c, x: c.launch.master_addr and x.put(
            "main_process_ip", c.launch.master_addr, "launch.master_addr"), claims=("launch.master_addr",)),
        "main_process_port": Hook(write=lambda c, x: c.launch.master_port is not None and x.put(
            "main_process_port", c.launch.master_port, "launch.master_port"), claims=("launch.master_port",)),
        "parallelism_config.(degrees)": Hook(write=write_degrees(backend), claims=("parallelism",)),
    }
    if backend.startswith("fsdp"):
        version = int(backend[-1])
        section = {"fsdp_config.fsdp_activation_checkpointing": FSDP_MAP["fsdp_config.fsdp_activation_checkpointing"],
                   "fsdp_config.(rest)": Hook(write=_write_fsdp_rest(version), claims=(
                       "offload", "sharding.wrap", "sharding.backward_prefetch", "sharding.forward_prefetch",
                       "sharding.sync_module_states", "checkpoint.state_dict_type",
                       "activation_checkpointing.cpu_offload"))}  # fmt: skip
    elif backend == "deepspeed":
        section = {k: v for k, v in DS_MAP.items() if isinstance(v, To) and v.path.split(".")[0] not in ("offload",
                                                                                                         "sharding")}
        section["deepspeed_config.(offload)"] = Hook(write=_write_deepspeed_rest, claims=("offload",))
    else:
        section = {}
    return FieldMap({**common, **hooks, **section})


_SCRIPT_SIDE = {  # core sections an accelerate config leaves to the training script, and where they go there
    **SCRIPT_SIDE,
    "batch": "batch sizes come from the script's DataLoader and gradient_accumulation_steps argument",
    "optimizer": "Accelerate prepares the optimizer the script builds",
    "scheduler": "Accelerate prepares the scheduler the script builds",
    "gradients": "the script calls accelerator.clip_grad_norm_",
    "data": "the script builds the DataLoader",
}


def _finalize_write(backend: str):
    def finalize(ctx: WriteContext) -> None:
        settle_auto(ctx, AUTO_SETTERS, keep=("deepspeed_config.gradient_accumulation_steps",
                                             "deepspeed_config.gradient_clipping"))
        also = "; or write the DeepSpeed JSON (--to deepspeed) and name it in deepspeed_config_file"
        explain_unsupported(ctx, _SCRIPT_SIDE, also if backend == "deepspeed" else "")
        if backend == "deepspeed" and "deepspeed_config_file" in ctx.out.get("deepspeed_config", {}):
            # written inline: Accelerate refuses a deepspeed_config_file next to zero_stage & co.
            value = ctx.out["deepspeed_config"].pop("deepspeed_config_file")
            ctx.notes[:] = [n for n in ctx.notes if n.target_path != "deepspeed_config.deepspeed_config_file"]
            ctx.notes.append(Note(f"extensions.{NAME}.deepspeed_config.deepspeed_config_file", None, value,
                                  Fidelity.DROPPED, "the settings are written inline, and Accelerate refuses a "
                                  "deepspeed_config_file next to them"))  # fmt: skip
        if backend == "deepspeed":
            # "auto" is what Accelerate's plugin uses for these anyway: leave them out, as `accelerate config` does.
            for key in ("gradient_accumulation_steps", "gradient_clipping"):
                if ctx.out.get("deepspeed_config", {}).get(key) == "auto":
                    del ctx.out["deepspeed_config"][key]
            ctx.notes[:] = [n for n in ctx.notes if not (n.source_path.startswith("batch.") and
                                                        n.fidelity is Fidelity.UNSUPPORTED and n.value is AUTO)]
        # kept keys of another backend's section (e.g. fsdp_config when writing DeepSpeed) do not belong here
        other = {"fsdp_config", "deepspeed_config", "parallelism_config"} - {
            "fsdp_config" if backend.startswith("fsdp") else "deepspeed_config" if backend == "deepspeed" else "",
            "parallelism_config" if backend in ("fsdp2", "deepspeed") else ""}
        for key in sorted(other & set(ctx.out)):
            value = ctx.out.pop(key)
            ctx.notes[:] = [n for n in ctx.notes if not (n.target_path or "").startswith(key + ".")]
            ctx.notes.append(Note(f"extensions.{NAME}.{key}", None, value, Fidelity.DROPPED,
                                  f"a {key} setting; this file is written for {backend}"))  # fmt: skip
        if backend == "fsdp2":
            fc = ctx.out.get("fsdp_config", {})
            for key in ("fsdp_sharding_strategy", "fsdp_backward_prefetch", "fsdp_forward_prefetch",
                        "fsdp_use_orig_params", "fsdp_sync_module_states"):
                if key in fc:
                    ctx.notes.append(Note(f"extensions.{NAME}.fsdp_config.{key}", None, fc.pop(key), Fidelity.DROPPED,
                                          "an FSDP1 key; Accelerate ignores it with fsdp_version 2"))  # fmt: skip

    return finalize


# ---- the dialect ---------------------------------------------------------------------------------------------


class Accelerate(Dialect):
    """``accelerate config`` YAML: nulls that mean "not set" and sections Accelerate does not read for the
    ``distributed_type`` are taken out (with notes) before the map; ``deepspeed_config_file`` is read through the
    DeepSpeed dialect. The version names the backend to write (reading is told by ``distributed_type``)."""

    NAME, VERSIONS, DEFAULT_FORMAT, READS_RELATIVE_PATHS = NAME, VERSIONS, DEFAULT_FORMAT, READS_RELATIVE_PATHS
    FIELD_MAP, VALUE_MAPS, ALIASES = FIELD_MAP, VALUE_MAPS, ALIASES

    def check_version(self, version: str | None) -> str | None:
        return version  # reading: distributed_type decides; writing checks it (below)

    def shape(self, raw: Any) -> Any:
        if not isinstance(raw, dict):
            raise ConfigError([Problem("", raw, "an accelerate config must be a mapping")], source=NAME)
        if "distributed_type" not in raw:  # Accelerate's loader raises
            raise ConfigError([Problem("distributed_type", None, "Accelerate refuses a config file without it: add "
                                       "distributed_type (NO, MULTI_GPU, FSDP, DEEPSPEED, ...)")], source=NAME)
        return raw

    def check_schema(self, raw: Any) -> None:
        raw, _ = _without_nulls(raw)
        raw, _, _ = _unread_by_version(raw)
        super().check_schema(raw)
        _check_ds_file_exclusive(raw)

    def normalise(self, raw: Any, prepared: Prepared) -> Prepared:
        raw, unset = _without_nulls(raw)
        raw, unread, unread_kept = _unread_by_version(raw)
        prepared.data, notes, prepared.kept = _inactive_sections(raw)
        prepared.kept.update(unread_kept)
        notes = unread + notes
        if "num_processes" not in raw and raw.get("distributed_type") != "NO":
            notes.append(Note("num_processes", None, None, Fidelity.DEFERRED, "not set: accelerate launch asks for "
                              "--num_processes N (Accelerate gives 1 only to distributed_type 'NO')"))  # fmt: skip
        prepared.notes = unset + notes
        return prepared

    def finalize(self, ctx: ReadContext, prepared: Prepared) -> None:
        _finalize(ctx, prepared.base_dir)

    def write(self, cfg: TorshConfig, *, version: str | None = None) -> Translation[dict]:
        """Write an ``accelerate config`` YAML (as data) for the backend ``version`` names or the stage implies."""
        if version is not None and version not in VERSIONS:
            raise ConfigError([Problem("version", version, f"expected one of {', '.join(VERSIONS)}")], source=NAME)
        backend = _backend(cfg, version)
        translation = write_mapping(cfg, dialect=NAME, field_map=_write_map(backend),
                                    finalize=_finalize_write(backend))  # fmt: skip
        translation.result = {"compute_environment": "LOCAL_MACHINE", **translation.result}
        return translation

    def sniff(self, raw: Any) -> float:
        return best(SHAPES, raw)


DIALECT = Accelerate()
globals().update(DIALECT.exports())
