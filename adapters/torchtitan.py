"""torchtitan: its job-config TOML (``--job.config_file``), as torchtitan 0.2.2 reads it.

Every key of torchtitan's ``JobConfig`` is known (``schemas/keys/torchtitan.json``, generated from its source). A key
it does not define (an older torchtitan's, a fork's own) is not read: the rest of the file is, and that key gets a
dropped note where it is, saying who reads it, which ``--strict`` fails on as torchtitan 0.2.2 refuses the file for
it. The distributed meaning is read into the core model:
``[parallelism]`` degrees (FSDP over ``data_parallel_shard_degree``, HSDP with a replicate degree, DDP with shard
degree 1), ``fsdp_reshard_after_forward``, ``[training]`` mixed precision, batch sizes, clipping and CPU offload,
``[optimizer]``, ``[activation_checkpoint]`` and the start-up timeout. Every other key is ignored as "not a
distributed setting" and kept, so a file read and written back keeps it. torchtitan's defaults matter: a file that
says nothing trains with FSDP over every rank, bfloat16 parameters and selective activation checkpointing.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from torsh.concepts import sharding
from torsh.concepts.dtypes import core_dtype
from torsh.concepts.offload import fsdp_cpu_offload
from torsh.config import TorshConfig
from torsh.dialect import Dialect, Prepared
from torsh.translate import Fidelity, Group, Ignored, Note, Seen, To, Unsupported, WriteContext, settle_auto

from ._sniff import Shape, best

NAME = "torchtitan"
_NOT_DISTRIBUTED = "not a distributed setting"
_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@cache
def key_table() -> dict[str, Any]:
    """torchtitan 0.2.2's sections and keys (generated from its source; torchtitan itself is never imported)."""
    from torsh import schemas

    return json.loads((Path(schemas.__file__).parent / "keys" / "torchtitan.json").read_text("utf-8"))


def _default(section: str, key: str) -> Any:
    return key_table()["sections"][section][key].get("default")


# ---- data parallelism: the degrees and the reshard policy decide the sharding together -------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _degrees(seen: Seen) -> tuple[Any, Any, Any] | None:
    """The replicate and shard degrees and the reshard policy, kept as written; None after a problem."""
    ctx = seen.ctx
    for key in ("data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward"):
        if seen.has(f"parallelism.{key}"):  # written back as the file had them (a default stays spelt out)
            ctx.keep(f"parallelism.{key}", seen.value(f"parallelism.{key}"))
    replicate = seen.value("parallelism.data_parallel_replicate_degree", 1)
    shard = seen.value("parallelism.data_parallel_shard_degree", -1)
    bad = [(k, v) for k, v in (("data_parallel_replicate_degree", replicate), ("data_parallel_shard_degree", shard))
           if not _is_int(v) or v == 0 or v < -1]  # fmt: skip
    for key, value in bad:
        ctx.problem(f"parallelism.{key}", value, "a degree is a positive number of ranks, or -1 for the ranks the "
                    "other degrees leave")  # fmt: skip
    reshard = seen.value("parallelism.fsdp_reshard_after_forward", "default")
    if reshard not in ("default", "always", "never"):
        ctx.problem("parallelism.fsdp_reshard_after_forward", reshard, "expected default, always or never")
        return None
    return None if bad else (replicate, shard, reshard)


def _read_data_parallel(seen: Seen) -> None:
    degrees = _degrees(seen)
    if degrees is None:
        return
    replicate, shard, reshard = degrees
    stage = 0 if shard == 1 else sharding.stage_of_reshard(sharding.TORCHTITAN_RESHARD[reshard] is not False)
    why = ("data_parallel_shard_degree 1: DDP over the replicate degree" if stage == 0 else
           f"fully_shard over the data-parallel shard dimension, reshard_after_forward {reshard}: ZeRO-{stage}")
    seen.set("parallelism.data_parallel_shard_degree", "sharding.stage", stage, reason=why, default=stage)
    _read_replicas(seen, stage, replicate, shard)
    if stage == 0:
        seen.inert("parallelism.fsdp_reshard_after_forward", "no effect without FSDP (shard degree 1)")
    else:
        seen.drop("parallelism.fsdp_reshard_after_forward", f"{reshard}: ZeRO-{stage}", Fidelity.EXACT)
    _read_model_degrees(seen)


def _read_replicas(seen: Seen, stage: int, replicate: int, shard: int) -> None:
    """The replicate degree: HSDP's replicas (of shard groups of a known size, or of the remaining ranks) or DDP."""
    key = "parallelism.data_parallel_replicate_degree"
    if stage and replicate != 1 and shard == -1:
        seen.set(key, "parallelism.dp_replicate", replicate, reason=f"HSDP: {replicate} replicas of shard groups of "
                 "the remaining ranks")  # fmt: skip
    elif stage and replicate != 1:
        seen.set(key, "sharding.hybrid_shard_size", shard, reason=f"HSDP: {replicate} replicas of {shard}-rank shard "
                 "groups")  # fmt: skip
    else:
        seen.inert(key, "1: no replication beyond the shard dimension" if replicate == 1 else "DDP: replicated over "
                   "every rank")  # fmt: skip


#: torchtitan's model-parallel degrees -> the core degree, the fidelity and why.
_MODEL_DEGREES = {
    "tensor_parallel_degree": ("parallelism.tp", Fidelity.APPROXIMATE, "DTensor tensor parallelism of the linear "
                               "layers; the default plan splits torchtitan's attention.wq/wk/wv/wo and "
                               "feed_forward.w1/w2/w3 as torchtitan does, but not its embedding, norms (sequence "
                               "parallel) or output head (loss parallel), which stay replicated"),
    "pipeline_parallel_degree": ("parallelism.pp", Fidelity.EXACT, "pipeline stages"),
    "context_parallel_degree": ("parallelism.cp", Fidelity.APPROXIMATE, "context parallelism: each sequence split "
                                "over the cp ranks, attention over the whole of it, inside the engine's "
                                "context_parallel block; its parts are contiguous where torchtitan load-balances "
                                "them (the same training)"),
}


def _read_model_degrees(seen: Seen) -> None:
    for key, (core, fidelity, reason) in _MODEL_DEGREES.items():
        path = f"parallelism.{key}"
        value = seen.value(path, 1)
        if not _is_int(value) or value < 1:
            seen.ctx.problem(path, value, "a degree is a positive number of ranks")
        elif value == 1:
            seen.inert(path, "1: no such parallelism")
        else:
            seen.set(path, core, value, fidelity, reason)

def _write_model_degrees(cfg: TorshConfig, ctx: WriteContext) -> int:
    """torchtitan's model-parallel degrees; returns their product (what the data-parallel degrees leave)."""
    par, product = cfg.parallelism, 1
    for key, (core, _, _) in _MODEL_DEGREES.items():
        value = getattr(par, core.split(".")[1])
        if _is_int(value) and value > 1:
            ctx.put(f"parallelism.{key}", value, core)
            product *= value
        elif value != 1:
            ctx.note(core, Fidelity.UNSUPPORTED, "torchtitan's degrees are numbers", value)
    if par.tp_plan:
        ctx.note("parallelism.tp_plan", Fidelity.UNSUPPORTED, "torchtitan's tensor-parallel plan is its model's "
                 "parallelize function, not a setting", par.tp_plan)  # fmt: skip
    return product


def _write_data_parallel(cfg: TorshConfig, ctx: WriteContext) -> None:
    s, world = cfg.sharding, cfg.launch.world_size
    model = _write_model_degrees(cfg, ctx)
    if _is_int(world) and world % model == 0:
        world //= model  # the data-parallel ranks
    elif _is_int(world):
        ctx.note("parallelism", Fidelity.UNSUPPORTED, f"the model-parallel degrees ({model}) do not divide the world "
                 f"size {world}", model)  # fmt: skip
        world = None
    if s.stage == 0:
        _write_ddp(world, ctx)
        return
    if s.stage == 1:
        ctx.note("sharding.stage", Fidelity.APPROXIMATE, "FSDP cannot shard only the optimizer state (ZeRO-1): "
                 "written as ZeRO-2 (same numerics, less memory)", 1)  # fmt: skip
    if s.stage < 3 or s.reshard_after_forward is False:  # torchtitan's ZeRO-2 is FSDP that never reshards
        ctx.put("parallelism.fsdp_reshard_after_forward", "never", "sharding.stage", Fidelity.EXACT, "ZeRO-2")
    if cfg.parallelism.dp_replicate is not None:
        ctx.put("parallelism.data_parallel_replicate_degree", cfg.parallelism.dp_replicate, "parallelism.dp_replicate",
                Fidelity.EXACT, "HSDP over the remaining ranks (data_parallel_shard_degree -1)")  # fmt: skip
    elif s.hybrid_shard_size is not None:
        _write_hybrid(s.hybrid_shard_size, world, ctx)


def _write_ddp(world: Any, ctx: WriteContext) -> None:
    """Stage 0: torchtitan's DDP is one replica per rank (shard degree 1), which needs the world size."""
    if _is_int(world):
        ctx.put("parallelism.data_parallel_shard_degree", 1, "sharding.stage", Fidelity.EXACT, "DDP")
        ctx.put("parallelism.data_parallel_replicate_degree", world, "launch.world_size", Fidelity.EXACT,
                "DDP: one replica per rank")  # fmt: skip
    else:
        ctx.note("sharding.stage", Fidelity.APPROXIMATE, "torchtitan's DDP needs data_parallel_replicate_degree = the "
                 "world size, which the config does not know: written as FSDP over every rank (same numerics)", 0)


def _write_hybrid(size: Any, world: Any, ctx: WriteContext) -> None:
    mesh = sharding.hybrid_mesh(size, world)
    if mesh is None:
        ctx.note("sharding.hybrid_shard_size", Fidelity.UNSUPPORTED, "torchtitan's HSDP degrees are numbers: needs a "
                 "known shard group size that divides a known world size", size)  # fmt: skip
        return
    ctx.put("parallelism.data_parallel_shard_degree", mesh[1], "sharding.hybrid_shard_size")
    ctx.put("parallelism.data_parallel_replicate_degree", mesh[0], "sharding.hybrid_shard_size", Fidelity.EXACT,
            "HSDP: world size / shard group size")  # fmt: skip


def _read_other_degree(value: Any, ctx: Any, path: str) -> None:
    if value in (1, -1) and path.endswith("_degree"):
        ctx.keep(path, value)
        ctx.note(path, Fidelity.EXACT, "1: no such parallelism", value)
    else:
        ctx.keep(path, value)
        ctx.note(path, Fidelity.UNSUPPORTED, "expert parallelism is not run by torsh", value)


def _read_rotate_method(value: Any, ctx: Any, path: str) -> None:
    """torchtitan's context-parallel rotation: torsh all-gathers the keys and values either way."""
    ctx.keep(path, value)
    exact = value == "allgather"
    ctx.note(path, Fidelity.EXACT if exact else Fidelity.APPROXIMATE, "torsh all-gathers the keys and values over "
             "the context-parallel group" + ("" if exact else ": the same attention, other communication"), value)


# ---- precision -------------------------------------------------------------------------------------------------


def _read_precision(seen: Seen) -> None:
    for key, core in (("mixed_precision_param", "precision.param_dtype"),
                      ("mixed_precision_reduce", "precision.reduce_dtype")):
        value = seen.value(f"training.{key}", _default("training", key))
        dtype = core_dtype(value)
        if dtype is None or dtype == "fp16":
            seen.ctx.problem(f"training.{key}", value, "torchtitan takes bfloat16 or float32")
            continue
        seen.set(f"training.{key}", core, dtype, reason="applied by fully_shard's MixedPrecisionPolicy",
                 default=dtype)  # fmt: skip
    value = seen.value("training.dtype", "float32")
    dtype = core_dtype(value)
    if dtype in ("fp32", "bf16"):
        seen.set("training.dtype", "precision.master_dtype", dtype, reason="parameters and optimizer state are kept "
                 "in this dtype", default=dtype)  # fmt: skip
        seen.ctx.set("precision.optimizer_state_dtype", dtype, "training.dtype", note=False)
    else:
        seen.ctx.problem("training.dtype", value, "torchtitan takes bfloat16 or float32")


def _write_precision(cfg: TorshConfig, ctx: WriteContext) -> None:
    p = cfg.precision
    param = "bf16" if p.param_dtype == "fp16" else p.param_dtype
    if p.param_dtype == "fp16":
        ctx.note("precision.param_dtype", Fidelity.APPROXIMATE, "torchtitan computes in bfloat16 or float32 (no loss "
                 "scaling): written as bfloat16", "fp16")  # fmt: skip
    if isinstance(param, str):
        ctx.put("training.mixed_precision_param", _DTYPES[param], "precision.param_dtype")
    reduce = p.reduce_dtype or "fp32"
    if reduce != "fp32":
        ctx.note("precision.reduce_dtype", Fidelity.APPROXIMATE, "torchtitan reduces gradients in float32", reduce)
    if p.master_dtype in _DTYPES and p.master_dtype != "fp32":
        ctx.put("training.dtype", _DTYPES[p.master_dtype], "precision.master_dtype")


# ---- optimizer -------------------------------------------------------------------------------------------------


def _read_optimizer(seen: Seen) -> None:
    ctx = seen.ctx
    for key in ("name", "lr", "eps", "weight_decay"):
        seen.set(f"optimizer.{key}", f"optimizer.{key}", seen.value(f"optimizer.{key}", _default("optimizer", key)))
    betas = (seen.value("optimizer.beta1", 0.9), seen.value("optimizer.beta2", 0.95))
    ctx.set("optimizer.betas", betas, "optimizer.beta1", Fidelity.EXACT if seen.has("optimizer.beta1") else
            Fidelity.DEFAULTED, "with beta2: Adam's betas" if seen.has("optimizer.beta1") else "not set; torchtitan "
            "default (0.9, 0.95)")  # fmt: skip
    seen.take("optimizer.beta1")
    if seen.has("optimizer.beta2"):
        seen.drop("optimizer.beta2", "with beta1: Adam's betas", Fidelity.EXACT)


def _write_optimizer(cfg: TorshConfig, ctx: WriteContext) -> None:
    o = cfg.optimizer
    if o is None:
        ctx.note("optimizer", Fidelity.APPROXIMATE, "no optimizer in the config: torchtitan uses its default AdamW "
                 "(lr 8e-4, betas (0.9, 0.95), weight decay 0.1)", None)  # fmt: skip
        return
    for key in ("name", "lr", "eps", "weight_decay"):
        value = getattr(o, key)
        if value is not None:
            ctx.put(f"optimizer.{key}", value, f"optimizer.{key}")
    if isinstance(o.betas, tuple):
        ctx.put("optimizer.beta1", o.betas[0], "optimizer.betas")
        ctx.put("optimizer.beta2", o.betas[1], "optimizer.betas")
    if o.momentum is not None or o.kwargs:
        ctx.note("optimizer", Fidelity.UNSUPPORTED, "torchtitan's optimizer section has name, lr, betas, eps and "
                 "weight_decay only", o.momentum if o.momentum is not None else o.kwargs)  # fmt: skip


# ---- activation checkpointing ------------------------------------------------------------------------------------


def _read_checkpointing(seen: Seen) -> None:
    mode = seen.value("activation_checkpoint.mode", "selective")
    if mode not in ("selective", "full", "memory_budget", "none"):
        seen.ctx.problem("activation_checkpoint.mode", mode, "expected selective, full, memory_budget or none")
        return
    exact = mode in ("full", "none")
    if not exact:  # written back as it was when the file is written to torchtitan again
        seen.ctx.keep("activation_checkpoint.mode", mode)
    seen.set("activation_checkpoint.mode", "activation_checkpointing.enabled", mode != "none",
             Fidelity.EXACT if exact else Fidelity.APPROXIMATE, "" if exact else f"{mode}: torchtitan recomputes "
             "some operators of each block; torsh checkpoints whole blocks", default=True)  # fmt: skip


def _write_checkpointing(cfg: TorshConfig, ctx: WriteContext) -> None:
    kept = cfg.extensions.get(NAME, {}).get("activation_checkpoint.mode")
    mode = (kept or "full") if cfg.activation_checkpointing.enabled else "none"
    ctx.put("activation_checkpoint.mode", mode, "activation_checkpointing.enabled", Fidelity.EXACT,
            "as in the source file" if kept and mode == kept else "torchtitan's default is selective: written out")
    if cfg.activation_checkpointing.cpu_offload:
        ctx.note("activation_checkpointing.cpu_offload", Fidelity.UNSUPPORTED, "torchtitan keeps checkpointed "
                 "activations on the device", True)  # fmt: skip


def _read_offload(value: Any, ctx: Any, path: str) -> None:
    if value is True:
        ctx.set("offload.params", "cpu", path, Fidelity.EXACT, "fully_shard's CPUOffloadPolicy: parameters, "
                "gradients and optimizer state on the CPU")  # fmt: skip
        ctx.set("offload.optimizer", "cpu", path, note=False)
    elif value is False:
        ctx.note(path, Fidelity.EXACT, "no offload", value, "offload")
    else:
        ctx.problem(path, value, "expected true or false")


def _write_offload(cfg: TorshConfig, ctx: WriteContext) -> None:
    o = cfg.offload
    switch, why = fsdp_cpu_offload(o.params, o.optimizer, "torchtitan")
    if switch is None:
        ctx.note("offload", Fidelity.UNSUPPORTED, why, f"{o.params}/{o.optimizer}")
    elif switch:
        ctx.put("training.enable_cpu_offload", True, "offload.params", Fidelity.APPROXIMATE if why else
                Fidelity.EXACT, why)  # fmt: skip


# ---- the map -----------------------------------------------------------------------------------------------------


def _global_batch(value: Any, ctx: Any, path: str) -> None:
    if value == -1:
        ctx.note(path, Fidelity.EXACT, "-1: the local batch size times the data-parallel degree (no accumulation)",
                 value)  # fmt: skip
    else:
        ctx.set("batch.global_batch_size", value, path, Fidelity.EXACT, "gradient accumulation makes up the rest")


_GROUPS = (
    Group("data parallelism", ("parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree",
                               "parallelism.fsdp_reshard_after_forward", "parallelism.tensor_parallel_degree",
                               "parallelism.pipeline_parallel_degree", "parallelism.context_parallel_degree"),
          ("sharding.stage", "sharding.hybrid_shard_size", "sharding.reshard_after_forward", "parallelism"),
          _read_data_parallel, _write_data_parallel),
    Group("precision", ("training.mixed_precision_param", "training.mixed_precision_reduce", "training.dtype"),
          ("precision",), _read_precision, _write_precision),
    Group("optimizer", tuple(f"optimizer.{k}" for k in ("name", "lr", "eps", "weight_decay", "beta1", "beta2")),
          ("optimizer",), _read_optimizer, _write_optimizer),
    Group("activation checkpointing", ("activation_checkpoint.mode",), ("activation_checkpointing",),
          _read_checkpointing, _write_checkpointing),
)  # fmt: skip

_MEANING = {
    **{f"parallelism.{k}": _read_other_degree for k in key_table()["sections"]["parallelism"]
       if k.endswith("_degree") and not k.startswith("data_parallel")},
    "parallelism.context_parallel_rotate_method": _read_rotate_method,
    "training.enable_cpu_offload": _read_offload,
    "training.global_batch_size": _global_batch,
}
_RULES = {
    "training.local_batch_size": To("batch.micro_batch_size", reason="per rank, per step"),
    "training.max_norm": To("gradients.clip_max_norm"),
    "comm.init_timeout_seconds": To("communication.timeout_s", Fidelity.APPROXIMATE, "the collective timeout at "
                                    "start-up; torchtitan lowers it to train_timeout_seconds after the first step"),
    "compile.enable": Unsupported("torch.compile; torsh does not compile the model"),
    "optimizer.implementation": Ignored("fused / foreach / for-loop: the same update, at another speed"),
    "optimizer.early_step_in_backward": Unsupported("the optimizer steps each parameter during backward"),
    "checkpoint.async_mode": Ignored("how checkpoints are saved in the background; " + _NOT_DISTRIBUTED),
}


def _extension_key(module: str):
    """A key torchtitan defines only in an extension ``JobConfig``: ConfigManager merges the fields of the module
    ``job.custom_config_module`` names (on the command line, else in the file) and refuses any other key ("Invalid
    field names"). A file that does not name the module runs only with ``--job.custom_config_module`` given, as
    torchtitan's own launch scripts give it for some of their files."""
    table = key_table()
    alias = next((name for name, target in table.get("extension_aliases", {}).items() if target == module), module)

    def read(value: Any, ctx: Any, path: str) -> None:
        job = ctx.raw.get("job") if isinstance(ctx.raw.get("job"), dict) else {}
        named = job.get("custom_config_module")
        ctx.keep(path, value)
        if named in (module, alias):
            ctx.note(path, Fidelity.IGNORED, f"read by torchtitan with job.custom_config_module = {named!r}; "
                     + _NOT_DISTRIBUTED, value)  # fmt: skip
        elif named is None:
            ctx.note(path, Fidelity.DEFERRED, f"torchtitan reads it only from the extension {module!r}, which the "
                     f"file does not name: pass --job.custom_config_module {alias} on the command line (torchtitan "
                     "refuses the file without it: \"Invalid field names\"), or write custom_config_module = "
                     f"{alias!r} in [job]", value)  # fmt: skip
        else:
            ctx.note(path, Fidelity.DROPPED, f"torchtitan reads it only from the extension {module!r}; with "
                     f"job.custom_config_module = {named!r} it refuses the file (\"Invalid field names\") unless "
                     f"--job.custom_config_module {alias} is given on the command line", value)  # fmt: skip

    return read


#: What the sections whose keys do not change the distributed plan configure (each key's ignored note says it).
_WHAT_SECTIONS_SET = {
    "job": "the run's description and output folder", "profiling": "profiler traces and memory snapshots",
    "metrics": "what is logged and where", "model": "which model and tokenizer are built",
    "lr_scheduler": "the learning-rate schedule (warm-up and decay)",
    "validation": "evaluation on held-out data every few steps", "checkpoint": "when and where checkpoints are saved",
    "training": "the data, sequence length and number of steps", "compile": "what torch.compile compiles",
    "debug": "determinism and debugging switches", "memory_estimation": "a dry run that estimates memory",
    "fault_tolerance": "TorchFT fault tolerance", "comm": "collective timeouts and tracing",
    "experimental": "experimental extension modules",
}  # fmt: skip


def _field_map() -> dict[str, Any]:
    """Every key of every section: its meaning, or ignored (kept for the round trip)."""
    from torsh.translate import Hook

    grouped = {key for group in _GROUPS for key in group.keys}
    fmap: dict[str, Any] = {}
    table = key_table()
    sections = dict(table["sections"])
    for module, extra in table["extensions"].items():
        for section, keys in extra.items():
            for key in keys:
                if key not in sections.get(section, {}):
                    fmap[f"{section}.{key}"] = Hook(read=_extension_key(module))
    for section, keys in sections.items():
        for key in keys:
            path = f"{section}.{key}"
            if path in grouped:  # read by its group
                continue
            if path in _MEANING:
                fmap[path] = Hook(read=_MEANING[path])
            elif path in _RULES:
                fmap[path] = _RULES[path]
            elif section in ("parallelism", "activation_checkpoint", "float8") or section.startswith("quantize"):
                fmap[path] = Ignored("used only with the parallelism or quantisation it configures")
            else:
                fmap[path] = Ignored(f"{_WHAT_SECTIONS_SET.get(section.split('.')[0], 'a job setting')}; "
                                     f"{_NOT_DISTRIBUTED}")  # fmt: skip
    return fmap


def _write_rest(cfg: TorshConfig, ctx: WriteContext) -> None:
    _write_offload(cfg, ctx)
    _write_batch(cfg, ctx)
    clip = cfg.gradients.clip_max_norm
    if isinstance(clip, (int, float)):
        ctx.put("training.max_norm", clip, "gradients.clip_max_norm")


def _write_batch(cfg: TorshConfig, ctx: WriteContext) -> None:
    """Local batch, and the global one that makes torchtitan accumulate what the source accumulates."""
    b = cfg.batch
    if isinstance(b.micro_batch_size, int):
        ctx.put("training.local_batch_size", b.micro_batch_size, "batch.micro_batch_size")
    steps, world = b.gradient_accumulation_steps, cfg.launch.world_size
    if isinstance(b.global_batch_size, int):
        ctx.put("training.global_batch_size", b.global_batch_size, "batch.global_batch_size")
    elif _is_int(steps) and steps > 1 and _is_int(b.micro_batch_size) and _is_int(world):
        ctx.put("training.global_batch_size", b.micro_batch_size * steps * world, "batch.gradient_accumulation_steps",
                Fidelity.EXACT, f"torchtitan accumulates global / (local x {world} ranks) = {steps} micro-batches")
    if _is_int(steps) and steps > 1 and not isinstance(b.global_batch_size, int) and not _is_int(world):
        ctx.note("batch.gradient_accumulation_steps", Fidelity.APPROXIMATE, "torchtitan accumulates global_batch_size"
                 f" / (local_batch_size x ranks) micro-batches: set global_batch_size = local_batch_size x {steps} x "
                 "the number of ranks", steps)  # fmt: skip


#: Keys of torchtitan job configs from before 0.2 (its 2024 TOMLs, and forks of its 2025 versions) that torchtitan
#: 0.2.2 refuses, each with what replaced it: data, so a file of any torchtitan version is recognised and told what to
#: rename. The degrees that moved from [training] / [experimental] to [parallelism] are found by name
#: (``_moved_to_parallelism``).
RENAMED_BEFORE_0_2: dict[str, str | None] = {  # None: removed
    "float8": "[quantize.linear.float8] (and model.converters = [\"quantize.linear.float8\"] to turn it on)",
    "float8.enable_float8_linear": "model.converters = [\"quantize.linear.float8\"]",
    "checkpoint.enable_checkpoint": "checkpoint.enable",
    "checkpoint.model_weights_only": "checkpoint.last_save_model_only",
    "checkpoint.interval_type": "checkpoint.interval (always in steps now; remove interval_type)",
    "validation.enabled": "validation.enable",
    "training.batch_size": "training.local_batch_size",
    "training.warmup_steps": "lr_scheduler.warmup_steps",
    "training.compile": "compile.enable (with compile.components)",
    "training.enable_loss_parallel": "parallelism.disable_loss_parallel (inverted)",
    "metrics.enable_color_printing": "metrics.disable_color_printing (inverted)",
    "model.norm_type": None,  # the model flavor decides its norm
    "job.use_for_integration_test": None,
    "training.data_parallel_degree": "parallelism.data_parallel_shard_degree",
    "lr_scheduler.lr_min": "lr_scheduler.min_lr_factor",
}
#: The last torchtitan that reads an old key (read in its git history); the others went before its first release.
LAST_READ_BY = {
    **dict.fromkeys(("float8", "checkpoint.enable_checkpoint", "training.compile", "job.use_for_integration_test",
                     "lr_scheduler.lr_min"), "torchtitan 0.1.0"),
    "validation.enabled": "torchtitan's main branch between 0.1.0 and 0.2.0",
}  # fmt: skip
_BEFORE_0_1 = "torchtitan before 0.1.0 (2024)"


def _old(path: str) -> str:
    return f"read by {LAST_READ_BY.get(path, _BEFORE_0_1)}; torchtitan 0.2.2 refuses it"


def _moved_to_parallelism(section: str, key: str) -> str | None:
    parallelism = key_table()["sections"]["parallelism"]
    return f"parallelism.{key}" if section in ("training", "experimental") and key in parallelism else None


def _renamed_keys(raw: Any) -> list:
    """One problem per key of a pre-0.2 torchtitan file, naming its current spelling (torchtitan 0.2.2 refuses
    such a file naming only its first unknown section)."""
    from torsh.errors import Problem

    sections, problems = key_table()["sections"], []
    for section, table in raw.items():
        if section in RENAMED_BEFORE_0_2 and section not in sections:
            problems.append(Problem(section, table, f"an old torchtitan section ({_old(section)}): write "
                                    f"{RENAMED_BEFORE_0_2[section]}"))  # fmt: skip
        if not isinstance(table, dict):
            continue
        for key, value in table.items():
            path = f"{section}.{key}"
            if key in sections.get(section, {}):
                continue
            current = _moved_to_parallelism(section, key) or RENAMED_BEFORE_0_2.get(path, "")
            plain = current if current and " " not in current else None  # a dotted path: the did-you-mean
            if current:
                problems.append(Problem(path, value, f"an old torchtitan name ({_old(path)})" +
                                        ("" if plain else f": write {current}"), plain))  # fmt: skip
            elif path in RENAMED_BEFORE_0_2:
                problems.append(Problem(path, value, f"removed from torchtitan ({_old(path)}): delete it"))
    return problems


def _is_old(path: str) -> bool:
    """A key ``_renamed_keys`` reports (anything inside an old section too)."""
    section, _, key = path.partition(".")
    return section in RENAMED_BEFORE_0_2 or path in RENAMED_BEFORE_0_2 or bool(key and _moved_to_parallelism(
        section, key))  # fmt: skip


@cache
def _defined() -> dict[str, frozenset[str]]:
    """section -> the keys and sections torchtitan 0.2.2 defines in it, its extension modules' included ("": top)."""
    table, known = key_table(), {"": set(key_table()["sections"])}
    for sections in (table["sections"], *table["extensions"].values()):
        for section, keys in sections.items():
            known.setdefault(section, set()).update(keys)
            parent, _, leaf = section.rpartition(".")
            known.setdefault(parent, set()).add(leaf)
    return {section: frozenset(keys) for section, keys in known.items()}


def _foreign_keys(raw: Any) -> list:
    """One problem per key that neither torchtitan 0.2.2 (with its extension modules) nor an older torchtitan torsh
    knows defines: a fork's own key (llama-mimi's training.task, YNNtitan's [dataloader]) or a misspelling."""
    from torsh.errors import Problem, did_you_mean

    table, defined = key_table(), _defined()
    module = (raw.get("job") if isinstance(raw.get("job"), dict) else {}).get("custom_config_module")
    theirs = module and module not in table["extensions"] and module not in table.get("extension_aliases", {})
    owner = (f"the module [job] custom_config_module names ({module!r}, which torsh does not read)" if theirs
             else "a fork's JobConfig (or the module [job] custom_config_module names)")  # fmt: skip

    def walk(node: dict, section: str) -> list:
        found = []
        for key, value in node.items():
            path = f"{section}.{key}" if section else str(key)
            if path in defined and isinstance(value, dict):
                found += walk(value, path)
            elif key not in defined.get(section, ()) and not _is_old(path):
                where = f"[{section}] key" if section else "section"
                found.append(Problem(path, value, f"torchtitan 0.2.2 defines no such {where} and torsh knows no "
                                     f"torchtitan that did (0.2.2 refuses it): {owner} may define it",
                                     did_you_mean(str(key), defined.get(section, ()))))  # fmt: skip
        return found

    return walk(raw, "")


def _unknown_keys(raw: Any) -> list:
    """One problem per key torchtitan 0.2.2 does not define: an older torchtitan's spelling or a fork's own key."""
    return _renamed_keys(raw) + _foreign_keys(raw)


def _unknown_note(problem: Any) -> Note:
    """A key torchtitan 0.2.2 lacks, in a file that is torchtitan's: not read, not written back (torchtitan 0.2.2
    would refuse the written file for it), and lossy, so ``--strict`` fails on it as torchtitan refuses the file."""
    hint = f"; did you mean '{problem.suggestion}'?" if problem.suggestion else ""
    return Note(problem.path, None, problem.value, Fidelity.DROPPED, f"{problem.reason}; not read, and not written "
                f"back{hint}", refused=True)  # fmt: skip


def _without(node: Any, paths: set[str], prefix: str = "") -> dict:
    """``node`` without the keys at ``paths`` (dotted as ``_unknown_keys`` spells them)."""
    out = {}
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if path not in paths:
            out[key] = _without(value, paths, path) if isinstance(value, dict) else value
    return out


#: The checks torchtitan 0.2.2's JobConfig sections make when ConfigManager builds them (their __post_init__), on
#: keys the reader otherwise keeps without a meaning: key -> (test of the value, what torchtitan says).
POST_INIT_CHECKS = {
    "validation.steps": (lambda v: not _is_int(v) or v > 0 or v == -1, "validation steps must be positive or -1"),
    "parallelism.context_parallel_load_balancer": (lambda v: v != "", "cannot be an empty string; leave it out "
                                                   "to disable load balancing"),
}


def _post_init_problems(raw: Any) -> list:
    from torsh.errors import Problem

    problems = []
    for key, (ok, why) in POST_INIT_CHECKS.items():
        section, leaf = key.split(".")
        table = raw.get(section)
        if isinstance(table, dict) and leaf in table and not ok(table[leaf]):
            problems.append(Problem(key, table[leaf], f"{why} (torchtitan refuses the file)"))
    return problems


def _keys_of(sections: dict[str, Any]) -> set[str]:
    """Every section and key of a key table, dotted (``quantize.linear.float8.recipe_name``)."""
    return {path for section, keys in sections.items() for path in (section, *(f"{section}.{k}" for k in keys))}


def _current_keys() -> set[str]:
    table = key_table()
    return _keys_of(table["sections"]).union(*(_keys_of(extra) for extra in table["extensions"].values()))


def _older_keys() -> set[str]:
    """What torchtitan files from before 0.2 hold that 0.2.2 does not define (a removed section: all of it)."""
    moved = {f"{section}.{key}" for section in ("training", "experimental") for key in key_table()["sections"]
             ["parallelism"]}  # as _moved_to_parallelism finds them
    return {*RENAMED_BEFORE_0_2, *moved, *(f"{k}.*" for k in RENAMED_BEFORE_0_2 if "." not in k)}


_ANCHORS = ({"job", "parallelism"}, {"job", "model", "training"})
#: A torchtitan job config, of torchtitan 0.2.2 (above the FSDP dialect's transcriptions of such files, 0.95) or of
#: any version (below them: the FSDP dialect reads a transcription without refusing its old sections; above a torsh
#: seed-layout file, 0.9).
SHAPES = (
    Shape(0.97, _ANCHORS, _current_keys(), tables={"job", "parallelism", "model", "training"}),
    Shape(0.92, _ANCHORS, _current_keys() | _older_keys(), tables={"job", "parallelism", "model", "training"}),
)
#: A file read as torchtitan without its anchors (``--from torchtitan`` on a fragment) is still torchtitan's when
#: this layout fits it: mostly keys of some torchtitan version.
_ANY_LAYOUT = Shape(0.92, (), _current_keys() | _older_keys())


def _is_torchtitans(raw: Any) -> bool:
    """Whether a file read as torchtitan is one: it names a section torchtitan 0.2.2 defines, and few keys none
    defines. Its unknown keys are then noted; in any other file (another framework's, given with --from torchtitan)
    each is an error."""
    return any(key in key_table()["sections"] for key in raw) and _ANY_LAYOUT.confidence(raw) > 0


class Torchtitan(Dialect):
    NAME = NAME
    DEFAULT_FORMAT = "toml"
    FIELD_MAP = _field_map()
    GROUPS = _GROUPS
    SCHEMA_NAMES_UNKNOWN_KEYS = False  # noted where they are, with who reads them (normalise)

    def check_schema(self, raw: Any) -> None:
        """The checks torchtitan makes as it builds its sections, then the schema's types and ranges; keys torchtitan
        0.2.2 does not define are errors only in a file that is not torchtitan's (``_is_torchtitans``)."""
        problems = _post_init_problems(raw)
        if not _is_torchtitans(raw):
            problems = _unknown_keys(raw) + problems
        if problems:
            from torsh.errors import ConfigError

            raise ConfigError(problems, source=NAME)
        super().check_schema(raw)

    def normalise(self, raw: Any, prepared: Prepared) -> Prepared:
        """A key torchtitan 0.2.2 does not define (an older torchtitan's, a fork's) is a dropped note where it is, with
        who reads it; the map reads the rest of the file."""
        unknown = _unknown_keys(raw)
        if unknown:
            prepared.data = _without(raw, {p.path for p in unknown})
            prepared.notes = [_unknown_note(p) for p in unknown]
        return prepared

    def write_map(self, version: str | None):
        from torsh.translate import FieldMap, Hook

        return FieldMap({"(settings)": Hook(write=_write_rest, claims=(
            "offload", "batch", "gradients.clip_max_norm")),
            "comm.init_timeout_seconds": _RULES["comm.init_timeout_seconds"]}, groups=_GROUPS)

    def finish_write(self, ctx: WriteContext, version: str | None) -> None:
        from ._torch_names import AUTO_SETTERS

        settle_auto(ctx, AUTO_SETTERS)

    def sniff(self, raw: Any) -> float:
        """A torchtitan job config: [job] or [parallelism], with [job], [model] or [training] (see ``SHAPES``)."""
        return best(SHAPES, raw)


DIALECT = Torchtitan()
globals().update(DIALECT.exports())
