"""PyTorch FSDP: ``FullyShardedDataParallel`` (FSDP1) kwargs and ``fully_shard`` (FSDP2) kwargs as a mapping.

Two layouts are read, told apart by content:

* FSDP1: the keyword arguments of ``FullyShardedDataParallel(module, ...)`` at the top level, plus
  ``state_dict_type`` (what ``FSDP.set_state_dict_type`` is given);
* FSDP2: ``{"fully_shard": {kwargs}, "apply_to": [...], "state_dict_type": ...}`` - ``apply_to`` names the module
  classes sharded bottom-up before the root (FSDP2 has no ``auto_wrap_policy``).

Enums may be spelt ``"FULL_SHARD"``, ``"ShardingStrategy.FULL_SHARD"`` or by their integer value; dtypes
``"bfloat16"`` or ``"torch.bfloat16"``; a device mesh is ``{"shape": [replicate, shard], "dim_names": [...]}``.
Values that are Python expressions of the training script are reported and kept, never guessed. The FSDP settings
of trainer frameworks (HF ``TrainingArguments``, torchtune recipes, torchtitan job configs) are read too, through
the maps in ``_fsdp_frameworks``.
``write(cfg, version="fsdp1" | "fsdp2")`` writes either generation (default FSDP2; also the dialects ``fsdp1`` and
``fsdp2``); :func:`snippet` prints the ``fully_shard`` calls a user pastes into a training script.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torsh.concepts import dtypes, sharding
from torsh.config import AUTO, TorshConfig, get_path
from torsh.dialect import Dialect, Prepared
from torsh.errors import ConfigError, Problem
from torsh.translate import (
    NOTHING,
    Note,
    Fidelity,
    FieldMap,
    Hook,
    Ignored,
    ReadContext,
    To,
    Translation,
    Unsupported,
    WriteContext,
    check_version,
    settle_auto,
    write_mapping,
)

from . import _fsdp_frameworks as frameworks
from ._sniff import Shape, best, top_keys
from ._torch_names import (
    AUTO_SETTERS,
    DTYPES,
    NO_SHARD_REASON,
    SHARDING_STRATEGIES,
    STRATEGY_ALIASES,
    SCRIPT_SIDE,
    enum_name,
    explain_unsupported,
    mesh_description,
    mesh_shard_size,
    prune_defaults,
    split_expressions,
    to_bool,
)

NAME = "fsdp"
VERSIONS = ("fsdp2", "fsdp1")
DEFAULT_FORMAT = "json"
STATE_DICT_TYPES = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")
BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST")
MESH_NAMES = ("dp_replicate", "dp_shard")
_HYBRID_CLAIMS = ("sharding.stage", "sharding.reshard_after_forward", "sharding.hybrid_shard_size")


def _state(ctx: Any) -> dict[str, Any]:
    return ctx.__dict__.setdefault("_fsdp", {})


# ---- reading hooks ---------------------------------------------------------------------------------


def _read_strategy(value: Any, ctx: ReadContext, path: str) -> None:
    name = enum_name(value, SHARDING_STRATEGIES, "ShardingStrategy", ctx, path, STRATEGY_ALIASES)
    if name is None:
        return
    stage, hybrid = sharding.FSDP1_LAYOUTS[name]
    reason = NO_SHARD_REASON if name == "NO_SHARD" else f"{name}: ZeRO-{stage}" + (" within each shard group, "
                                                                                  "replicated across" if hybrid else "")
    ctx.set("sharding.stage", stage, path, Fidelity.APPROXIMATE if name == "NO_SHARD" else Fidelity.EXACT, reason)
    _state(ctx)["hybrid"] = hybrid


def _read_mesh(value: Any, ctx: ReadContext, path: str) -> None:
    found = mesh_shard_size(value, ctx, path)
    if found is None:
        return
    ndim, size = found
    _state(ctx)["mesh_ndim"] = ndim
    if size is not None:
        ctx.set("sharding.hybrid_shard_size", size, f"{path}.shape", Fidelity.EXACT,
                "dim 1 of a 2-D mesh shards, dim 0 replicates")  # fmt: skip


def _read_reshard(value: Any, ctx: ReadContext, path: str) -> None:
    if value is None:
        ctx.set("sharding.stage", 3, path, Fidelity.EXACT, "None (torch 2.13): the root keeps its parameters, every "
                "other module reshards - ZeRO-3")  # fmt: skip
    elif isinstance(value, bool):
        stage = sharding.stage_of_reshard(value)
        ctx.set("sharding.stage", stage, path, Fidelity.EXACT, f"ZeRO-{stage}")
    elif isinstance(value, int) and value > 1:
        ctx.set("sharding.stage", 3, path, Fidelity.APPROXIMATE, "an int reshards to groups of that size after "
                "forward (ZeRO++ hpZ)")  # fmt: skip
        ctx.set("sharding.hybrid_shard_size", value, path, Fidelity.APPROXIMATE, "hpZ keeps gradients and "
                "optimizer state sharded over all ranks; torsh's hybrid group shards them within the group")
    else:
        to_bool(value, ctx, path)


def _read_cpu_offload(value: Any, ctx: ReadContext, path: str) -> None:
    """FSDP1 ``CPUOffload(offload_params=...)``: given as a bool, a mapping, or null."""
    flag = value.get("offload_params", False) if isinstance(value, dict) else value
    if isinstance(value, dict) and set(value) - {"offload_params"}:
        ctx.problem(path, value, "CPUOffload has one field, offload_params")
        return
    where = f"{path}.offload_params" if isinstance(value, dict) else path
    if flag is None:
        ctx.note(where, Fidelity.EXACT, "no offload", None, "offload")
        return
    from ._torch_names import EXPRESSION_REASON, is_expression

    if is_expression(flag):
        ctx.keep(where, flag)
        ctx.note(where, Fidelity.DROPPED, EXPRESSION_REASON, flag)
        return
    flag = to_bool(flag, ctx, where)
    if flag:
        ctx.set("offload.params", "cpu", where, Fidelity.EXACT, "parameters and gradients live on the CPU")
        ctx.set("offload.optimizer", "cpu", where, Fidelity.EXACT, "so the optimizer step runs on the CPU")
    elif flag is False:
        ctx.note(where, Fidelity.EXACT, "no offload", flag, "offload")


def _read_offload_policy(value: Any, ctx: ReadContext, path: str) -> None:
    """FSDP2 ``offload_policy``: ``CPUOffloadPolicy(pin_memory=...)`` (a mapping or the call) or ``OffloadPolicy()``.
    """
    text = str(value).replace(" ", "") if isinstance(value, str) else None
    if value is None or text in ("OffloadPolicy()", "OffloadPolicy"):
        ctx.note(path, Fidelity.EXACT, "no offload", value, "offload")
        return
    pin = True
    if isinstance(value, dict):
        unknown = set(value) - {"pin_memory"}
        if unknown:
            ctx.problem(path, value, "CPUOffloadPolicy has one field, pin_memory")
            return
        pin = to_bool(value.get("pin_memory", True), ctx, f"{path}.pin_memory")
    elif text not in ("CPUOffloadPolicy()", "CPUOffloadPolicy", "CPUOffloadPolicy(pin_memory=True)",
                      "CPUOffloadPolicy(pin_memory=False)"):  # fmt: skip
        ctx.problem(path, value, "expected null, OffloadPolicy(), CPUOffloadPolicy() or {\"pin_memory\": bool}")
        return
    else:
        pin = "False" not in text
    ctx.set("offload.params", "cpu", path, Fidelity.EXACT, "parameters, gradients and optimizer state on the CPU")
    ctx.set("offload.optimizer", "cpu", path, Fidelity.EXACT, "the optimizer step runs on the CPU")
    ctx.set("offload.pin_memory", pin, path, Fidelity.EXACT, "", note=False)


def _read_wrap(value: Any, ctx: ReadContext, path: str) -> None:
    """``auto_wrap_policy`` / ``apply_to``: class names (a list or ``transformer_layer_cls``) or ``min_num_params``."""
    if value is None:
        ctx.note(path, Fidelity.APPROXIMATE, "no wrapping: one sharding unit for the whole model; torsh wraps each "
                 "direct child that holds parameters", None)  # fmt: skip
        return
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list):
        classes = [v for v in value if isinstance(v, str) and v.isidentifier() and v[:1].isupper()]
        if len(classes) != len(value):
            ctx.keep(path, value)
            ctx.note(path, Fidelity.DROPPED, "module paths or expressions, not class names: which modules the "
                     "script shards is not in the file; torsh wraps each direct child that holds parameters", value)
            return
        ctx.set("sharding.wrap.module_classes", classes, path)
        return
    if not isinstance(value, dict) or not value or set(value) - {"transformer_layer_cls", "module_classes",
                                                                  "min_num_params"}:  # fmt: skip
        ctx.problem(path, value, "expected a list of module class names, {\"transformer_layer_cls\": [...]} or "
                    "{\"min_num_params\": N}")  # fmt: skip
        return
    for key, item in value.items():
        if key == "min_num_params":
            ctx.set("sharding.wrap.min_num_params", item, f"{path}.{key}", Fidelity.EXACT,
                    "size_based_auto_wrap_policy")
        else:
            ctx.set("sharding.wrap.module_classes", list(item), f"{path}.{key}", Fidelity.EXACT,
                    "transformer_auto_wrap_policy / ModuleWrapPolicy")  # fmt: skip


def _read_backward_prefetch(value: Any, ctx: ReadContext, path: str) -> None:
    if value is None:
        ctx.set("sharding.backward_prefetch", "none", path, Fidelity.EXACT, "None disables backward prefetch")
        return
    name = enum_name(value, BACKWARD_PREFETCH, "BackwardPrefetch", ctx, path)
    if name:
        ctx.set("sharding.backward_prefetch", name.lower(), path)


def _read_state_dict_type(value: Any, ctx: ReadContext, path: str) -> None:
    name = enum_name(value, STATE_DICT_TYPES, "StateDictType", ctx, path)
    if name == "LOCAL_STATE_DICT":
        ctx.set("checkpoint.state_dict_type", "sharded", path, Fidelity.APPROXIMATE, "LOCAL_STATE_DICT (each rank's "
                "flat shard) is not supported by FSDP2 or torch.distributed.checkpoint; read as a sharded state "
                "dict, which also reshards on load")  # fmt: skip
    elif name:
        ctx.set("checkpoint.state_dict_type", name.split("_")[0].lower(), path)


def _read_low_precision_grads(value: Any, ctx: ReadContext, path: str) -> None:
    if to_bool(value, ctx, path):
        ctx.keep(path, value)
        ctx.note(path, Fidelity.UNSUPPORTED, "gradients stay in param_dtype for the optimizer step; torsh gives the "
                 "optimizer fp32 gradients of its fp32 master weights", value)  # fmt: skip
    else:
        ctx.note(path, Fidelity.EXACT, "gradients are upcast for the optimizer step (the default)", value)


def _read_output_dtype(value: Any, ctx: ReadContext, path: str) -> None:
    if value is None:
        ctx.note(path, Fidelity.EXACT, "outputs are left as computed (the default)", None)
        return
    ctx.keep(path, value)
    ctx.note(path, Fidelity.UNSUPPORTED, "FSDP2 casts forward outputs to this dtype; torsh leaves outputs as "
             "computed", value)  # fmt: skip


def _read_cast(value: Any, ctx: ReadContext, path: str) -> None:
    """FSDP1 casts inputs at every module (cast_forward_inputs) or at the root only (cast_root_forward_inputs,
    default True); either way the model's inputs reach it in param_dtype, which is the one core switch."""
    flag = to_bool(value, ctx, path)
    if flag is not None:
        _state(ctx)[path.rsplit(".", 1)[-1]] = flag
        ctx.note(path, Fidelity.EXACT, "with the other FSDP1 cast flag: precision.cast_forward_inputs", value,
                 "precision.cast_forward_inputs")  # fmt: skip


# ---- the map --------------------------------------------------------------------------------------

_DTYPE_MAP = {**DTYPES, None: None}
_PARAM_DTYPE_MAP = {**DTYPES, None: "fp32"}  # None: no cast, the parameters' own (fp32) dtype
_NOT_A_SETTING = "how the script builds the model or the process group, not a training setting"

#: FSDP1 ``FullyShardedDataParallel`` kwargs.
FSDP1_MAP = {
    "sharding_strategy": Hook(read=_read_strategy),
    "device_mesh": Hook(read=_read_mesh),
    "process_group": Unsupported("a process group object built by the script; describe hybrid sharding with "
                                 "device_mesh.shape instead"),
    "cpu_offload": Hook(read=_read_cpu_offload),
    "auto_wrap_policy": Hook(read=_read_wrap),
    "backward_prefetch": Hook(read=_read_backward_prefetch),
    "mixed_precision.param_dtype": To("precision.param_dtype", reason="parameters in forward/backward and the "
                                      "all-gather"),
    "mixed_precision.reduce_dtype": To("precision.reduce_dtype", reason="None: the param_dtype"),
    "mixed_precision.buffer_dtype": To("precision.buffer_dtype"),
    "mixed_precision.keep_low_precision_grads": Hook(read=_read_low_precision_grads),
    "mixed_precision.cast_forward_inputs": Hook(read=_read_cast),
    "mixed_precision.cast_root_forward_inputs": Hook(read=_read_cast),
    "mixed_precision._module_classes_to_ignore": Unsupported("these modules (default: BatchNorm) run in full "
                                                             "precision under FSDP1; torsh casts every module"),
    "ignored_modules": Unsupported("these modules' parameters stay unsharded; torsh shards every parameter"),
    "ignored_states": Unsupported("these parameters stay unsharded; torsh shards every parameter"),
    "param_init_fn": Ignored("how the script materialises meta-device modules; " + _NOT_A_SETTING),
    "device_id": Ignored("the device comes from the launcher (LOCAL_RANK); " + _NOT_A_SETTING),
    "sync_module_states": To("sharding.sync_module_states", default=False),
    "forward_prefetch": To("sharding.forward_prefetch", default=False),
    "limit_all_gathers": Ignored("a rate limiter of FSDP1's all-gathers: memory, not results; FSDP2 needs none"),
    "use_orig_params": Ignored("exposes the original parameters (torch.compile, per-parameter optimizer groups); "
                               "FSDP2 always does"),
}
#: FSDP2 ``fully_shard`` kwargs, the modules it is applied to, and the checkpoint form.
FSDP2_MAP = {
    "fully_shard.mesh": Hook(read=_read_mesh),
    "fully_shard.reshard_after_forward": Hook(read=_read_reshard),
    "fully_shard.shard_placement_fn": Unsupported("per-parameter placements; torsh shards every parameter on dim 0"),
    "fully_shard.mp_policy.param_dtype": To("precision.param_dtype", reason="parameters in forward/backward and the "
                                            "all-gather"),
    "fully_shard.mp_policy.reduce_dtype": To("precision.reduce_dtype", reason="None: the param_dtype"),
    "fully_shard.mp_policy.output_dtype": Hook(read=_read_output_dtype),
    "fully_shard.mp_policy.cast_forward_inputs": To("precision.cast_forward_inputs", default=True),
    "fully_shard.offload_policy": Hook(read=_read_offload_policy),
    "fully_shard.ignored_params": Unsupported("these parameters stay unsharded; torsh shards every parameter"),
    "fully_shard.dp_mesh_dims": Unsupported("an SPMD mesh whose parameters are already DTensors (tensor/pipeline "
                                            "parallel jobs); torsh builds a data-parallel mesh"),
    "mesh": Hook(read=_read_mesh),
    "apply_to": Hook(read=_read_wrap),
}
_SHARED = {"state_dict_type": Hook(read=_read_state_dict_type)}
#: Both generations (what is read). In this union FSDP2's entries are not part of the derived reverse map, so that
#: it stays one-to-one; each generation is written with its own map (``_V1_WRITE`` / ``_V2_WRITE``).
FIELD_MAP = {**FSDP1_MAP, **{k: replace(v, write=False) if isinstance(v, To) else v for k, v in FSDP2_MAP.items()},
             **_SHARED}
VALUE_MAPS = {k: _PARAM_DTYPE_MAP if k.endswith("param_dtype") else _DTYPE_MAP
              for k in FIELD_MAP if k.endswith(("param_dtype", "reduce_dtype", "buffer_dtype"))}
ALIASES: dict[str, str] = {}
_READ_MAPS = {"fsdp1": FieldMap({**FSDP1_MAP, **_SHARED}), "fsdp2": FieldMap({**FSDP2_MAP, **_SHARED})}
_KNOWN = frozenset(s.lower() for s in (*SHARDING_STRATEGIES, *STRATEGY_ALIASES, *STATE_DICT_TYPES, *BACKWARD_PREFETCH,
                                       "CPUOffloadPolicy()", "CPUOffloadPolicy", "OffloadPolicy()", "OffloadPolicy",
                                       "CPUOffloadPolicy(pin_memory=True)", "CPUOffloadPolicy(pin_memory=False)"))


def _finalize_read(version: str):
    def finalize(ctx: ReadContext) -> None:
        state = _state(ctx)
        if get_path(ctx.core, "sharding.stage", NOTHING) is NOTHING:
            reason = ("FSDP1 default FULL_SHARD" if version == "fsdp1" else
                      "fully_shard default reshard_after_forward=None: ZeRO-3 (the root keeps its parameters)")
            ctx.set("sharding.stage", 3, "sharding_strategy" if version == "fsdp1" else
                    "fully_shard.reshard_after_forward", Fidelity.DEFAULTED, reason)  # fmt: skip
        hybrid_size = get_path(ctx.core, "sharding.hybrid_shard_size", NOTHING)
        if version == "fsdp1" and state.get("hybrid") and hybrid_size is NOTHING:
            ctx.set("sharding.hybrid_shard_size", AUTO, "device_mesh", Fidelity.DEFERRED, "HYBRID_SHARD without a "
                    "device mesh shards within each node: the ranks of one node, known at start-up")  # fmt: skip
        if version == "fsdp1" and state.get("mesh_ndim") == 2 and state.get("hybrid") is False:
            ctx.problem("device_mesh", ctx.raw.get("device_mesh"), "a 2-D device mesh needs sharding_strategy "
                        "HYBRID_SHARD or _HYBRID_SHARD_ZERO2")  # fmt: skip
        if version == "fsdp1" and hybrid_size is not NOTHING and not state.get("hybrid"):
            ctx.core["sharding"].pop("hybrid_shard_size")
        if version == "fsdp1" and isinstance(ctx.raw.get("mixed_precision"), dict):
            cast = state.get("cast_forward_inputs", False) or state.get("cast_root_forward_inputs", True)
            ctx.set("precision.cast_forward_inputs", cast, "mixed_precision", Fidelity.DEFAULTED,
                    "FSDP1 casts the root module's inputs unless cast_root_forward_inputs is False", note=False)
        defaults = {
            "sharding.backward_prefetch": ("backward_prefetch", "backward_pre", "FSDP1 default BACKWARD_PRE")
            if version == "fsdp1" else ("fully_shard", "backward_pre", "FSDP2 prefetches the next all-gather in "
                                        "backward (BACKWARD_PRE-like)"),
            "checkpoint.state_dict_type": ("state_dict_type", "full" if version == "fsdp1" else "sharded",
                                           "FSDP1 default FULL_STATE_DICT" if version == "fsdp1" else
                                           "FSDP2 state dicts are sharded (DTensor)"),
            "sharding.sync_module_states": ("sync_module_states" if version == "fsdp1" else "fully_shard", False,
                                            "no broadcast from rank 0 at start-up"),
        }  # fmt: skip
        for core_path, (source, value, reason) in defaults.items():
            if get_path(ctx.core, core_path, NOTHING) is NOTHING:
                ctx.set(core_path, value, source, Fidelity.DEFAULTED, reason)

    return finalize


#: Accelerate also has a top-level mixed_precision, but as one of its strings.
_ACCELERATE_PRECISION = ("no", "fp16", "bf16", "fp8")
#: FSDP2's fully_shard layout (1), a trainer framework's FSDP settings (0.95), FSDP1's keyword arguments (0.9).
SHAPES = (
    Shape(1.0, ({"fully_shard"},), FIELD_MAP, tables={"fully_shard"}),
    *frameworks.SHAPES.values(),
    Shape(0.9, ({*top_keys(FSDP1_MAP), "state_dict_type"},), {*FSDP1_MAP, "state_dict_type"},
          where=lambda raw: str(raw.get("mixed_precision")).lower() not in _ACCELERATE_PRECISION),
)


def layout(raw: Any) -> str:
    """``fsdp2`` when the mapping holds ``fully_shard`` (or ``apply_to``), a trainer framework's name when it uses
    that framework's vocabulary (``hf_trainer``, ``torchtune``, ``torchtitan``), else ``fsdp1``."""
    if not isinstance(raw, dict):
        return "fsdp1"
    if {"fully_shard", "apply_to"} & set(raw):
        return "fsdp2"
    return frameworks.layout(raw) or "fsdp1"


# ---- writing --------------------------------------------------------------------------------------


def _write_strategy(cfg: TorshConfig, ctx: WriteContext) -> None:
    s = cfg.sharding
    name = sharding.fsdp1_strategy(s.stage, s.reshard_after_forward, s.hybrid_shard_size is not None)
    if s.stage == 0:
        ctx.put("sharding_strategy", name, "sharding.stage", Fidelity.APPROXIMATE, NO_SHARD_REASON)
        return
    if s.hybrid_shard_size is not None:
        _write_hybrid_mesh(cfg, ctx)
    fidelity, reason = (Fidelity.APPROXIMATE, _ZERO1_REASON) if s.stage == 1 else (Fidelity.EXACT, "")
    ctx.put("sharding_strategy", name, "sharding.stage", fidelity, reason)


#: Why FSDP1's HYBRID_SHARD without a mesh is fine or not: with an auto_wrap_policy or without one.
_NODE_GROUPS = {True: (Fidelity.EXACT, "HYBRID_SHARD without a mesh shards within each node"),
                False: (Fidelity.APPROXIMATE, "HYBRID_SHARD without a mesh: FSDP1 builds the node-local groups only "
                        "with an auto_wrap_policy and refuses it otherwise; pass device_mesh=init_device_mesh(device, "
                        "(world size // LOCAL_WORLD_SIZE, LOCAL_WORLD_SIZE)) in the script")}  # fmt: skip


def _write_hybrid_mesh(cfg: TorshConfig, ctx: WriteContext) -> None:
    """FSDP1's device_mesh for a hybrid strategy (none for groups of "each node" when the size is not known)."""
    s, size = cfg.sharding, node_shard_size(cfg)
    if size is AUTO:
        wrapped = bool(s.wrap.module_classes or s.wrap.min_num_params)
        ctx.notes.append(Note("sharding.hybrid_shard_size", None, AUTO, *_NODE_GROUPS[wrapped]))
        return
    ctx.put("device_mesh", mesh_description(size, _mesh_names(cfg)), "sharding.hybrid_shard_size", Fidelity.EXACT,
            "dim 0 replicates, dim 1 shards; -1: the remaining ranks" + (
                f"; \"auto\" (each node) resolved to the {size} processes per node"
                if s.hybrid_shard_size is AUTO else ""))  # fmt: skip


def _write_reshard(cfg: TorshConfig, ctx: WriteContext) -> None:
    s = cfg.sharding
    if s.stage == 0:
        ctx.note("sharding.stage", Fidelity.UNSUPPORTED, "fully_shard has no replicate-only mode: use DDP "
                 "(DistributedDataParallel) for stage 0", 0)  # fmt: skip
        return
    if s.stage == 1:
        ctx.put("fully_shard.reshard_after_forward", False, "sharding.stage", Fidelity.APPROXIMATE, _ZERO1_REASON)
    else:
        ctx.put("fully_shard.reshard_after_forward", bool(s.effective_reshard_after_forward), "sharding.stage")
    size = node_shard_size(cfg)
    if size is not None:
        mesh = mesh_description(size, _mesh_names(cfg))
        ctx.put("fully_shard.mesh", mesh, "sharding.hybrid_shard_size", Fidelity.EXACT,
                "HSDP: dim 0 replicates, dim 1 shards; -1: the remaining ranks" + (
                    f"; \"auto\" (each node) resolved to the {size} processes per node" if
                    s.hybrid_shard_size is AUTO and size is not AUTO else ""))  # fmt: skip


def node_shard_size(cfg: TorshConfig) -> Any:
    """The hybrid shard group size to write: the number, or for "auto" (each node) the processes per node when the
    config knows them, else AUTO; None without hybrid sharding."""
    size, per_node = cfg.sharding.hybrid_shard_size, cfg.launch.nproc_per_node
    if size is AUTO and isinstance(per_node, int) and not isinstance(per_node, bool):
        return per_node
    return size


def _mesh_names(cfg: TorshConfig) -> tuple[str, str]:
    """The source file's mesh dimension names when it had a 2-D mesh, else torsh's."""
    kept = cfg.extensions.get(NAME, {})
    for key in ("device_mesh.dim_names", "fully_shard.mesh.dim_names", "mesh.dim_names"):
        names = kept.get(key)
        if isinstance(names, list) and len(names) == 2:
            return tuple(names)
    return MESH_NAMES


_ZERO1_REASON = ("FSDP cannot shard only the optimizer state (ZeRO-1); written as ZeRO-2 (also shards gradients "
                 "and, between steps, parameters): same numerics, less memory, different communication")


def _write_offload(target: str, cfg: TorshConfig, ctx: WriteContext) -> None:
    o = cfg.offload
    if "nvme" in (o.params, o.optimizer):
        ctx.note("offload.params" if o.params == "nvme" else "offload.optimizer", Fidelity.UNSUPPORTED,
                 "FSDP offloads to CPU memory only; NVMe offload is DeepSpeed ZeRO-Infinity", "nvme")  # fmt: skip
        return
    if o.params == "none" and o.optimizer == "none":
        return
    if o.params == "none":
        ctx.note("offload.optimizer", Fidelity.UNSUPPORTED, "FSDP cannot offload only the optimizer state (DeepSpeed "
                 "ZeRO-Offload): offloading puts parameters, gradients and optimizer on the CPU together", "cpu")
        return
    fidelity = Fidelity.EXACT if o.optimizer == "cpu" else Fidelity.APPROXIMATE
    reason = "" if o.optimizer == "cpu" else "FSDP offload also moves the optimizer step to the CPU"
    if target == "fsdp1":
        ctx.put("cpu_offload.offload_params", True, "offload.params", fidelity, reason)
        if not o.pin_memory:
            ctx.note("offload.pin_memory", Fidelity.UNSUPPORTED, "FSDP1 CPUOffload always pins memory", False)
    else:
        ctx.put("fully_shard.offload_policy", {"pin_memory": o.pin_memory}, "offload.params", fidelity, reason)


def _write_wrap(target: str, cfg: TorshConfig, ctx: WriteContext) -> None:
    wrap = cfg.sharding.wrap
    key = "auto_wrap_policy" if target == "fsdp1" else "apply_to"
    if wrap.module_classes and wrap.min_num_params:
        ctx.note("sharding.wrap.min_num_params", Fidelity.UNSUPPORTED, "one policy: wrapped by class names",
                 wrap.min_num_params)  # fmt: skip
    if wrap.module_classes:
        value = {"transformer_layer_cls": list(wrap.module_classes)} if target == "fsdp1" else list(wrap.module_classes)
        ctx.put(key, value, "sharding.wrap.module_classes")
    elif wrap.min_num_params:
        ctx.put(f"{key}.min_num_params", wrap.min_num_params, "sharding.wrap.min_num_params")


def _write_backward_prefetch(target: str, cfg: TorshConfig, ctx: WriteContext) -> None:
    value = cfg.sharding.backward_prefetch
    if target == "fsdp1":
        if value is not None:
            ctx.put("backward_prefetch", None if value == "none" else value.upper(), "sharding.backward_prefetch")
        return
    if value in ("backward_post", "none"):
        ctx.note("sharding.backward_prefetch", Fidelity.APPROXIMATE, "FSDP2 always prefetches one module ahead in "
                 "backward (BACKWARD_PRE-like); set_modules_to_backward_prefetch changes the order", value)  # fmt: skip
    elif value is not None:
        ctx.note("sharding.backward_prefetch", Fidelity.EXACT, "FSDP2's implicit prefetch", value)


def _write_fsdp2_runtime(cfg: TorshConfig, ctx: WriteContext) -> None:
    """FSDP1 constructor options that FSDP2 turned into calls around fully_shard (the snippet makes them)."""
    s = cfg.sharding
    _write_backward_prefetch("fsdp2", cfg, ctx)
    if s.forward_prefetch:
        ctx.note("sharding.forward_prefetch", Fidelity.APPROXIMATE, "no fully_shard argument: FSDP2 prefetches "
                 "forward all-gathers with set_modules_to_forward_prefetch (the snippet calls it)", True)  # fmt: skip
    if s.sync_module_states:
        ctx.note("sharding.sync_module_states", Fidelity.APPROXIMATE, "no fully_shard argument: broadcast rank 0's "
                 "weights with set_model_state_dict(..., broadcast_from_rank0=True) (the snippet does)", True)
    if cfg.precision.buffer_dtype is not None:
        ctx.note("precision.buffer_dtype", Fidelity.UNSUPPORTED, "FSDP2 does not manage buffers: they keep the dtype "
                 "the script gives them", cfg.precision.buffer_dtype)  # fmt: skip


def _write_cast_v1(cfg: TorshConfig, ctx: WriteContext) -> None:
    p = cfg.precision
    if p.param_dtype == "fp32" and p.reduce_dtype in (None, "fp32") and p.buffer_dtype in (None, "fp32"):
        return
    if p.cast_forward_inputs:
        ctx.note("precision.cast_forward_inputs", Fidelity.EXACT, "FSDP1 casts the root's inputs by default", True)
    else:
        ctx.put("mixed_precision.cast_root_forward_inputs", False, "precision.cast_forward_inputs")


def _write_state_dict(cfg: TorshConfig, ctx: WriteContext) -> None:
    ctx.put("state_dict_type", f"{cfg.checkpoint.state_dict_type.upper()}_STATE_DICT", "checkpoint.state_dict_type")


_OFFLOAD = ("offload",)
_V1_WRITE = FieldMap({
    "sharding_strategy": Hook(write=_write_strategy, claims=_HYBRID_CLAIMS),
    "cpu_offload": Hook(write=lambda c, x: _write_offload("fsdp1", c, x), claims=_OFFLOAD),
    "auto_wrap_policy": Hook(write=lambda c, x: _write_wrap("fsdp1", c, x), claims=("sharding.wrap",)),
    "backward_prefetch": Hook(write=lambda c, x: _write_backward_prefetch("fsdp1", c, x),
                              claims=("sharding.backward_prefetch",)),
    "state_dict_type": Hook(write=_write_state_dict, claims=("checkpoint.state_dict_type",)),
    "mixed_precision.cast_root_forward_inputs": Hook(write=_write_cast_v1, claims=("precision.cast_forward_inputs",)),
    **{k: v for k, v in FSDP1_MAP.items() if isinstance(v, To)},
})  # fmt: skip
_V2_WRITE = FieldMap({
    "fully_shard.reshard_after_forward": Hook(write=_write_reshard, claims=_HYBRID_CLAIMS),
    "fully_shard.offload_policy": Hook(write=lambda c, x: _write_offload("fsdp2", c, x), claims=_OFFLOAD),
    "apply_to": Hook(write=lambda c, x: _write_wrap("fsdp2", c, x), claims=("sharding.wrap",)),
    "(runtime calls)": Hook(write=_write_fsdp2_runtime, claims=(
        "sharding.backward_prefetch", "sharding.forward_prefetch", "sharding.sync_module_states",
        "precision.buffer_dtype")),
    "state_dict_type": Hook(write=_write_state_dict, claims=("checkpoint.state_dict_type",)),
    **{k: v for k, v in FSDP2_MAP.items() if isinstance(v, To)},
})  # fmt: skip
_WRITE_DEFAULTS = {
    "fsdp1": {"backward_prefetch": "BACKWARD_PRE", "state_dict_type": "FULL_STATE_DICT", "sync_module_states": False,
              "forward_prefetch": False},
    "fsdp2": {"state_dict_type": "SHARDED_STATE_DICT", "fully_shard.mp_policy.cast_forward_inputs": True},
}
_WRITE_VALUES = {k: {torch_name: core for core, torch_name in dtypes.TORCH.items()} for k in VALUE_MAPS}


def _finalize_write(version: str):
    def finalize(ctx: WriteContext) -> None:
        settle_auto(ctx, AUTO_SETTERS)
        prune_defaults(ctx, _WRITE_DEFAULTS[version])
        explain_unsupported(ctx, SCRIPT_SIDE)
        mp = get_path(ctx.out, "fully_shard.mp_policy")
        if isinstance(mp, dict) and set(mp) == {"cast_forward_inputs"}:
            # Without a param_dtype, cast_forward_inputs casts to nothing: leave mp_policy at its default.
            del ctx.out["fully_shard"]["mp_policy"]
            ctx.notes[:] = [n if n.target_path != "fully_shard.mp_policy.cast_forward_inputs" else
                            Note(n.source_path, None, n.value, Fidelity.EXACT, "no effect without a param_dtype")
                            for n in ctx.notes]  # fmt: skip

    return finalize


def _drop_other_generation(translation: Translation[dict], version: str) -> None:
    """Kept keys of the other generation (or of a trainer framework) were restored as-is: notes instead."""
    own = {k.split(".")[0] for k in (FSDP1_MAP if version == "fsdp1" else FSDP2_MAP)} | {"state_dict_type"}
    for top in sorted(set(translation.result) - own):
        value = translation.result.pop(top)
        translation.notes[:] = [n for n in translation.notes if not (n.target_path or "").startswith(top)]
        reason = (f"a setting with no {version.upper()} argument"
                  + ("; FSDP2 removed it" if version == "fsdp2" and top in _REMOVED_IN_FSDP2 else ""))
        translation.notes.append(Note(f"extensions.fsdp.{top}", None, value, Fidelity.DROPPED, reason))


_REMOVED_IN_FSDP2 = {"limit_all_gathers", "use_orig_params", "param_init_fn", "device_id"}


# ---- the dialect -----------------------------------------------------------------------------------


class Fsdp(Dialect):
    """FSDP1 and FSDP2 kwargs, and the FSDP settings of trainer frameworks: the input's layout picks the map."""

    NAME, VERSIONS = NAME, VERSIONS
    FIELD_MAP, VALUE_MAPS, ALIASES = FIELD_MAP, VALUE_MAPS, ALIASES

    def check_version(self, version: str | None) -> str | None:
        # Reading tells the generation from the layout; a version given insists on one.
        return None if version is None else super().check_version(version)

    def normalise(self, raw: Any, prepared: Prepared) -> Prepared:
        found = layout(raw)
        if prepared.version is not None and prepared.version != found:
            raise ConfigError([Problem("", sorted(raw), f"expected {prepared.version} arguments, found {found} ones "
                                       "(FSDP2 is written under \"fully_shard\")")], source=NAME)  # fmt: skip
        if found == "fsdp2":
            fsdp1 = sorted(set(raw) & {k.split(".")[0] for k in FSDP1_MAP})
            if fsdp1:
                raise ConfigError([Problem(k, raw[k], "an FSDP1 FullyShardedDataParallel argument next to FSDP2 "
                                           "fully_shard: give one generation") for k in fsdp1],
                                  source=NAME)  # fmt: skip
        if found in frameworks.LAYOUTS:  # a framework's config file: literal values, no run-time expressions
            prepared.field_map, prepared.state["finalize"] = frameworks.field_map(found), frameworks.LAYOUTS[found][1]
            return prepared
        prepared.field_map, prepared.state["finalize"] = _READ_MAPS[found], _finalize_read(found)
        prepared.data, prepared.notes, prepared.kept = split_expressions(raw, prepared.field_map, NAME, _KNOWN)
        return prepared

    def finalize(self, ctx: ReadContext, prepared: Prepared) -> None:
        prepared.state["finalize"](ctx)

    def write(self, cfg: TorshConfig, *, version: str | None = None) -> Translation[dict]:
        """Write FSDP2 ``fully_shard`` kwargs (default) or FSDP1 ``FullyShardedDataParallel`` kwargs."""
        version = check_version(NAME, version, VERSIONS)
        fmap = _V1_WRITE if version == "fsdp1" else _V2_WRITE
        translation = write_mapping(cfg, dialect=NAME, field_map=fmap, value_maps=_WRITE_VALUES,
                                    finalize=_finalize_write(version))  # fmt: skip
        _drop_other_generation(translation, version)
        return translation

    def sniff(self, raw: Any) -> float:
        return best(SHAPES, raw)


DIALECT = Fsdp()
globals().update(DIALECT.exports())


# ---- the FSDP2 snippet ----------------------------------------------------------------------------


def snippet(cfg: TorshConfig) -> str:
    """Python that applies ``fully_shard`` to ``model`` as ``cfg`` says: mesh, policies, the modules to shard."""
    s = cfg.sharding
    lines = ["import torch", "import torch.distributed as dist",
             "from torch.distributed.device_mesh import init_device_mesh",
             "from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard", "",
             'device_type = "cuda" if torch.cuda.is_available() else "cpu"']  # fmt: skip
    lines += _snippet_mesh(cfg, lines)
    kwargs = ["mesh=mesh", f"reshard_after_forward={sharding.reshards(s.stage, s.reshard_after_forward)}"]
    kwargs += _snippet_policies(cfg, lines)
    lines += ["fsdp_kwargs = dict(", *(f"    {k}," for k in kwargs), ")", ""]
    if s.sync_module_states:
        lines.append("full_state = model.state_dict() if dist.get_rank() == 0 else {}  # rank 0 loaded the weights")
    lines += _snippet_blocks(s.wrap)
    lines += ["for block in blocks:", "    fully_shard(block, **fsdp_kwargs)", "fully_shard(model, **fsdp_kwargs)"]
    if s.forward_prefetch:
        lines += ["for block, following in zip(blocks, blocks[1:]):  # forward_prefetch",
                  "    block.set_modules_to_forward_prefetch([following])"]  # fmt: skip
    if s.sync_module_states:
        lines += ["from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict",
                  "set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, "
                  "broadcast_from_rank0=True))"]  # fmt: skip
    lines.append("# build the optimizer after sharding, from model.parameters()")
    return "\n".join(lines) + "\n"


def _snippet_mesh(cfg: TorshConfig, lines: list[str]) -> list[str]:
    """The device mesh: 1-D over every rank, or (replicas, shard group) for hybrid sharding."""
    if cfg.sharding.hybrid_shard_size is None:
        return ["mesh = init_device_mesh(device_type, (dist.get_world_size(),))"]
    size = node_shard_size(cfg)
    if size is AUTO:
        lines.insert(0, "import os")
    size = 'int(os.environ.get("LOCAL_WORLD_SIZE", 1))' if size is AUTO else str(size)
    return [f"shard_size = {size}  # ranks that shard together; the groups replicate",
            "mesh = init_device_mesh(device_type, (dist.get_world_size() // shard_size, shard_size),",
            f"                        mesh_dim_names={MESH_NAMES!r})"]  # fmt: skip


def _snippet_policies(cfg: TorshConfig, lines: list[str]) -> list[str]:
    """fully_shard's mixed-precision and offload policies."""
    p, o = cfg.precision, cfg.offload
    mp = []
    if p.param_dtype is AUTO:
        lines.append('# precision "auto": add mp_policy=MixedPrecisionPolicy(param_dtype=...) for the training dtype')
    elif p.param_dtype != "fp32":
        mp.append(f"param_dtype={dtypes.TORCH[p.param_dtype]}")
    if p.reduce_dtype is not None and p.reduce_dtype != p.param_dtype:
        mp.append(f"reduce_dtype={dtypes.TORCH[p.reduce_dtype]}")
    if mp and not p.cast_forward_inputs:
        mp.append("cast_forward_inputs=False")
    kwargs = [f"mp_policy=MixedPrecisionPolicy({', '.join(mp)})"] if mp else []
    return kwargs + ([f"offload_policy=CPUOffloadPolicy(pin_memory={o.pin_memory})"] if o.params == "cpu" else [])


# fully_shard refuses containers without a forward (ModuleList / ModuleDict, a model's ``layers``): like the engine,
# the snippet never makes one a unit and looks through them to their children.
_CONTAINERS = "(torch.nn.ModuleList, torch.nn.ModuleDict)"


def _snippet_blocks(wrap: Any) -> list[str]:
    """The modules sharded before the root: by class name, by size (as size_based_auto_wrap), or each child."""
    if wrap.module_classes:
        return [f"shard_classes = {set(wrap.module_classes)!r}",
                "blocks = [m for m in model.modules() if m is not model and type(m).__name__ in shard_classes]"]
    if wrap.min_num_params:
        return [f"min_num_params = {wrap.min_num_params}",
                "blocks, taken = [], set()",
                "for m in reversed(list(model.modules())):  # children before parents, like size_based_auto_wrap",
                f"    if m is model or isinstance(m, {_CONTAINERS}):",
                "        continue",
                "    own = [q for q in m.parameters() if id(q) not in taken]",
                "    if sum(q.numel() for q in own) >= min_num_params:",
                "        blocks.append(m)",
                "        taken.update(id(q) for q in own)"]  # fmt: skip
    return ["def children(module):  # direct children, looking through ModuleList / ModuleDict",
            "    for child in module.children():",
            f"        yield from children(child) if isinstance(child, {_CONTAINERS}) else [child]",
            "",
            "blocks = [m for m in children(model) if any(True for _ in m.parameters())]"]  # fmt: skip
