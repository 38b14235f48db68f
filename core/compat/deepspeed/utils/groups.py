"""``deepspeed.utils.groups``: DeepSpeed's process-group accessors, on ``torch.distributed`` groups.

Without a model-parallel unit the data-parallel group is the world group and the model- and tensor-parallel sizes
are 1 (rank 0). ``deepspeed.initialize(mpu=...)`` records a Megatron-style ``mpu`` here, as DeepSpeed's engine does
(``groups.mpu``): the data- and model-parallel accessors then answer from it (a ``parallel_state_sp`` sequence
unit gives no data-parallel group and a model-parallel size of 1, as in DeepSpeed). The sequence-parallel accessors
give the groups of the engine's
Ulysses sequence parallelism (``sequence_parallel_size``, kept by :mod:`torsh.engine.parallel.sequence`): groups of
``sp`` consecutive ranks, and the sequence-data-parallel group of every rank; size 1 (and DeepSpeed's KeyError for
the group) without it. The expert-parallel helpers give the groups
DeepSpeed's MoE layout asks for (``_create_expert_and_data_parallel``: each data-parallel rank list cut into
expert-parallel groups of consecutive members, and the expert-data-parallel groups across them), made and kept
by :mod:`torsh.engine.parallel.moe`, whose engine steps reduce expert gradients over them.
"""

from __future__ import annotations

from torsh.engine.parallel import moe as _moe
from torsh.engine.parallel import sequence as _sequence

from .._unsupported import NotSupportedByTorsh, message

_WORLD_GROUP = None
mpu = None
"""DeepSpeed's model-parallel unit, as its engine records it (``deepspeed.initialize(mpu=...)``), else None."""


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


def _model_unit():
    """The recorded Megatron-style unit; None when there is none or it is a ``parallel_state_sp`` sequence unit
    (DeepSpeed's accessors treat that one as having no data- or model-parallel axis of its own)."""
    return None if mpu is None or _sequence.is_sequence_mpu(mpu) else mpu


def _get_data_parallel_group():
    if mpu is not None:
        return None if _model_unit() is None else mpu.get_data_parallel_group()
    return _dist().group.WORLD


get_data_parallel_group = _get_data_parallel_group


def _get_data_parallel_group_ranks() -> list[int]:
    unit = _model_unit()
    if unit is not None and hasattr(unit, "get_data_parallel_group_ranks"):
        return list(unit.get_data_parallel_group_ranks())
    if unit is not None:
        return list(_dist().get_process_group_ranks(unit.get_data_parallel_group()))
    return list(range(_get_data_parallel_world_size()))


def _get_data_parallel_world_size():
    if mpu is not None:
        return None if _model_unit() is None else mpu.get_data_parallel_world_size()
    return _dist().get_world_size() if _initialized() else 1


def _get_data_parallel_rank() -> int:
    unit = _model_unit()
    if unit is not None:
        return unit.get_data_parallel_rank()
    return _dist().get_rank() if _initialized() else 0


get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank


def _get_broadcast_src_rank() -> int:
    return 0


def _get_model_parallel_world_size() -> int:
    unit = _model_unit()
    return 1 if unit is None else unit.get_model_parallel_world_size()


def get_model_parallel_group():
    unit = _model_unit()
    return None if unit is None else unit.get_model_parallel_group()


def get_model_parallel_world_size() -> int:
    return _get_model_parallel_world_size()


def get_model_parallel_rank() -> int:
    unit = _model_unit()
    return 0 if unit is None else unit.get_model_parallel_rank()


get_tensor_model_parallel_group = get_model_parallel_group
get_tensor_model_parallel_world_size = get_model_parallel_world_size
get_tensor_model_parallel_rank = get_model_parallel_rank


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of the first member of this rank's model-parallel group (DeepSpeed's
    ``(rank // mp) * mp`` for its groups of consecutive ranks); this rank itself at model-parallel size 1."""
    unit = _model_unit()
    if unit is not None and unit.get_model_parallel_world_size() > 1:
        return _dist().get_global_rank(unit.get_model_parallel_group(), 0)
    return _dist().get_rank() if _initialized() else 0


_get_sequence_parallel_world_size = _sequence.world_size
_get_sequence_parallel_rank = _sequence.rank
_get_sequence_parallel_group = _sequence.group


def _get_sequence_data_parallel_group():
    """The group gradients are reduced over: every rank (under sequence parallelism its own group of them)."""
    group = _sequence.data_group()
    return group if group is not None else _get_data_parallel_group()


def _get_sequence_data_parallel_world_size() -> int:
    group = _sequence.data_group()
    return _dist().get_world_size(group=group) if group is not None else _get_data_parallel_world_size()


def _get_sequence_data_parallel_rank() -> int:
    group = _sequence.data_group()
    return _dist().get_rank(group=group) if group is not None else _get_data_parallel_rank()


def _get_expert_model_parallel_world_size() -> int:
    return 1


def _clone_world_group():
    """A group of every rank, distinct from the default group (made once, collectively)."""
    global _WORLD_GROUP
    if _WORLD_GROUP is None:
        dist = _dist()
        _WORLD_GROUP = dist.new_group(ranks=range(dist.get_world_size()))
    return _WORLD_GROUP


# ---- expert parallelism (the groups live in torsh.engine.parallel.moe, which the engine reads) ------------


def _get_expert_parallel_ranks(world_size: int, tensor_parallel_size_: int, expert_parallel_size_: int,
                               pipeline_parallel_size_: int = 1,
                               use_data_before_expert_parallel_: bool = False) -> tuple[list, list]:  # fmt: skip
    """(expert-parallel rank lists, expert-data-parallel rank lists) of DeepSpeed's E + M + D layout
    (:func:`torsh.engine.parallel.moe.expert_parallel_ranks`)."""
    return _moe.expert_parallel_ranks(world_size, tensor_parallel_size_, expert_parallel_size_,
                                      pipeline_parallel_size_, use_data_before_expert_parallel_)  # fmt: skip


def _create_expert_and_data_parallel(expert_parallel_size_: int, mp_size=None, pp_size=None, mp_mode: str = "tp",
                                     use_data_before_expert_parallel_: bool = False, folding_spec=None) -> None:
    """Make the expert-parallel and expert-data-parallel groups of size ``expert_parallel_size_`` (collective:
    every rank calls it; done once per size, under the name ``ep_size_<n>``). torsh runs no model parallelism
    beside it: ``mp_size``/``pp_size`` above 1 and AutoEP's ``folding_spec`` are refused."""
    if (mp_size or 1) > 1 or (pp_size or 1) > 1 or folding_spec is not None:
        raise NotSupportedByTorsh(message("utils.groups._create_expert_and_data_parallel", "expert groups beside "
                                          "tensor, sequence or pipeline parallelism (mp_size/pp_size > 1, AutoEP "
                                          "folding) are not made by torsh; expert x data parallelism is"))
    _moe.create_expert_groups(expert_parallel_size_, use_data_before_expert_parallel_)


def _create_expert_data_and_model_parallel(expert_parallel_size_: int, mpu, use_data_before_expert_parallel_=False):
    """DeepSpeed's expert groups beside a Megatron ``mpu``'s tensor parallelism: not made by torsh."""
    raise NotSupportedByTorsh(message("utils.groups._create_expert_data_and_model_parallel", "expert tensor "
                                      "parallelism beside an mpu is not run by torsh (the engine takes no mpu); "
                                      "use enable_expert_tensor_parallelism=False"))


_EXPERT_PARALLEL_GROUP = _moe.EXPERT_PARALLEL
_EXPERT_DATA_PARALLEL_GROUP = _moe.EXPERT_DATA_PARALLEL
_EXPERT_PARALLEL_GROUP_RANKS = _moe.EXPERT_PARALLEL_RANKS
_EXPERT_DATA_PARALLEL_GROUP_RANKS = _moe.EXPERT_DATA_PARALLEL_RANKS


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
