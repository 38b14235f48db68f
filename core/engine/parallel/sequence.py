"""DeepSpeed-Ulysses sequence parallelism in the engine: the process groups.

With a sequence-parallel degree ``sp`` (``parallelism.sp``; DeepSpeed's ``sequence_parallel_size``, Accelerate's
``sp_size``) each sequence is split over ``sp`` consecutive ranks (a *sequence-parallel group*); the model's
``DistributedAttention`` exchanges heads for sequence inside it with all-to-alls, so every other layer sees only
its rank's part of the sequence. The *sequence-data-parallel group* is every rank: the gradients are reduced and
the ZeRO partitions laid out over it. These are the groups of DeepSpeed's ``parallel_state_sp``; a script that
built them itself and passes that module as ``mpu`` (as Megatron-DeepSpeed and Accelerate do) has them used.

DeepSpeed reduces the gradients with an all-reduce over every rank divided by the data-parallel size (world /
sp), not by the world size: summed over the sequence-parallel peers, averaged over the data-parallel replicas. So
each rank's loss is its share of the sequence's loss (DeepSpeed's Ulysses scripts divide by the peers' total
weight), and the peers' shares add up to the loss of the whole sequence. The engine reduces with the data-parallel
layout of every rank (DDP, ZeRO-1/2, FSDP2) with that divisor (``ShardPlan.sp`` in
:mod:`torsh.engine.zero.sharding`), so the gradients are DeepSpeed's whether the script back-propagates through
``engine.backward`` or calls ``loss.backward()`` itself.

The groups live here (the engine never imports the DeepSpeed compatibility layer); ``deepspeed.utils.groups``'
sequence accessors read :data:`CURRENT`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from torsh.errors import ConfigError, Problem

from ..distributed import own_group


@dataclass(frozen=True)
class SequenceGroups:
    """This rank's sequence-parallel groups (:func:`build_sequence_groups`)."""

    size: int
    """The sequence-parallel degree."""
    group: Any
    """This rank's sequence-parallel group (``sp`` consecutive ranks)."""
    data_group: Any
    """The sequence-data-parallel group (every rank): the gradient reduction and the ZeRO partitions."""
    ranks: tuple[int, ...]
    """The global ranks of :attr:`group`."""
    world: Any = None
    """The default process group the groups were made in (a later one makes them stale)."""
    mpu: Any = None
    """The ``parallel_state_sp``-style module the script passed as ``mpu`` (None: the engine made the groups)."""
    replicas: Any = None
    """The data-parallel group: the ``world / sp`` ranks at this rank's position in their sequence-parallel groups
    (one per sequence; DeepSpeed's ``data_parallel`` mesh dimension beside ``sequence_parallel``)."""

    @property
    def rank(self) -> int:
        """This rank's index in its sequence-parallel group."""
        return self.ranks.index(dist.get_rank())

    def engine_members(self) -> dict[str, Any]:
        """DeepSpeed's engine members for sequence parallelism."""
        members = {"sequence_parallel_size": self.size, "seq_parallel_group": self.group,
                   "seq_data_parallel_group": self.data_group,
                   "seq_dp_world_size": dist.get_world_size(group=self.data_group),
                   "get_sequence_parallel_group": lambda: self.group, "_dp_group": self.replicas}
        if self.mpu is not None:
            members["mpu"] = self.mpu
        return members


CURRENT: SequenceGroups | None = None
"""The sequence-parallel groups of the last engine built with sequence parallelism (None: none yet)."""


def is_sequence_mpu(mpu: Any) -> bool:
    """Whether ``mpu`` is DeepSpeed's sequence-parallel unit (``parallel_state_sp``, or the object Accelerate's
    Ulysses support returns), recognised as DeepSpeed's groups recognise it."""
    return mpu is not None and hasattr(mpu, "initialize_sequence_parallel")


def degree_with_mpu(configured: int, mpu: Any) -> int:
    """The sequence-parallel degree: the config's, or the sequence-parallel unit's when the config gives none; a
    different degree in both is an error naming the key."""
    if not is_sequence_mpu(mpu):
        return configured
    try:
        given = int(mpu.get_sequence_parallel_world_size())
    except (AssertionError, RuntimeError) as exc:
        raise ConfigError([Problem("mpu", type(mpu).__name__, f"the sequence-parallel mpu has no groups ({exc}): "
                                   "call initialize_sequence_parallel(size) on every rank before initialize, or "
                                   "pass no mpu and set sequence_parallel_size in the config")]) from None
    if configured not in (1, given):
        raise ConfigError([Problem("sequence_parallel_size", configured, f"the mpu's sequence-parallel groups have "
                                   f"{given} ranks: give the same degree in both, or drop one")])  # fmt: skip
    return given


def build_sequence_groups(sp: int, *, mpu: Any = None, experts: bool = False) -> SequenceGroups | None:
    """This rank's groups for the degree ``sp`` (collective: every rank calls it; None when ``sp`` is 1). An
    ``mpu`` that is a sequence-parallel unit gives its own groups; otherwise the groups of an earlier engine of the
    same degree are reused, or new ones made. ``experts``: the model has local MoE experts (refused beside it)."""
    global CURRENT
    if sp == 1:
        return None
    if experts:
        raise ConfigError([Problem("parallelism.sp", sp, "sequence parallelism beside MoE expert parallelism is "
                                   "not run by the torsh engine: set sequence_parallel_size to 1, or the MoE "
                                   "layers' ep_size to 1")])  # fmt: skip
    if mpu is not None and not is_sequence_mpu(mpu):
        raise ConfigError([Problem("parallelism.sp", sp, "sequence parallelism beside a Megatron-style mpu's model "
                                   "axis is not run by the torsh engine: set sequence_parallel_size to 1, or pass "
                                   "DeepSpeed's parallel_state_sp as the mpu")])  # fmt: skip
    group, ranks, replicas, data_group = _made(sp)
    if is_sequence_mpu(mpu):
        group, data_group = mpu.get_sequence_parallel_group(), mpu.get_sequence_data_parallel_group()
        ranks = tuple(dist.get_process_group_ranks(group))
    CURRENT = SequenceGroups(sp, group, data_group, ranks, dist.group.WORLD, mpu if is_sequence_mpu(mpu) else None,
                             replicas)  # fmt: skip
    return CURRENT


def _made(sp: int) -> tuple[Any, tuple[int, ...], Any, Any]:
    """``(group, ranks, replicas, every rank)`` for the degree ``sp`` in the current default group, made once
    (collective: :func:`torsh.engine.distributed.own_group`)."""
    world = dist.get_world_size()
    group, ranks = own_group([list(range(first, first + sp)) for first in range(0, world, sp)])
    replicas, _ = own_group([list(range(position, world, sp)) for position in range(sp)])
    every, _ = own_group([list(range(world))])
    return group, ranks, replicas, every


def world_size() -> int:
    """``deepspeed.utils.groups._get_sequence_parallel_world_size``: the degree (1 without groups)."""
    return CURRENT.size if _live() else 1


def rank() -> int:
    """``deepspeed.utils.groups._get_sequence_parallel_rank``: this rank's index in its group (0 without)."""
    return CURRENT.rank if _live() else 0


def group() -> Any:
    """``deepspeed.utils.groups._get_sequence_parallel_group``: this rank's group; DeepSpeed's KeyError without."""
    if not _live():
        raise KeyError("No sequence parallel group found")
    return CURRENT.group


def data_group() -> Any | None:
    """The sequence-data-parallel group (None without sequence parallelism: the data-parallel group serves)."""
    return CURRENT.data_group if _live() else None


def _live() -> bool:
    return CURRENT is not None and dist.is_available() and dist.is_initialized() and CURRENT.world is dist.group.WORLD
