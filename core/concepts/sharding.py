"""The data-parallel sharding layout: how each framework's words map onto the core ``sharding`` section, both ways.

The core model says the layout with three fields: ``sharding.stage`` (0 replicates as DDP; 1 also shards the
optimizer state, 2 the gradients, 3 the parameters: ZeRO's stages), ``sharding.reshard_after_forward`` (free the
gathered parameters after forward; None: as the stage implies, 3 yes, 2 no) and ``sharding.hybrid_shard_size``
(shard within groups of this many ranks, replicate across them: HSDP, ZeRO++ hpZ; "auto": the ranks of one node).
The frameworks say it so:

* FSDP1 ``ShardingStrategy``: FULL_SHARD 3, SHARD_GRAD_OP 2, NO_SHARD 0, HYBRID_SHARD 3 and _HYBRID_SHARD_ZERO2 2
  within each node (or dim 1 of a 2-D ``device_mesh``); Accelerate also takes their ``auto()`` values 1-5 and drops
  the leading underscore (``fsdp_sharding_strategy``, read with ``fsdp_version: 1``);
* FSDP2 ``fully_shard(reshard_after_forward=...)``: True 3, False 2, an int reshards to groups of that size (hpZ);
  a 2-D mesh is (replicate, shard): its dim 1 is the shard group. Accelerate's ``fsdp_reshard_after_forward`` (with
  ``fsdp_version: 2``) is the same bool, its ``parallelism_config`` ``dp_replicate_size`` x ``dp_shard_size`` the
  mesh;
* DeepSpeed: ``zero_optimization.stage`` is the core stage itself; ``zero_hpz_partition_size`` (ZeRO++ hpZ) a
  secondary parameter partition of that many ranks for the backward all-gather, read as plain stage 3 (hpZ keeps
  the optimizer state sharded over all ranks, which ``hybrid_shard_size`` would not) and written from
  ``hybrid_shard_size``;
* Lightning: the strategy names its registry knows (``deepspeed_stage_2``, ``fsdp``, ...) build a strategy with
  arguments (``LIGHTNING_STRATEGIES``); ``ModelParallelStrategy`` applies FSDP2 over its data-parallel dimension;
* FairScale: FSDP (``reshard_after_forward`` as FSDP2's bool), OSS alone 1, OSS + ShardedDataParallel 2;
* torchtitan: ``data_parallel_shard_degree`` (1: DDP, else FSDP2 over that many ranks), ``data_parallel_replicate_
  degree`` (HSDP's replicas), ``fsdp_reshard_after_forward`` default / always / never;
* torchtune: ``fsdp_reshard_after_forward`` (FSDP2's bool), ``data_parallel_shard_dim`` / ``data_parallel_replicate_
  dim`` (as torchtitan's degrees).
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Layout(NamedTuple):
    """A layout in the core model's words: the stage, and whether it shards within groups (hybrid)."""

    stage: int
    hybrid: bool = False


#: FSDP1 ``ShardingStrategy`` members in declaration order: their ``auto()`` values 1..5 are the integer spellings.
FSDP1_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
#: Other spellings of the strategies (Accelerate drops the leading underscore).
FSDP1_ALIASES = {"HYBRID_SHARD_ZERO2": "_HYBRID_SHARD_ZERO2"}
#: FSDP1 strategy -> the core layout.
FSDP1_LAYOUTS = {
    "FULL_SHARD": Layout(3),
    "SHARD_GRAD_OP": Layout(2),
    "NO_SHARD": Layout(0),
    "HYBRID_SHARD": Layout(3, hybrid=True),
    "_HYBRID_SHARD_ZERO2": Layout(2, hybrid=True),
}
#: The hybrid strategy of each sharding one (the same stage, within each shard group).
FSDP1_HYBRID = {"FULL_SHARD": "HYBRID_SHARD", "SHARD_GRAD_OP": "_HYBRID_SHARD_ZERO2"}

#: The Hugging Face Trainer's ``fsdp`` options that name a strategy (its ``FSDPOption``), lower-case FSDP1 names.
TRAINER_OPTIONS = {"full_shard": "FULL_SHARD", "shard_grad_op": "SHARD_GRAD_OP", "hybrid_shard": "HYBRID_SHARD",
                   "hybrid_shard_zero2": "_HYBRID_SHARD_ZERO2", "no_shard": "NO_SHARD"}  # fmt: skip
#: The Trainer's options with FSDP2, where only the reshard decision is left: option -> reshard_after_forward.
TRAINER_FSDP2_OPTIONS = {"full_shard": True, "shard_grad_op": False}

#: torchtitan's ``parallelism.fsdp_reshard_after_forward`` -> the reshard decision (None: torchtitan's default,
#: which reshards except under pipelining).
TORCHTITAN_RESHARD = {"default": None, "always": True, "never": False}

#: FairScale's layouts: which of its wrappers give each stage (it has no plain data parallel).
FAIRSCALE_LAYOUTS = {0: "none", 1: "oss", 2: "oss+sdp", 3: "fsdp"}

#: Lightning 2.6's registered strategy names -> (the strategy class, the arguments the name gives it).
LIGHTNING_STRATEGIES: dict[str, tuple[str, dict[str, Any]]] = {
    "deepspeed": ("DeepSpeedStrategy", {}),
    "deepspeed_stage_1": ("DeepSpeedStrategy", {"stage": 1}),
    "deepspeed_stage_2": ("DeepSpeedStrategy", {"stage": 2}),
    "deepspeed_stage_2_offload": ("DeepSpeedStrategy", {"stage": 2, "offload_optimizer": True}),
    "deepspeed_stage_3": ("DeepSpeedStrategy", {"stage": 3}),
    "deepspeed_stage_3_offload": ("DeepSpeedStrategy", {"stage": 3, "offload_optimizer": True,
                                                        "offload_parameters": True}),
    "deepspeed_stage_3_offload_nvme": ("DeepSpeedStrategy", {"stage": 3, "offload_optimizer": True,
                                                             "offload_parameters": True, "remote_device": "nvme",
                                                             "offload_params_device": "nvme",
                                                             "offload_optimizer_device": "nvme"}),
    "fsdp": ("FSDPStrategy", {}),
    "fsdp_cpu_offload": ("FSDPStrategy", {"cpu_offload": True}),
}  # fmt: skip

#: A 2-D device mesh's dimensions (``fully_shard``'s docstring): dim 0 replicates, dim 1 shards.
MESH_DIMS = ("replicate", "shard")


def fsdp1_strategy_name(value: Any) -> str | None:
    """The FSDP1 strategy a plain value names (a member, an alias, any case, or its 1-based integer); else None."""
    if isinstance(value, (list, dict, bool)):
        return None
    text = str(value).upper()
    if text.isdigit():
        return FSDP1_STRATEGIES[int(text) - 1] if 1 <= int(text) <= len(FSDP1_STRATEGIES) else None
    text = FSDP1_ALIASES.get(text, text)
    return text if text in FSDP1_LAYOUTS else None


def stage_of_reshard(reshard_after_forward: bool) -> int:
    """The stage of FSDP2's (FairScale's, torchtune's) ``reshard_after_forward`` switch: ZeRO-3 when on, else 2."""
    return 3 if reshard_after_forward else 2


def reshards(stage: int, reshard_after_forward: bool | None) -> bool:
    """Whether the core layout frees gathered parameters after forward (never below stage 2)."""
    if stage < 2:
        return False
    return reshard_after_forward if reshard_after_forward is not None else stage == 3


def fsdp1_strategy(stage: int, reshard_after_forward: bool | None, hybrid: bool) -> str:
    """The FSDP1 strategy of a core layout. Stage 1 has none of its own: SHARD_GRAD_OP (it shards more)."""
    if stage == 0:
        return "NO_SHARD"
    name = "FULL_SHARD" if reshards(stage, reshard_after_forward) else "SHARD_GRAD_OP"
    return FSDP1_HYBRID[name] if hybrid else name


def fairscale_layout(stage: int) -> str:
    """FairScale's wrappers for a stage (``FAIRSCALE_LAYOUTS``)."""
    return FAIRSCALE_LAYOUTS[stage]


def lightning_strategy(name: str) -> tuple[str, dict[str, Any]] | None:
    """The strategy class and arguments a Lightning strategy name stands for (None: not a sharding strategy)."""
    return LIGHTNING_STRATEGIES.get(name)


def is_count(value: Any) -> bool:
    """A whole number (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def hybrid_degrees(replicate: Any, shard: Any) -> str:
    """What a (replicate, shard) pair of data-parallel degrees says (torchtitan, torchtune, Accelerate's
    parallelism_config; -1: the ranks the others leave): "hybrid" (replicas of shard groups of a known size),
    "replicate_rest" (replicas of groups of the remaining ranks) or "flat" (one shard group, or plain DDP)."""
    if not is_count(replicate) or replicate <= 1:
        return "flat"
    if is_count(shard) and shard > 1:
        return "hybrid"
    return "replicate_rest" if shard == -1 else "flat"


def data_parallel_ranks(world: Any, model_degree: int) -> int | None:
    """The data-parallel ranks of a known world size over the model-parallel degrees' product (None: unknown)."""
    if not is_count(world):
        return None
    return world // model_degree if world % model_degree == 0 else world


def hybrid_mesh(size: Any, ranks: Any) -> tuple[int, int] | None:
    """(replicate, shard) degrees of hybrid groups of ``size`` among ``ranks`` data-parallel ranks; None unless
    both are known numbers and the size divides the ranks."""
    if is_count(size) and is_count(ranks) and size > 0 and ranks % size == 0:
        return ranks // size, size
    return None
