"""``deepspeed.utils.groups``: DeepSpeed's process-group accessors, on ``torch.distributed`` groups.

The torsh engine runs data parallelism over the whole world: the data-parallel group is the world group, the
model-, tensor- and sequence-parallel sizes are 1 (rank 0). The expert-parallel helpers build the groups
DeepSpeed's MoE layout asks for (``_create_expert_and_data_parallel``: each data-parallel rank list cut into
expert-parallel groups of consecutive members, and the expert-data-parallel groups across them) as
``torch.distributed.new_group`` groups, for code that reduces over them; torsh's engine runs no MoE layer itself.
"""

from __future__ import annotations

from typing import Any

_EXPERT_PARALLEL_GROUP: dict[str, Any] = {}
_EXPERT_DATA_PARALLEL_GROUP: dict[str, Any] = {}
_EXPERT_PARALLEL_GROUP_RANKS: dict[str, list[int]] = {}
_EXPERT_DATA_PARALLEL_GROUP_RANKS: dict[str, list[int]] = {}
_WORLD_GROUP = None


def _dist():
    import torch.distributed as dist

    return dist


def _initialized() -> bool:
    dist = _dist()
    return dist.is_available() and dist.is_initialized()


def _ensure_divisibility(numerator: int, denominator: int) -> None:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"


def initialize(ep_size: int = 1, mpu=None) -> None:
    """Deprecated in DeepSpeed (the groups are made on demand); nothing to do."""


# ---- data / model / sequence parallelism (torsh: data parallel over the world) ----------------------------


def _get_data_parallel_group():
    return _dist().group.WORLD


get_data_parallel_group = _get_data_parallel_group


def _get_data_parallel_group_ranks() -> list[int]:
    return list(range(_get_data_parallel_world_size()))


def _get_data_parallel_world_size() -> int:
    return _dist().get_world_size() if _initialized() else 1


def _get_data_parallel_rank() -> int:
    return _dist().get_rank() if _initialized() else 0


get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank


def _get_broadcast_src_rank() -> int:
    return 0


def _get_model_parallel_world_size() -> int:
    return 1


def get_model_parallel_group():
    return None


def get_model_parallel_world_size() -> int:
    return 1


def get_model_parallel_rank() -> int:
    return 0


get_tensor_model_parallel_group = get_model_parallel_group
get_tensor_model_parallel_world_size = get_model_parallel_world_size
get_tensor_model_parallel_rank = get_model_parallel_rank


def get_tensor_model_parallel_src_rank() -> int:
    return _get_data_parallel_rank()


def _get_sequence_parallel_world_size() -> int:
    return 1


def _get_sequence_parallel_rank() -> int:
    return 0


def _get_sequence_parallel_group():
    return None


_get_sequence_data_parallel_world_size = _get_data_parallel_world_size
_get_sequence_data_parallel_rank = _get_data_parallel_rank
_get_sequence_data_parallel_group = _get_data_parallel_group


def _get_expert_model_parallel_world_size() -> int:
    return 1


def _clone_world_group():
    """A group of every rank, distinct from the default group (made once, collectively)."""
    global _WORLD_GROUP
    if _WORLD_GROUP is None:
        dist = _dist()
        _WORLD_GROUP = dist.new_group(ranks=range(dist.get_world_size()))
    return _WORLD_GROUP


# ---- expert parallelism ----------------------------------------------------------------------------------


def _get_expert_parallel_ranks(world_size: int, tensor_parallel_size_: int, expert_parallel_size_: int,
                               pipeline_parallel_size_: int = 1,
                               use_data_before_expert_parallel_: bool = False) -> tuple[list, list]:  # fmt: skip
    """(expert-parallel rank lists, expert-data-parallel rank lists) for DeepSpeed's E + M + D layout: ranks of
    one tensor-parallel group are consecutive; each pipeline stage's data-parallel groups take every
    ``tensor_parallel_size_``-th rank; each data-parallel list is cut into expert-parallel groups of
    ``expert_parallel_size_`` consecutive members, and the i-th members of those groups form an
    expert-data-parallel group. ``use_data_before_expert_parallel_`` (D + E) orders each data-parallel list
    so that the expert-parallel groups are strided instead."""
    tp, pp, ep = tensor_parallel_size_, pipeline_parallel_size_, expert_parallel_size_
    _ensure_divisibility(world_size, tp * pp)
    dp_world_size = world_size // (tp * pp)
    _ensure_divisibility(dp_world_size, ep)
    stage_size = world_size // pp
    data_parallel: list[list[int]] = []
    for stage_start in range(0, world_size, stage_size):
        for offset in range(tp):
            members = list(range(stage_start + offset, stage_start + stage_size, tp))
            if use_data_before_expert_parallel_:
                stride = dp_world_size // ep
                members = [members[j] for first in range(stride) for j in range(first, dp_world_size, stride)]
            data_parallel.append(members)
    expert_parallel: list[list[int]] = []
    expert_data_parallel: list[list[int]] = []
    for members in data_parallel:
        chunks = [members[i:i + ep] for i in range(0, dp_world_size, ep)]
        expert_parallel.extend(chunks)
        expert_data_parallel.extend([list(column) for column in zip(*chunks)])
    return expert_parallel, expert_data_parallel


def _create_expert_and_data_parallel(expert_parallel_size_: int, use_data_before_expert_parallel_: bool = False):
    """Make the expert-parallel and expert-data-parallel groups of size ``expert_parallel_size_`` (collective:
    every rank calls it; done once per size, under the name ``ep_size_<n>``)."""
    dist = _dist()
    world = dist.get_world_size()
    ep = min(expert_parallel_size_, world)
    _ensure_divisibility(world, ep)
    name = f"ep_size_{ep}"
    if name in _EXPERT_PARALLEL_GROUP:
        return
    rank = dist.get_rank()
    expert_parallel, expert_data_parallel = _get_expert_parallel_ranks(world, 1, ep, 1,
                                                                       use_data_before_expert_parallel_)  # fmt: skip
    for ranks in expert_parallel:
        group = dist.new_group(ranks)  # every rank creates every group, as torch requires
        if rank in ranks:
            _EXPERT_PARALLEL_GROUP[name], _EXPERT_PARALLEL_GROUP_RANKS[name] = group, ranks
    for ranks in expert_data_parallel:
        group = dist.new_group(ranks)
        if rank in ranks:
            _EXPERT_DATA_PARALLEL_GROUP[name], _EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = group, ranks


def _get_max_expert_size() -> int | None:
    sizes = [int(name.rsplit("_", 1)[1]) for name in _EXPERT_PARALLEL_GROUP]
    return max(sizes) if sizes else None


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group():
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_expert_parallel_group(group_name: str):
    assert group_name in _EXPERT_PARALLEL_GROUP, "expert parallel group is not initialized"
    return _EXPERT_PARALLEL_GROUP[group_name]


def _get_expert_parallel_group_ranks(group_name: str) -> list[int]:
    assert group_name in _EXPERT_PARALLEL_GROUP_RANKS, "expert parallel group is not initialized"
    return _EXPERT_PARALLEL_GROUP_RANKS[group_name]


def _get_expert_parallel_group_dict() -> dict:
    return _EXPERT_PARALLEL_GROUP


def _get_expert_data_parallel_group(group_name: str):
    assert group_name in _EXPERT_DATA_PARALLEL_GROUP, "expert data parallel group is not initialized"
    return _EXPERT_DATA_PARALLEL_GROUP[group_name]


def _get_expert_data_parallel_group_ranks(group_name: str) -> list[int]:
    assert group_name in _EXPERT_DATA_PARALLEL_GROUP_RANKS, "expert data parallel group is not initialized"
    return _EXPERT_DATA_PARALLEL_GROUP_RANKS[group_name]


def _get_expert_data_parallel_group_dict() -> dict:
    return _EXPERT_DATA_PARALLEL_GROUP


def _get_expert_parallel_world_size(group_name: str) -> int:
    return _dist().get_world_size(group=_get_expert_parallel_group(group_name))


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return _dist().get_world_size(group=_get_expert_data_parallel_group(group_name))


def _get_expert_parallel_rank(group_name: str) -> int:
    return _dist().get_rank(group=_get_expert_parallel_group(group_name))


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return _dist().get_rank(group=_get_expert_data_parallel_group(group_name))


def _get_expert_parallel_src_rank(group_name: str) -> int:
    return _get_expert_parallel_group_ranks(group_name)[0]


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    return _get_expert_data_parallel_group_ranks(group_name)[0]
