"""The ``fsdp_config`` section of an ``accelerate config`` YAML, as Accelerate's FSDP plugin reads it from the
environment ``accelerate launch`` writes: per ``fsdp_version`` (FSDP1 takes its strategy from
``fsdp_sharding_strategy``, FSDP2 from ``fsdp_reshard_after_forward``), the keys that decide one core field
together (strategy and reshard, wrap policy and its classes or size, offload, prefetch, state dict, module-state
sync), and what the writer puts back.

The hooks record values in the read's state (``_remember``); ``_finalize_fsdp`` combines them once every key is seen.
"""

from __future__ import annotations

from typing import Any

from torsh.concepts import sharding
from torsh.config import AUTO, TorshConfig, get_path
from torsh.errors import ConfigError, Problem
from torsh.translate import NOTHING, Fidelity, Hook, Note, ReadContext, To, Unsupported, WriteContext

from ._accelerate_launch import fsdp_unread
from ._torch_names import SHARDING_STRATEGIES, STRATEGY_ALIASES, enum_name, to_bool

NAME = "accelerate"


_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")


_PREFETCH = {"BACKWARD_PRE": "backward_pre", "BACKWARD_POST": "backward_post", "NO_PREFETCH": "none"}


_STATE_DICTS = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")


def _fsdp_version(ctx: Any) -> int:
    section = ctx.raw.get("fsdp_config")
    value = section.get("fsdp_version", 1) if isinstance(section, dict) else 1
    try:
        version = float(str(value))  # YAML may give 2, "2" or 2.0; Accelerate reads an int
    except ValueError:
        version = None
    if version not in (1.0, 2.0):
        raise ConfigError([Problem("fsdp_config.fsdp_version", value, "Accelerate's FSDP versions are 1 and 2")],
                          source=NAME)  # fmt: skip
    return int(version)


def _state(ctx: Any) -> dict[str, Any]:
    return ctx.__dict__.setdefault("_accelerate", {})


def _remember(key: str, convert=lambda v, ctx, path: v):
    """A hook that only records the value (the finalizer combines keys that decide one core field together)."""

    def hook(value: Any, ctx: ReadContext, path: str) -> None:
        converted = convert(value, ctx, path)
        if converted is not None:
            _state(ctx)[key] = (converted, path, value)

    return hook


def _strategy(value: Any, ctx: ReadContext, path: str) -> str | None:
    return enum_name(value, SHARDING_STRATEGIES, "ShardingStrategy", ctx, path, STRATEGY_ALIASES)


def _read_reshard(value: Any, ctx: ReadContext, path: str) -> Any:
    if _fsdp_version(ctx) >= 2:
        return to_bool(value, ctx, path)
    if isinstance(value, bool) or str(value).lower() in ("true", "false"):
        ctx.keep(path, value)
        ctx.note(path, Fidelity.DROPPED, "a bool is what FSDP2 reads; Accelerate's FSDP1 plugin does not read this "
                 "key (fsdp_sharding_strategy decides): set fsdp_version: 2 if the file is meant for FSDP2", value)
        return None
    if sharding.fsdp1_strategy_name(value) is None:
        ctx.keep(path, value)  # what accelerate config writes is a strategy name; anything else the plugin passes over
        ctx.note(path, Fidelity.DROPPED, "not a sharding strategy, and Accelerate's FSDP1 plugin does not read this "
                 "key (fsdp_sharding_strategy decides)", value)  # fmt: skip
        return None
    return _strategy(value, ctx, path)


def _read_wrap_policy(value: Any, ctx: ReadContext, path: str) -> Any:
    return enum_name(value, _WRAP_POLICIES, "fsdp_auto_wrap_policy", ctx, path)


def _read_classes(value: Any, ctx: ReadContext, path: str) -> Any:
    if isinstance(value, str):
        return [c.strip() for c in value.split(",") if c.strip()]
    if isinstance(value, list) and all(isinstance(c, str) for c in value):
        return value
    ctx.problem(path, value, "expected class names, comma-separated or as a list")
    return None


def _read_prefetch(value: Any, ctx: ReadContext, path: str) -> Any:
    if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
        value = tuple(_PREFETCH)[int(value) - 1] if 1 <= int(value) <= 3 else value
    name = str(value).upper()
    if name not in _PREFETCH:
        ctx.problem(path, value, f"expected one of {', '.join(_PREFETCH)}")
        return None
    return _PREFETCH[name]


def _read_state_dict(value: Any, ctx: ReadContext, path: str) -> Any:
    return enum_name(value, _STATE_DICTS, "StateDictType", ctx, path)


def _ignored_when_v2(core_path: str, what: str):
    def hook(value: Any, ctx: ReadContext, path: str) -> None:
        flag = to_bool(value, ctx, path)
        if flag is None:
            return
        if _fsdp_version(ctx) >= 2:
            ctx.keep(path, value)
            ctx.note(path, Fidelity.DROPPED, f"FSDP2 has no {what}; Accelerate ignores this key with fsdp_version 2",
                     value)  # fmt: skip
        else:
            _state(ctx)[core_path] = (flag, path, value)

    return hook


def _read_forward_prefetch(value: Any, ctx: ReadContext, path: str) -> None:
    """FSDP1's forward prefetch (with fsdp_version 2 the plugin does not read the key: ``_unread_by_version``)."""
    flag = to_bool(value, ctx, path)
    if flag is not None:
        _state(ctx)["sharding.forward_prefetch"] = (flag, path, value)


def _read_use_orig_params(value: Any, ctx: ReadContext, path: str) -> None:
    """FSDP1 reads it with str_to_bool (FSDP2 does not read it: ``_unread_by_version``)."""
    if to_bool(value, ctx, path) is not None:
        ctx.keep(path, value)
        ctx.note(path, Fidelity.IGNORED, "exposes the original parameters (torch.compile, per-parameter optimizer "
                 "groups); FSDP2 always does", value)  # fmt: skip


FSDP_MAP = {
    "fsdp_config.fsdp_version": Hook(read=lambda v, c, p: (c.keep(p, v), c.note(p, Fidelity.EXACT, "the FSDP "
                                     "generation; kept to write it back (the torsh engine runs FSDP2 for both)", v))),
    "fsdp_config.fsdp_sharding_strategy": Hook(read=_remember("strategy", _strategy)),
    "fsdp_config.fsdp_reshard_after_forward": Hook(read=_remember("reshard", _read_reshard)),
    "fsdp_config.fsdp_offload_params": Hook(read=_remember("offload", to_bool)),
    "fsdp_config.fsdp_auto_wrap_policy": Hook(read=_remember("wrap", _read_wrap_policy)),
    "fsdp_config.fsdp_transformer_layer_cls_to_wrap": Hook(read=_remember("classes", _read_classes)),
    "fsdp_config.fsdp_min_num_params": Hook(read=_remember("min_num_params")),
    "fsdp_config.fsdp_backward_prefetch": Hook(read=_remember("prefetch", _read_prefetch)),
    "fsdp_config.fsdp_state_dict_type": Hook(read=_remember("state_dict", _read_state_dict)),
    "fsdp_config.fsdp_forward_prefetch": Hook(read=_read_forward_prefetch),
    "fsdp_config.fsdp_use_orig_params": Hook(read=_read_use_orig_params),
    "fsdp_config.fsdp_cpu_ram_efficient_loading": Hook(read=_remember("ram_efficient", to_bool)),
    "fsdp_config.fsdp_sync_module_states": Hook(read=_ignored_when_v2("sharding.sync_module_states",
                                                                      "sync_module_states")),
    "fsdp_config.fsdp_activation_checkpointing": To("activation_checkpointing.enabled"),
    "fsdp_config.fsdp_activation_checkpointing_offload": Hook(read=_remember("ac_offload", to_bool)),
    "fsdp_config.fsdp_ignored_modules": Unsupported("these modules' parameters stay unsharded; torsh shards every "
                                                    "parameter"),
}


def _finalize_fsdp(ctx: ReadContext, state: dict, version: int) -> None:
    if "fsdp_version" not in (ctx.raw.get("fsdp_config") or {}):
        ctx.keep("fsdp_config.fsdp_version", 1)  # the launcher's default; kept so the file is written back as FSDP1
    if "ac_offload" in state:
        _fsdp_activation_offload(ctx, *state["ac_offload"], version)
    _fsdp_stage(ctx, state, version)
    _fsdp_wrap(ctx, state)
    if "offload" in state:
        flag, path, value = state["offload"]
        if flag:
            ctx.set("offload.params", "cpu", path, Fidelity.EXACT, "parameters and gradients on the CPU")
            ctx.set("offload.optimizer", "cpu", path, Fidelity.EXACT, "the optimizer step runs on the CPU")
        else:
            ctx.note(path, Fidelity.EXACT, "no offload", value, "offload")
    prefetch = state.get("prefetch")
    if prefetch and version >= 2:
        ctx.keep(prefetch[1], prefetch[2])
        ctx.note(prefetch[1], Fidelity.DROPPED, "removed in FSDP2 (always prefetches like BACKWARD_PRE); Accelerate "
                 "ignores it with fsdp_version 2", prefetch[2])  # fmt: skip
        prefetch = None
    _set_or_default(ctx, "sharding.backward_prefetch", prefetch, "fsdp_config.fsdp_backward_prefetch",
                    "none" if version == 1 else "backward_pre", "Accelerate's default NO_PREFETCH (torch's is "
                    "BACKWARD_PRE)" if version == 1 else "FSDP2 prefetches like BACKWARD_PRE")  # fmt: skip
    sd = state.get("state_dict")
    if sd and sd[0] == "LOCAL_STATE_DICT":
        ctx.set("checkpoint.state_dict_type", "sharded", sd[1], Fidelity.APPROXIMATE, "LOCAL_STATE_DICT (flat local "
                "shards) is not supported by torch.distributed.checkpoint; read as sharded")  # fmt: skip
    else:
        _set_or_default(ctx, "checkpoint.state_dict_type", (sd[0].split("_")[0].lower(), sd[1], sd[2]) if sd else None,
                        "fsdp_config.fsdp_state_dict_type", "full" if version == 1 else "sharded",
                        f"Accelerate's FSDP{version} default")  # fmt: skip
    _set_or_default(ctx, "sharding.forward_prefetch", state.get("sharding.forward_prefetch"),
                    "fsdp_config.fsdp_forward_prefetch", False, "Accelerate's default")
    _fsdp_sync(ctx, state, version)


def _fsdp_activation_offload(ctx: ReadContext, flag: bool, path: str, value: Any, version: int) -> None:
    """Activations saved for recompute kept on the CPU: Accelerate refuses it without activation checkpointing or
    with FSDP1 (dataclasses.py, FullyShardedDataParallelPlugin.__post_init__)."""
    if flag and (version != 2 or not get_path(ctx.core, "activation_checkpointing.enabled", False)):
        ctx.problem(path, value, "Accelerate refuses activation checkpointing offload without "
                    "fsdp_activation_checkpointing: true and fsdp_version: 2; set both or remove this key")
    else:
        ctx.set("activation_checkpointing.cpu_offload", flag, path, Fidelity.EXACT, "the checkpointed layers' inputs "
                "wait on the CPU for the backward pass (save_on_cpu)" if flag else "")  # fmt: skip


def _fsdp_stage(ctx: ReadContext, state: dict, version: int) -> None:
    name, source, fidelity, reason = (_fsdp1_strategy if version == 1 else _fsdp2_strategy)(ctx, state)
    stage, hybrid = sharding.FSDP1_LAYOUTS[name]
    if name == "NO_SHARD":
        fidelity, reason = Fidelity.APPROXIMATE, "NO_SHARD: DDP-like replication; torsh runs DDP"
    ctx.set("sharding.stage", stage, source, fidelity, reason)
    _fsdp_hybrid(ctx, state, hybrid and version == 1, source)


def _fsdp1_strategy(ctx: ReadContext, state: dict) -> tuple[str, str, Fidelity, str]:
    """FSDP1's strategy (name, source, fidelity, why): fsdp_sharding_strategy, else the strategy named under
    fsdp_reshard_after_forward (what `accelerate config` writes), else the launcher's FULL_SHARD."""
    strategy, reshard = state.get("strategy"), state.get("reshard")
    if reshard is not None and strategy is None:
        return reshard[0], reshard[1], Fidelity.APPROXIMATE, (
            "Accelerate's FSDP1 plugin reads fsdp_sharding_strategy, not this key, so accelerate launch runs "
            "FULL_SHARD; read as the strategy named here, which `accelerate config` meant")  # fmt: skip
    if reshard is not None and reshard[0] != strategy[0]:
        ctx.note(reshard[1], Fidelity.DROPPED, f"FSDP1 reads fsdp_sharding_strategy ({strategy[0]})", reshard[2])
    elif reshard is not None:
        ctx.note(reshard[1], Fidelity.EXACT, "the same strategy (the key `accelerate config` writes)", reshard[2])
    if strategy is not None:
        return strategy[0], strategy[1], Fidelity.EXACT, ""
    return "FULL_SHARD", "fsdp_config.fsdp_sharding_strategy", Fidelity.DEFAULTED, "launcher default FULL_SHARD"


def _fsdp2_strategy(ctx: ReadContext, state: dict) -> tuple[str, str, Fidelity, str]:
    """FSDP2's layout as an FSDP1 strategy name: a strategy named under fsdp_sharding_strategy (read as
    `accelerate to-fsdp2` converts it), else fsdp_reshard_after_forward (launcher default true)."""
    strategy, reshard = state.get("strategy"), state.get("reshard")
    if strategy is not None:
        return strategy[0], strategy[1], Fidelity.APPROXIMATE, ("FSDP2 reads fsdp_reshard_after_forward; accelerate "
                                                                 "to-fsdp2 converts this strategy")  # fmt: skip
    if reshard is None:
        return "FULL_SHARD", "fsdp_config.fsdp_reshard_after_forward", Fidelity.DEFAULTED, "launcher default true"
    stage = sharding.stage_of_reshard(reshard[0])
    return (sharding.fsdp1_strategy(stage, None, hybrid=False), reshard[1], Fidelity.EXACT,
            f"reshard_after_forward={reshard[0]}: ZeRO-{stage}")  # fmt: skip


def _fsdp_hybrid(ctx: ReadContext, state: dict, node_groups: bool, source: str) -> None:
    """The hybrid shard group: each node (FSDP1's hybrid strategies), or parallelism_config's data-parallel mesh."""
    replicate, shard = state.get("dp_replicate_size"), state.get("dp_shard_size")
    for item in (i for i in (replicate, shard) if i is not None):
        ctx.note(item[1], Fidelity.EXACT, "data-parallel mesh size", item[2])
    if node_groups:
        ctx.set("sharding.hybrid_shard_size", AUTO, source, Fidelity.DEFERRED, "HYBRID_SHARD shards within each node")
    elif _replicated_shards(replicate, shard):
        ctx.set("sharding.hybrid_shard_size", shard[0], shard[1], Fidelity.EXACT, "HSDP: dp_replicate_size > 1")


def _replicated_shards(replicate: tuple | None, shard: tuple | None) -> bool:
    return bool(replicate and isinstance(replicate[0], int) and replicate[0] > 1 and shard and
                isinstance(shard[0], int))  # fmt: skip


def _fsdp_wrap(ctx: ReadContext, state: dict) -> None:
    wrap, classes, size = state.get("wrap"), state.get("classes"), state.get("min_num_params")
    policy = wrap[0] if wrap else "NO_WRAP"
    if policy == "TRANSFORMER_BASED_WRAP" and classes:
        ctx.set("sharding.wrap.module_classes", classes[0], classes[1])
    elif policy == "TRANSFORMER_BASED_WRAP":
        ctx.keep(wrap[1], wrap[2])
        ctx.note(wrap[1], Fidelity.APPROXIMATE, "wraps the model's _no_split_modules (known only with the model); "
                 "torsh wraps each direct child that holds parameters", wrap[2])  # fmt: skip
    elif policy == "SIZE_BASED_WRAP":
        ctx.set("sharding.wrap.min_num_params", size[0] if size else 100_000_000, size[1] if size else wrap[1],
                Fidelity.EXACT if size else Fidelity.DEFAULTED, "" if size else "launcher default 1e8")  # fmt: skip
    else:
        ctx.keep("fsdp_config.fsdp_auto_wrap_policy", "NO_WRAP")
        ctx.note(wrap[1] if wrap else "fsdp_config.fsdp_auto_wrap_policy", Fidelity.APPROXIMATE, "NO_WRAP: the whole "
                 "model is one FSDP unit; torsh wraps each direct child (same numerics, lower peak memory)",
                 policy)  # fmt: skip
    if wrap and ((policy == "TRANSFORMER_BASED_WRAP" and classes) or policy == "SIZE_BASED_WRAP"):
        ctx.note(wrap[1], Fidelity.EXACT, "", wrap[2], "sharding.wrap")
    for item, used in ((classes, policy == "TRANSFORMER_BASED_WRAP"), (size, policy == "SIZE_BASED_WRAP")):
        if item is not None and not used:
            ctx.keep(item[1], item[2])
            ctx.note(item[1], Fidelity.IGNORED, f"read only with another fsdp_auto_wrap_policy (this one is {policy})",
                     item[2])  # fmt: skip


def _fsdp_sync(ctx: ReadContext, state: dict, version: int) -> None:
    ram = state.get("ram_efficient")
    ram_flag = ram[0] if ram else True
    if ram:
        ctx.keep(ram[1], ram[2])
        ctx.note(ram[1], Fidelity.EXACT, "rank 0 loads the weights, the others start empty and receive them",
                 ram[2], "sharding.sync_module_states")  # fmt: skip
    sync = state.get("sharding.sync_module_states")
    if version >= 2:
        source = ram[1] if ram else "fsdp_config.fsdp_cpu_ram_efficient_loading"
        ctx.set("sharding.sync_module_states", ram_flag, source,
                Fidelity.EXACT if ram else Fidelity.DEFAULTED, "FSDP2: Accelerate broadcasts rank 0's weights when "
                "cpu_ram_efficient_loading (launcher default true)", note=not ram)  # fmt: skip
        return
    flag = (sync[0] if sync else True) or ram_flag
    reason = "cpu_ram_efficient_loading forces it on (FSDP1)" if ram_flag and sync and not sync[0] else ""
    ctx.set("sharding.sync_module_states", flag, sync[1] if sync else "fsdp_config.fsdp_sync_module_states",
            Fidelity.EXACT if sync else Fidelity.DEFAULTED, reason or ("" if sync else "launcher default true"))


def _set_or_default(ctx: ReadContext, core_path: str, found, source: str, default: Any, reason: str) -> None:
    if found is not None:
        ctx.set(core_path, found[0], found[1])
    elif get_path(ctx.core, core_path, NOTHING) is NOTHING:
        ctx.set(core_path, default, source, Fidelity.DEFAULTED, reason)


def _unread_by_version(raw: dict) -> tuple[dict, list[Note], dict]:
    """fsdp_config keys the plugin does not read for this fsdp_version (``FSDP_UNREAD``), taken out with a note where
    their value says nothing torsh reads: FSDP2's use_orig_params and forward_prefetch whatever they hold, FSDP2's
    fsdp_sharding_strategy unless it names a strategy (read as the strategy ``accelerate to-fsdp2`` converts),
    FSDP1's fsdp_reshard_after_forward unless it is a plain value (read as the strategy `accelerate config` meant)."""
    section, unread = raw.get("fsdp_config"), fsdp_unread(raw)
    if not unread:
        return raw, [], {}
    said = {"fsdp_sharding_strategy": lambda v: sharding.fsdp1_strategy_name(v) is not None,
            "fsdp_reshard_after_forward": lambda v: isinstance(v, (bool, int, str)),
            "fsdp_min_num_params": lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
            "fsdp_sync_module_states": lambda v: v is None}  # fmt: skip
    out = {k: v for k, v in section.items() if k not in unread or k in said and said[k](v)}
    gone = [k for k in section if k not in out]
    notes = [Note(f"fsdp_config.{k}", None, section[k], Fidelity.IGNORED, "Accelerate's FSDP plugin does not read "
                  "this key here (accelerate launch accepts the file whatever it holds)") for k in gone]
    return {**raw, "fsdp_config": out}, notes, {f"fsdp_config.{k}": section[k] for k in gone}


def _write_fsdp_sharding(cfg: TorshConfig, ctx: WriteContext, version: int) -> None:
    s = cfg.sharding
    if version == 1:
        _write_fsdp1_strategy(s, ctx)
        return
    # Stage 0 is written as FSDP2's default true: the launcher runs DDP for it (distributed_type MULTI_GPU).
    ctx.put("fsdp_config.fsdp_reshard_after_forward", sharding.reshards(s.stage, s.reshard_after_forward) or
            s.stage == 0, "sharding.stage")  # fmt: skip
    if s.hybrid_shard_size is not None:
        _write_fsdp2_hybrid(cfg, ctx)


def _write_fsdp1_strategy(s: Any, ctx: WriteContext) -> None:
    hybrid = s.hybrid_shard_size is not None
    name = sharding.fsdp1_strategy(s.stage, s.reshard_after_forward, hybrid).lstrip("_")  # Accelerate's spelling
    if hybrid and s.hybrid_shard_size is not AUTO:
        ctx.note("sharding.hybrid_shard_size", Fidelity.APPROXIMATE, "Accelerate's FSDP1 HYBRID_SHARD shards within "
                 "each node; a group of another size needs a device mesh", s.hybrid_shard_size)  # fmt: skip
    ctx.put("fsdp_config.fsdp_sharding_strategy", name, "sharding.stage", Fidelity.EXACT, "what the FSDP1 plugin "
            "reads (FSDP_SHARDING_STRATEGY)")  # fmt: skip
    ctx.put("fsdp_config.fsdp_reshard_after_forward", name, "sharding.stage", Fidelity.EXACT, "the same strategy "
            "under the key `accelerate config` writes for FSDP1: both keys, so every Accelerate version runs it")


def data_ranks(cfg: TorshConfig) -> int | None:
    """The data-parallel ranks of the processes the config's launch states: their count over tp x cp x pp (None
    when it states none). Accelerate's dp_replicate_size x dp_shard_size."""
    from torsh.contract import launch_world_size

    par = cfg.parallelism
    return sharding.data_parallel_ranks(launch_world_size(cfg), par.tp * par.cp * (par.pp if isinstance(par.pp, int)
                                                                                   else 1))  # fmt: skip


def _write_fsdp2_hybrid(cfg: TorshConfig, ctx: WriteContext) -> None:
    """FSDP2 hybrid sharding: parallelism_config's dp_replicate_size x dp_shard_size over the data-parallel ranks."""
    size = cfg.sharding.hybrid_shard_size
    mesh = None if size is AUTO else sharding.hybrid_mesh(size, data_ranks(cfg))
    if mesh is None:
        ctx.note("sharding.hybrid_shard_size", Fidelity.UNSUPPORTED, "FSDP2 hybrid sharding in Accelerate is "
                 "parallelism_config dp_replicate_size x dp_shard_size: needs a known group size dividing "
                 "num_processes", size)  # fmt: skip
        return
    ctx.put("parallelism_config.parallelism_config_dp_replicate_size", mesh[0], "sharding.hybrid_shard_size")
    ctx.put("parallelism_config.parallelism_config_dp_shard_size", mesh[1], "sharding.hybrid_shard_size")


def _write_fsdp_rest(version: int):
    def hook(cfg: TorshConfig, ctx: WriteContext) -> None:
        s = cfg.sharding
        _write_offload(cfg, ctx, "fsdp_config.fsdp_offload_params")
        if s.wrap.module_classes:
            ctx.put("fsdp_config.fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "sharding.wrap.module_classes")
            ctx.put("fsdp_config.fsdp_transformer_layer_cls_to_wrap", ",".join(s.wrap.module_classes),
                    "sharding.wrap.module_classes")  # fmt: skip
        elif s.wrap.min_num_params:
            ctx.put("fsdp_config.fsdp_auto_wrap_policy", "SIZE_BASED_WRAP", "sharding.wrap.min_num_params")
            ctx.put("fsdp_config.fsdp_min_num_params", s.wrap.min_num_params, "sharding.wrap.min_num_params")
        elif cfg.extensions.get(NAME, {}).get("fsdp_config.fsdp_auto_wrap_policy") in ("TRANSFORMER_BASED_WRAP",
                                                                                         "NO_WRAP"):
            policy = cfg.extensions[NAME]["fsdp_config.fsdp_auto_wrap_policy"]
            ctx.put("fsdp_config.fsdp_auto_wrap_policy", policy, "sharding.wrap", Fidelity.EXACT,
                    f"{policy}, as in the source file")  # fmt: skip
        elif s.stage >= 2:
            # Per-layer units are what keeps ZeRO-3's memory behaviour (one gathered layer at a time); NO_WRAP would
            # gather the whole model at once.
            ctx.put("fsdp_config.fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "sharding.wrap",
                    Fidelity.APPROXIMATE, "the layer classes are not in the config: Accelerate wraps the model's "
                    "_no_split_modules (Hugging Face models); for other models set "
                    "fsdp_transformer_layer_cls_to_wrap to the block class")  # fmt: skip
        else:
            ctx.put("fsdp_config.fsdp_auto_wrap_policy", "NO_WRAP", "sharding.wrap", Fidelity.EXACT, "ZeRO-0/1 keep "
                    "whole parameters: one unit")  # fmt: skip
        prefetch = s.backward_prefetch
        if version == 1:
            # Unset (e.g. from DeepSpeed, which prefetches the next parameters): torch's default BACKWARD_PRE.
            name = {v: k for k, v in _PREFETCH.items()}[prefetch or "backward_pre"]
            ctx.put("fsdp_config.fsdp_backward_prefetch", name, "sharding.backward_prefetch")
            ctx.put("fsdp_config.fsdp_forward_prefetch", s.forward_prefetch, "sharding.forward_prefetch")
            ctx.put("fsdp_config.fsdp_sync_module_states", s.sync_module_states, "sharding.sync_module_states")
            ctx.put("fsdp_config.fsdp_cpu_ram_efficient_loading", s.sync_module_states, "sharding.sync_module_states",
                    Fidelity.EXACT, "on FSDP1 true forces sync_module_states")  # fmt: skip
        else:
            if prefetch in ("backward_post", "none"):
                ctx.note("sharding.backward_prefetch", Fidelity.APPROXIMATE, "FSDP2 always prefetches like "
                         "BACKWARD_PRE", prefetch)  # fmt: skip
            if s.forward_prefetch:
                ctx.note("sharding.forward_prefetch", Fidelity.UNSUPPORTED, "Accelerate raises for forward prefetch "
                         "with FSDP2", True)  # fmt: skip
            ctx.put("fsdp_config.fsdp_cpu_ram_efficient_loading", s.sync_module_states, "sharding.sync_module_states",
                    Fidelity.EXACT, "FSDP2: rank 0 loads, the weights are broadcast")  # fmt: skip
        ctx.put("fsdp_config.fsdp_state_dict_type", f"{cfg.checkpoint.state_dict_type.upper()}_STATE_DICT",
                "checkpoint.state_dict_type")  # fmt: skip
        ac = cfg.activation_checkpointing
        if ac.cpu_offload and version == 2 and ac.enabled:
            ctx.put("fsdp_config.fsdp_activation_checkpointing_offload", True, "activation_checkpointing.cpu_offload")
        elif ac.cpu_offload:
            ctx.note("activation_checkpointing.cpu_offload", Fidelity.UNSUPPORTED, "Accelerate offloads checkpointed "
                     "activations only with FSDP2 and activation checkpointing on", True)  # fmt: skip

    return hook


def _write_offload(cfg: TorshConfig, ctx: WriteContext, key: str) -> None:
    o = cfg.offload
    if o.params == "none" and o.optimizer == "none":
        ctx.put(key, False, "offload.params")
    elif o.params == "cpu" and o.optimizer in ("cpu", "none"):
        ctx.put(key, True, "offload.params", Fidelity.EXACT if o.optimizer == "cpu" else Fidelity.APPROXIMATE,
                "" if o.optimizer == "cpu" else "FSDP offload also moves the optimizer step to the CPU")
    else:
        ctx.note("offload", Fidelity.UNSUPPORTED, "FSDP offloads parameters, gradients and optimizer to CPU memory "
                 "together; NVMe or optimizer-only offload needs DeepSpeed", f"{o.params}/{o.optimizer}")
