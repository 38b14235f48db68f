"""The ``parallelism_config`` and ``megatron_lm_config`` sections of an ``accelerate config`` YAML: the model-parallel
degrees (Accelerate's ``ParallelismConfig``: tp, cp, sp and the data-parallel mesh sizes; the Megatron-LM backend's
degrees), their settings (Ulysses' under the DeepSpeed backend, torch's context parallelism), the combinations
ParallelismConfig refuses, and what the writer puts back.
"""

from __future__ import annotations

from typing import Any

from torsh.concepts import sharding
from torsh.config import TorshConfig
from torsh.translate import Fidelity, ReadContext, WriteContext

from ._accelerate_fsdp import _fsdp_version, _state, data_ranks
from ._accelerate_launch import _TORCHRUN_TYPES, _kind


#: Accelerate's model-parallel degrees (parallelism_config) -> the core degree, the fidelity and why.
_DEGREES = {
    "tp_size": ("parallelism.tp", Fidelity.APPROXIMATE, "DTensor tensor parallelism; Accelerate splits by the model's "
                "own tp_plan, torsh by its default plan of the same names (q/k/v/gate/up colwise, o/down rowwise)"),
    "cp_size": ("parallelism.cp", Fidelity.APPROXIMATE, "context parallelism: each sequence split over cp ranks "
                "and scaled_dot_product_attention over the whole of it, inside engine.context_parallel(buffers=...) "
                "(Accelerate's maybe_context_parallel); the parts are contiguous where torch load-balances them (the "
                "same training), and an attention mask is refused where Accelerate drops it and attends causally"),
    "sp_size": ("parallelism.sp", Fidelity.APPROXIMATE, "Ulysses groups and reduction; Accelerate's swap of a model's "
                "attention and sequence-sharding of batches are not done (use DistributedAttention, feed blocks)"),
}
_SP_SETTINGS = {"sp_backend": "DeepSpeed-Ulysses, which the torsh engine runs", **dict.fromkeys(
    ("sp_seq_length", "sp_seq_length_is_variable", "sp_attn_implementation"), "for the attention Accelerate swaps in")}
#: The Megatron-LM backend's degrees: Megatron's own model classes split themselves; the degree is the same.
_MEGATRON_DEGREES = {
    "megatron_lm_tp_degree": "parallelism.tp",
    "megatron_lm_pp_degree": "parallelism.pp",
    "megatron_lm_context_parallel_size": "parallelism.cp",
}


def _read_megatron(value: Any, ctx: ReadContext, path: str) -> None:
    key = path.rsplit(".", 1)[-1]
    if key not in _MEGATRON_DEGREES:
        ctx.keep(path, value)
        ctx.note(path, Fidelity.UNSUPPORTED, "a Megatron-LM engine setting; torsh does not run Megatron-LM", value)
    elif value is None or value == 1:
        ctx.keep(path, value)
        ctx.note(path, Fidelity.EXACT, "no such parallelism", value)
    elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
        ctx.problem(path, value, "a degree is a positive number of processes")
    else:
        ctx.set(_MEGATRON_DEGREES[key], value, path, Fidelity.APPROXIMATE, "the same degree; Megatron-LM's model "
                "classes split themselves" + (", torsh splits the model's linear layers with DTensor"
                                              if key == "megatron_lm_tp_degree" else ""))  # fmt: skip


#: The sizes accelerate launch writes into the training process's environment without looking at them (it compares
#: cp_size and sp_size with 1 first); ParallelismConfig reads each back with int(), so a number as text is that number.
_SIZES_AS_TEXT = ("dp_replicate_size", "dp_shard_size", "tp_size")


def _size(key: str, value: Any, ctx: ReadContext, path: str) -> Any:
    """A size as ParallelismConfig gets it: ``int(str(value))`` for the sizes passed on as text."""
    if key in _SIZES_AS_TEXT and isinstance(value, str):
        try:
            number = int(value)
        except ValueError:
            return value
        ctx.note(path, Fidelity.EXACT, "a number as text: accelerate launch passes it on as text and Accelerate's "
                 "ParallelismConfig reads it with int()", value)  # fmt: skip
        return number
    return value


def _read_parallelism(value: Any, ctx: ReadContext, path: str) -> None:
    key = path.rsplit(".", 1)[-1].removeprefix("parallelism_config_")
    value = _size(key, value, ctx, path)
    if key.endswith("_size") and value is None:
        ctx.problem(path, value, "null: accelerate launch compares it with 1 or passes it on as the text 'None', "
                    "which Accelerate's ParallelismConfig cannot read as a size; write 1 for none")  # fmt: skip
    elif key in ("dp_replicate_size", "dp_shard_size") and _kind(ctx) == "FSDP":
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            ctx.problem(path, value, "a size is a positive number of processes (Accelerate's ParallelismConfig "
                        "refuses anything else)")  # fmt: skip
        else:
            _state(ctx)[key] = (value, path, value)
    elif key.endswith("_size") and value == 1 and not isinstance(value, bool):
        ctx.note(path, Fidelity.EXACT, "1: no such parallelism", value)
    elif key in _DEGREES and (key != "sp_size" or _kind(ctx) == "DEEPSPEED"):
        core, fidelity, reason = _DEGREES[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            ctx.problem(path, value, "a degree is a positive number of processes")
        else:
            ctx.set(core, value, path, fidelity, reason)
    elif key.startswith("dp_"):
        ctx.keep(path, value)
        ctx.note(path, Fidelity.UNSUPPORTED, f"the data-parallel degree of a {_kind(ctx)} layout; torsh's data "
                 "parallelism takes every process the model-parallel degrees leave", value)  # fmt: skip
    elif key.startswith("cp_"):
        _read_cp_setting(key, value, ctx, path)
    else:
        _read_sp_setting(key, value, ctx, path)


#: Accelerate's context-parallel settings (TorchContextParallelConfig) -> value -> (fidelity, why).
_CP_SETTINGS = {
    "cp_comm_strategy": {
        "allgather": (Fidelity.EXACT, "torsh all-gathers the keys and values over the context-parallel group, as "
                      "torch's allgather rotation"),
        "alltoall": (Fidelity.APPROXIMATE, "torsh all-gathers the keys and values where torch passes them round a "
                     "ring: the same attention, other communication"),
    },
    "cp_backend": {"torch": (Fidelity.APPROXIMATE, "torch's context_parallel; torsh runs its own split attention in "
                             "its place (torch's does not run on a CPU)")},
}


def _read_cp_setting(key: str, value: Any, ctx: ReadContext, path: str) -> None:
    known = _CP_SETTINGS.get(key)
    section = ctx.raw.get("parallelism_config")
    cp = section.get("parallelism_config_cp_size", 1) if isinstance(section, dict) else 1
    if known is not None and cp in (1, "1"):
        ctx.keep(path, value)
        ctx.note(path, Fidelity.EXACT, "no effect: Accelerate reads it only when cp_size is above 1", value)
    elif known is None:
        ctx.keep(path, value)
        ctx.note(path, Fidelity.UNSUPPORTED, "a context-parallel setting torsh does not know", value)
    elif value not in known:
        ctx.problem(path, value, f"Accelerate's ParallelismConfig takes one of {', '.join(known)}")
    else:
        ctx.keep(path, value)
        ctx.note(path, *known[value], value)


def _read_sp_setting(key: str, value: Any, ctx: ReadContext, path: str) -> None:
    """The other settings: Ulysses' under the DeepSpeed backend (the only one Accelerate runs sp with)."""
    ds, sp = _kind(ctx) == "DEEPSPEED", key.startswith("sp_")
    ctx.keep(path, value)
    reason = (_SP_SETTINGS.get(key) if ds else "Accelerate runs sp with its DeepSpeed backend only") if sp else None
    ctx.note(path, Fidelity.EXACT if ds and (key, value) == ("sp_backend", "deepspeed") else Fidelity.UNSUPPORTED,
             reason or "sequence parallelism (and its settings) is not run by torsh", value)  # fmt: skip


def _check_parallelism_sizes(ctx: ReadContext) -> None:
    """The combinations Accelerate's ParallelismConfig refuses when the training process builds it (the torchrun and
    DeepSpeed launchers pass the sizes on): tensor or context parallelism over pure replication, context and sequence
    parallelism together. Sizes that are not numbers are refused by their own keys."""
    section = ctx.raw.get("parallelism_config")
    if not isinstance(section, dict) or not section or _kind(ctx) not in _TORCHRUN_TYPES:
        return
    sizes = {}
    for name in ("tp_size", "cp_size", "sp_size", "dp_replicate_size", "dp_shard_size"):
        value = section.get(f"parallelism_config_{name}", 1)
        try:
            sizes[name] = int(value) if isinstance(value, (int, str)) and not isinstance(value, bool) else None
        except ValueError:
            sizes[name] = None
    if None in sizes.values():
        return
    key = "parallelism_config.parallelism_config_"
    model_parallel = sizes["tp_size"] > 1 or sizes["cp_size"] > 1
    if model_parallel and sizes["dp_replicate_size"] > 1 and sizes["dp_shard_size"] == 1:
        ctx.problem(f"{key}dp_shard_size", section.get("parallelism_config_dp_shard_size", 1), "Accelerate's "
                    "ParallelismConfig refuses tensor or context parallelism over pure replication (dp_replicate_size "
                    "> 1, dp_shard_size 1): set dp_shard_size > 1 (FSDP or HSDP with TP/CP)")  # fmt: skip
    if sizes["cp_size"] > 1 and sizes["sp_size"] > 1:
        ctx.problem(f"{key}sp_size", section.get("parallelism_config_sp_size"), "Accelerate's ParallelismConfig "
                    "refuses context and sequence parallelism together: set one of cp_size, sp_size to 1")
    elif sizes["cp_size"] > 1 and (_kind(ctx) != "FSDP" or _fsdp_version(ctx) < 2):
        ctx.problem(f"{key}cp_size", sizes["cp_size"], "Accelerate runs context parallelism with its FSDP2 plugin "
                    "only (it refuses cp_size > 1 without an FSDP plugin, or with fsdp_version 1): set "
                    "distributed_type FSDP and fsdp_config.fsdp_version 2, or cp_size 1")  # fmt: skip


def write_degrees(backend: str):
    """parallelism_config's model-parallel degrees (Accelerate's ParallelismConfig), for a file of ``backend``."""

    def hook(cfg: TorshConfig, ctx: WriteContext) -> None:
        par = cfg.parallelism
        for key, core in (("tp_size", "parallelism.tp"), ("cp_size", "parallelism.cp"), ("sp_size", "parallelism.sp")):
            value = getattr(par, core.split(".")[1])
            if key == "cp_size" and value != 1 and backend != "fsdp2":
                ctx.note(core, Fidelity.UNSUPPORTED, f"Accelerate runs cp_size with its FSDP2 plugin only, and this "
                         f"file is written for {backend} (refused by Accelerate with cp_size): not written; torsh "
                         "runs it, or write the config at sharding.stage 2 or 3 for FSDP2", value)  # fmt: skip
            elif value != 1:
                ctx.put(f"parallelism_config.parallelism_config_{key}", value, core)
        if par.pp != 1:
            ctx.note("parallelism.pp", Fidelity.UNSUPPORTED, "Accelerate's parallelism_config has no pipeline "
                     "degree (only its Megatron-LM backend does)", par.pp)  # fmt: skip
        if par.tp_plan:
            ctx.note("parallelism.tp_plan", Fidelity.UNSUPPORTED, "Accelerate splits the layers of the model's own "
                     "tp_plan (transformers); not a config setting", par.tp_plan)  # fmt: skip
        if par.dp_replicate is not None:
            ctx.put("parallelism_config.parallelism_config_dp_replicate_size", par.dp_replicate,
                    "parallelism.dp_replicate")  # fmt: skip
        _write_shard_size(cfg, ctx, backend)

    return hook


def _write_shard_size(cfg: TorshConfig, ctx: WriteContext, backend: str) -> None:
    """dp_shard_size beside the other sizes written for ``backend`` (but a hybrid group's, which the FSDP2 writer
    gives): Accelerate checks that the sizes multiply to num_processes, and refuses tp or cp over pure replication."""
    par = cfg.parallelism
    cp = par.cp if backend == "fsdp2" else 1  # the context-parallel degree written
    if (par.tp * cp == 1 and par.dp_replicate is None) or (backend == "fsdp2" and cfg.sharding.hybrid_shard_size):
        return
    ranks, replicate = data_ranks(cfg), par.dp_replicate or 1
    if ranks is None or ranks * (par.cp // cp) % replicate:
        return
    ranks *= par.cp // cp  # a degree not written (cp outside FSDP2) leaves its ranks to data parallelism
    if ranks // replicate > 1:
        ctx.put("parallelism_config.parallelism_config_dp_shard_size", ranks // replicate, "parallelism")
    elif replicate > 1:
        ctx.note("parallelism.dp_replicate", Fidelity.UNSUPPORTED, "Accelerate's ParallelismConfig refuses tensor or "
                 "context parallelism over pure replication (dp_shard_size 1): torsh runs it, Accelerate would not",
                 par.dp_replicate)  # fmt: skip
