"""A Megatron-style ``mpu`` (model-parallel unit) passed to ``initialize(..., mpu=mpu)`` drives the engine's groups.

Megatron-DeepSpeed and GPT-NeoX split their layers over a tensor-parallel group themselves (column- and
row-parallel linears) and hand DeepSpeed an object that names the groups: ``get_data_parallel_group/_rank/
_world_size`` and ``get_model_parallel_group/_rank/_world_size``. DeepSpeed 0.19.8 then

- splits the batch over, averages the gradients over, and partitions ZeRO-1/2 over the data-parallel group only;
- starts each data-parallel group from the weights of its first rank (the model-parallel slices differ);
- computes the clipping norm as the sum of the squared gradients of the parameters marked model-parallel
  (``model_parallel`` or ``tensor_model_parallel`` true) on every model-parallel rank, plus those of the other
  (duplicated) parameters on model-parallel rank 0 only, summed over the model-parallel group;
- names its checkpoint files by the model-parallel rank (``mp_rank_XX_model_states.pt``).

:func:`read_mpu` checks the object once (every method there, the sizes multiplying to the world size, the groups
matching the sizes and ranks) and returns :class:`MpuGroups`, which the engine reads where it would otherwise
take the world: it has the members of :class:`torsh.plan.Degrees` the engine reads (``dp``, ``tp``, ``dp_rank``,
``coordinates``), so the engine's rank and size queries answer from the mpu.

ZeRO-3 with a model-parallel size above 1 is refused by name: FSDP2 would shard each rank's slice over the
data-parallel group, which torsh does not lay out from an mpu.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torsh.engine.agreement import describe, every_rank
from torsh.errors import ConfigError, Problem

from .sequence import is_sequence_mpu

#: What DeepSpeed's engine, its ZeRO optimizers and its norm call on an ``mpu``.
REQUIRED = ("get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_world_size",
            "get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size")  # fmt: skip

#: The parameter attributes that mark a model-parallel slice (DeepSpeed's ``is_model_parallel_parameter``).
MODEL_PARALLEL_MARKS = ("model_parallel", "tensor_model_parallel")


def is_model_parallel_parameter(p: torch.Tensor) -> bool:
    """Whether ``p`` is a slice of a parameter split over the model-parallel group (its gradient counts on every
    model-parallel rank); an unmarked parameter is a copy every model-parallel rank holds."""
    return any(bool(getattr(p, mark, False)) for mark in MODEL_PARALLEL_MARKS)


@dataclass
class MpuGroups:
    """The groups and positions an ``mpu`` gives, checked (:func:`read_mpu`)."""

    mpu: Any
    dp_group: Any
    data_rank: int
    """This rank's index in the data-parallel group."""
    dp: int
    """The data-parallel size: the ranks the batch is split over and the gradients averaged over."""
    mp_group: Any
    mp_rank: int
    tp: int
    """The model-parallel size (DeepSpeed's ``mp_world_size``)."""
    dp_src: int = 0
    """The global rank of the data-parallel group's first rank (its weights are every replica's start)."""
    _duplicated: list = field(default_factory=list)
    _duplicated_ids: frozenset = frozenset()
    _partition_norm: tuple | None = None
    """``(partition, its norm function)``: built at the first step with a ZeRO-1/2 partition, kept after."""

    # -- the members of torsh.plan.Degrees the engine reads ----------------------------------------

    def dp_rank(self, rank: int) -> int:  # noqa: ARG002 (only this process's position is known)
        """This rank's index in the data-parallel group (``rank`` is this process's global rank)."""
        return self.data_rank

    def coordinates(self, rank: int) -> dict[str, int]:  # noqa: ARG002
        """This rank's model-parallel index, under the name the engine reads (``tp``)."""
        return {"tp": self.mp_rank}

    # -- checkpoints ----------------------------------------------------------------------------------

    @property
    def checkpoint_mp_rank(self) -> int:
        """DeepSpeed's ``checkpoint_mp_rank``: the model-parallel rank, 0 when the model is not split."""
        return self.mp_rank if self.tp > 1 else 0

    @property
    def model_states_name(self) -> str:
        """DeepSpeed's model-states file of this model-parallel rank."""
        from ..checkpoint.ds_model_states import model_states_file

        return model_states_file(self.checkpoint_mp_rank)

    def key_map(self, names) -> dict[str, str]:
        """This rank's model and optimizer-state keys in a checkpoint's DCP files: the model-parallel ranks hold
        different slices under the same names, which one set of DCP files would keep once, so each name is saved
        under ``mp_rank_XX/`` (unchanged when the model is not split)."""
        if self.tp == 1:
            return {}
        return {name: f"mp_rank_{self.checkpoint_mp_rank:02d}/{name}" for name in names}

    def checkpoint_files(self, model_states: dict | None, names) -> tuple[None, dict[str, dict], dict[str, str]]:
        """``(model_states, rank_files, key_map)`` for the checkpoint writer: DeepSpeed's model-states file of this
        model-parallel rank, written by the data-parallel group's first rank under its ``mp_rank_XX`` name, and
        the DCP keys of :meth:`key_map`."""
        files = {self.model_states_name: model_states} if model_states is not None else {}
        return None, files, self.key_map(names)

    # -- start-up broadcast and gradient norm ------------------------------------------------------------

    def attach(self, model: nn.Module) -> None:
        """Remember ``model``'s duplicated parameters (and, once made, their fp32 masters) for the norm."""
        from ..precision import MASTER

        self._duplicated = [p for p in model.parameters() if not is_model_parallel_parameter(p)]
        ids = {id(p) for p in self._duplicated}
        ids |= {id(getattr(p, MASTER)) for p in self._duplicated if hasattr(p, MASTER)}
        self._duplicated_ids = frozenset(ids)

    def start_up(self, model: nn.Module) -> "_DataParallelBroadcast":
        """What :func:`torsh.engine.zero.sharding.sync_module_states` takes as ``skip``: every tensor is left to
        the broadcast within the data-parallel group (from its first rank), none goes over the world."""
        return _DataParallelBroadcast(self, model)

    def norm_function(self, params: list[torch.Tensor], partition: Any) -> Any:
        """The engine's gradient-norm function (of the gradients of ``params``, in that order) under DeepSpeed's
        rule; ``partition``: the ZeRO-1/2 partition (None at stage 0). None when the model is not split: the
        engine's own norm over the data-parallel ranks is that rule's value."""
        if self.tp == 1:
            return None
        if partition is not None:
            if self._partition_norm is None or self._partition_norm[0] is not partition:
                from ..zero.slots import ZERO_SLOT

                skip = [p for p in self._duplicated if hasattr(p, ZERO_SLOT)] if self.mp_rank != 0 else []
                self._partition_norm = (partition, functools.partial(partition.global_norm, skip=skip,
                                                                     over=(self.mp_group,)))  # fmt: skip
            return self._partition_norm[1]
        return functools.partial(self._norm, params)

    def _norm(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> float:
        """Stage 0: this rank's counted squares, summed over the model-parallel group (every data-parallel replica
        holds the same reduced gradients, so no sum over it)."""
        from ..zero.construction import comm_device

        local = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else comm_device(self.mp_group))
        for p, g in zip(params, grads):
            if self.mp_rank == 0 or id(p) not in self._duplicated_ids:
                local += torch.linalg.vector_norm(g.detach(), 2).double() ** 2
        dist.all_reduce(local, group=self.mp_group)
        total = float(local)
        return math.sqrt(total) if math.isfinite(total) else total


@dataclass
class _DataParallelBroadcast:
    groups: MpuGroups
    model: nn.Module

    def is_local(self, t: torch.Tensor) -> bool:  # noqa: ARG002
        return True

    @torch.no_grad()
    def broadcast(self) -> None:
        """Each data-parallel group's first rank's parameters and buffers into the group's other ranks."""
        if self.groups.dp == 1:
            return
        for t in [*self.model.parameters(), *self.model.buffers()]:
            dist.broadcast(t.data, src=self.groups.dp_src, group=self.groups.dp_group)


def read_mpu(mpu: Any, world_size: int) -> MpuGroups:
    """Check ``mpu`` against the job of ``world_size`` ranks and return its groups; a ``ConfigError`` naming
    ``mpu``, what is wrong and on which ranks otherwise. Collective: the ranks agree on the outcome first
    (:mod:`torsh.engine.agreement`), so a unit that is wrong on one rank stops every rank with the same error
    instead of leaving the others in the next collective."""
    groups, problem = None, None
    try:
        groups = _read(mpu, world_size)
    except _Refused as refused:
        problem = refused.text
    bad = every_rank(problem)
    if bad:
        raise ConfigError([Problem("mpu", type(mpu).__name__, describe(bad))])
    return groups


class _Refused(Exception):
    """What is wrong with the mpu on this rank (:func:`read_mpu` gathers it from every rank)."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text


def _read(mpu: Any, world_size: int) -> MpuGroups:
    missing = [name for name in REQUIRED if not callable(getattr(mpu, name, None))]
    if missing:
        raise _Refused(f"the mpu has no {', '.join(missing)}: DeepSpeed (and torsh) call {', '.join(REQUIRED)}; "
                       "give an mpu with all of them (Megatron's parallel_state, or PipelineParallelGrid over a "
                       "PipeModelDataParallelTopology)")  # fmt: skip
    if is_sequence_mpu(mpu):
        raise _Refused("an mpu with initialize_sequence_parallel is DeepSpeed's sequence-parallel groups object, "
                       "which DeepSpeed does not read as a model-parallel unit either: pass a Megatron-style mpu, "
                       "or give sequence_parallel_size in the config")  # fmt: skip
    values = {name: _call(mpu, name) for name in REQUIRED}
    dp, mp = values["get_data_parallel_world_size"], values["get_model_parallel_world_size"]
    dp_rank, mp_rank = values["get_data_parallel_rank"], values["get_model_parallel_rank"]
    problems = [f"{name}() returned {values[name]!r}, not an integer >= {low}"
                for name, low in (("get_data_parallel_world_size", 1), ("get_model_parallel_world_size", 1),
                                  ("get_data_parallel_rank", 0), ("get_model_parallel_rank", 0))
                if not isinstance(values[name], int) or isinstance(values[name], bool) or values[name] < low]
    if problems:
        raise _Refused("; ".join(problems))
    problems += _size_problems(mpu, dp, mp, world_size)
    problems += _group_problems("data", values["get_data_parallel_group"], dp, dp_rank)
    problems += _group_problems("model", values["get_model_parallel_group"], mp, mp_rank)
    if problems:
        raise _Refused("; ".join(problems))
    dp_group = values["get_data_parallel_group"]
    return MpuGroups(mpu=mpu, dp_group=dp_group, data_rank=dp_rank, dp=dp,
                     mp_group=values["get_model_parallel_group"], mp_rank=mp_rank, tp=mp,
                     dp_src=dist.get_global_rank(dp_group, 0) if dp_group is not None else 0)  # fmt: skip


def _call(mpu: Any, name: str) -> Any:
    try:
        return getattr(mpu, name)()
    except Exception as err:  # noqa: BLE001 (the user's object: say which call failed and why)
        raise _Refused(f"mpu.{name}() raised {type(err).__name__}: {err}; create the mpu's groups (e.g. "
                       "Megatron's initialize_model_parallel) before initialize") from None  # fmt: skip


def _size_problems(mpu: Any, dp: int, mp: int, world_size: int) -> list[str]:
    problems = []
    name = next((n for n in ("get_pipe_parallel_world_size", "get_pipeline_model_parallel_world_size")
                 if callable(getattr(mpu, n, None))), None)  # fmt: skip
    pp = _call(mpu, name) if name is not None else 1
    if dp * mp != world_size:
        problems.append(f"data-parallel size {dp} x model-parallel size {mp} = {dp * mp}, but the job has "
                        f"{world_size} ranks: give an mpu whose sizes multiply to the world size")  # fmt: skip
    if isinstance(pp, int) and pp > 1:
        problems.append(f"pipeline-parallel size {pp}: pipelines run as a deepspeed.pipe.PipelineModule (its "
                        "topology is the mpu); pass the mpu of a model without pipeline stages")  # fmt: skip
    return problems


def _group_problems(axis: str, group: Any, size: int, rank: int) -> list[str]:
    try:
        actual_size, actual_rank = dist.get_world_size(group), dist.get_rank(group)
    except Exception as err:  # noqa: BLE001 (not a process group of this job)
        return [f"get_{axis}_parallel_group() returned {group!r}, not a process group of this job ({err})"]
    if actual_rank < 0:
        return [f"get_{axis}_parallel_group() is a group this rank is not in"]
    if (actual_size, actual_rank) != (size, rank):
        return [f"get_{axis}_parallel_group() has {actual_size} ranks with this rank at {actual_rank}, but "
                f"get_{axis}_parallel_world_size() is {size} and get_{axis}_parallel_rank() {rank}"]
    return []


def refuse_with(mpu_groups: MpuGroups, *, stage: int = 0, model_degrees: int = 1, experts: bool = False) -> None:
    """What the engine does not run beside an mpu, refused by name before the model is touched: the config's own
    model degrees (``model_degrees``: tp x pp x cp x sp), ZeRO ``stage`` 3 with a model axis, MoE layers
    (``experts``: the model has some)."""
    problems = []
    kind = type(mpu_groups.mpu).__name__
    if stage == 3 and mpu_groups.tp > 1:
        problems.append(Problem("mpu", kind, f"ZeRO stage 3 with a model-parallel size of {mpu_groups.tp}: torsh's "
                                "stage 3 (FSDP2) does not shard an mpu's model-parallel slices; use ZeRO stage 0-2 "
                                "with this mpu"))  # fmt: skip
    if model_degrees > 1:
        problems.append(Problem("mpu", kind, "an mpu beside the config's own tensor / pipeline / context / "
                                "sequence parallel degrees: the mpu defines the groups; set those degrees to 1 (or "
                                "drop the mpu)"))  # fmt: skip
    if experts:
        problems.append(Problem("mpu", kind, "an mpu with DeepSpeed MoE layers: torsh builds expert groups over the "
                                "whole world, not within an mpu's data-parallel group; pass mpu=None"))  # fmt: skip
    if problems:
        raise ConfigError(problems)


def reduction_group(engine: Any) -> tuple[int, Any]:
    """``(divisor, group)`` of the engine's gradient mean outside DDP (a backward DDP did not reduce, a
    ``coalesce_grad_reduction`` block): an mpu's data-parallel group and size, else every rank (None) and the world
    size, under Ulysses the world size / sp (DeepSpeed sums over the sequence-parallel peers)."""
    groups = engine.__dict__.get("_mpu")
    if groups is not None:
        return groups.dp, groups.dp_group
    return engine.world_size // engine.sequence_parallel_size, None


def engine_members(groups: MpuGroups | None) -> dict[str, Any]:
    """What the engine holds of an mpu: DeepSpeed's ``engine.mpu``, the checked groups, and the data-parallel
    group its ``data_parallel_group`` returns (none without an mpu)."""
    if groups is None:
        return {}
    return {"mpu": groups.mpu, "_mpu": groups, "_dp_group": groups.dp_group}
