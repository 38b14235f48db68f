"""``deepspeed.runtime.sequence_parallel.parallel_state_sp``: the process groups of DeepSpeed-Ulysses, as a small
Megatron-style ``mpu``.

``initialize_sequence_parallel(P)`` splits the world into groups of ``P`` consecutive ranks (the sequence-parallel
groups: the ranks that share one sequence) and one sequence-data-parallel group per ``P * (world / P)`` ranks (every
rank: the ranks over which gradients are averaged). The model-parallel accessors are the sequence-parallel ones, as
DeepSpeed aliases them. Call it on every rank (creating groups is collective).
"""

from __future__ import annotations

import torch.distributed as dist

_SEQUENCE_PARALLEL_GROUP = None
_SEQUENCE_DATA_PARALLEL_GROUP = None


def _release_sequence_parallel_groups() -> None:
    """Forget the groups (after the process group they belong to is destroyed)."""
    global _SEQUENCE_PARALLEL_GROUP, _SEQUENCE_DATA_PARALLEL_GROUP
    _SEQUENCE_PARALLEL_GROUP = None
    _SEQUENCE_DATA_PARALLEL_GROUP = None


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Create the sequence-parallel and sequence-data-parallel groups (see the module docstring)."""
    global _SEQUENCE_PARALLEL_GROUP, _SEQUENCE_DATA_PARALLEL_GROUP
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("initialize_sequence_parallel needs the process group: call deepspeed.init_distributed() "
                           "(or torch.distributed.init_process_group) first")  # fmt: skip
    world = dist.get_world_size()
    if world < sequence_parallel_size:
        raise RuntimeError(f"world_size ({world}) is less than sequence_parallel_size {sequence_parallel_size}")
    if sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got {sequence_parallel_size}")
    if world % sequence_parallel_size:
        raise RuntimeError(f"world_size ({world}) is not divisible by sequence_parallel_size "
                           f"{sequence_parallel_size})")  # fmt: skip
    if _SEQUENCE_PARALLEL_GROUP is not None or _SEQUENCE_DATA_PARALLEL_GROUP is not None:
        raise RuntimeError("the sequence parallel groups are already initialized")
    rank = dist.get_rank()
    for start in range(0, world, sequence_parallel_size):  # every rank creates every group, as torch requires
        ranks = list(range(start, start + sequence_parallel_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            _SEQUENCE_PARALLEL_GROUP = group
    _SEQUENCE_DATA_PARALLEL_GROUP = dist.new_group(list(range(world)))


def get_sequence_parallel_group():
    """The sequence-parallel group of this rank."""
    if _SEQUENCE_PARALLEL_GROUP is None:
        raise RuntimeError("sequence parallel group is not initialized: call initialize_sequence_parallel(size)")
    return _SEQUENCE_PARALLEL_GROUP


def get_sequence_data_parallel_group():
    """The sequence-data-parallel group of this rank."""
    if _SEQUENCE_DATA_PARALLEL_GROUP is None:
        raise RuntimeError("sequence data parallel group is not initialized: call "
                           "initialize_sequence_parallel(size)")  # fmt: skip
    return _SEQUENCE_DATA_PARALLEL_GROUP


def get_sequence_parallel_world_size() -> int:
    return dist.get_world_size(group=get_sequence_parallel_group())


def get_sequence_data_parallel_world_size() -> int:
    return dist.get_world_size(group=get_sequence_data_parallel_group())


def get_sequence_parallel_rank() -> int:
    return dist.get_rank(group=get_sequence_parallel_group())


def get_sequence_data_parallel_rank() -> int:
    return dist.get_rank(group=get_sequence_data_parallel_group())


get_model_parallel_rank = get_sequence_parallel_rank
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_group = get_sequence_parallel_group
