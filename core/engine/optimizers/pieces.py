"""Where a parameter's elements are, for the optimizers whose update of an element reads its whole parameter
(Lamb's per-tensor trust ratio, Muon's per-matrix orthogonalisation).

The engine steps three kinds of tensors. Stage 0 (and fp32 masters): whole parameters. Stage 3 / HSDP: FSDP2's
DTensor shards, each rank a slice of every parameter. ZeRO-1/2: one flat fp32 master per optimizer group holding
this rank's chunks of the group's parameters (:class:`torsh.engine.zero.partition.ZeroPartition`). A whole-tensor
rule must see whole tensors, so this module gives, for whichever kind:

- :func:`pieces_of`: each parameter's local elements (a view into the stepped tensor), with the process groups
  that hold the rest, so that a norm is the square root of the all-reduced sum of the local squares
  (:func:`whole_sums`: one collective per group, never a gather of the values);
- :func:`wholes_of`: each parameter's whole value (all-gathered), and :func:`write_local` to keep this rank's
  elements of a whole result.

On a flat partition the layout is read from the ZeRO members the engine attaches to the optimizer after it is
built (``bit16_groups``, ``single_partition_of_fp32_groups``); :func:`expect_flat` marks an optimizer that the
engine is about to build over flat masters, so that a flat master whose layout cannot be found is an error
instead of a silently different update (the norm of a partition is not the norm of a parameter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

#: Set on an optimizer that the engine builds over ZeRO-1/2 flat masters (the stage), see :func:`expect_flat`.
FLAT_STAGE = "_torsh_flat_stage"


@dataclass
class Piece:
    """One parameter's elements on this rank: ``local`` views the stepped tensor; ``groups`` are the process
    groups whose ranks together hold the whole parameter (empty: ``local`` is whole)."""

    local: torch.Tensor
    groups: tuple[Any, ...]
    shape: torch.Size
    """The parameter's whole shape."""


@dataclass
class FlatLayout:
    """The parameters inside one ZeRO-1/2 flat master (optimizer group ``index``) and the partition that cut it."""

    partition: Any
    index: int
    params: list[nn.Parameter]

    def pieces(self, flat: torch.Tensor) -> list[Piece]:
        part = self.partition
        groups = (part.group,) if part.world > 1 else ()
        return [Piece(part.local_view(p, flat), groups, p.shape) for p in self.params]

    def wholes(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's whole value of ``flat`` (a tensor laid out like the master; collective)."""
        part = self.partition
        rows = torch.empty(part.world * flat.numel(), dtype=flat.dtype, device=flat.device)
        if part.world > 1:
            dist.all_gather_into_tensor(rows, flat.detach().contiguous(), group=part.group)
        else:
            rows.copy_(flat.detach())
        rows = rows.view(part.world, -1)
        out = {}
        for b in part.buckets:
            if b.group == self.index:
                whole = rows[:, b.master_offset:b.master_offset + b.chunk].reshape(-1)
                for p, off in zip(b.params, b.offsets):
                    out[id(p)] = whole[off:off + p.numel()].view(p.shape)
        return [out[id(p)] for p in self.params]

    def holds(self, p: nn.Parameter) -> bool:
        start, end = self.partition.local_range(p)
        return end > start

    def write_local(self, p: nn.Parameter, flat: torch.Tensor, whole: torch.Tensor) -> None:
        """Copy this rank's elements of ``whole`` (``p``'s whole value) into ``p``'s place in ``flat``."""
        start, end = self.partition.local_range(p)
        if end > start:
            self.partition.local_view(p, flat).copy_(whole.reshape(-1)[start:end])


def expect_flat(optimizer: torch.optim.Optimizer, stage: int) -> None:
    """Mark ``optimizer`` as stepping ZeRO-``stage`` flat masters (its whole-tensor rule then needs their layout)."""
    setattr(optimizer, FLAT_STAGE, stage)


def flat_layout(optimizer: torch.optim.Optimizer, tensor: torch.Tensor) -> FlatLayout | None:
    """The layout of ``tensor`` when it is one of the ZeRO-1/2 flat masters ``optimizer`` steps, else None.

    A RuntimeError when the optimizer was built over flat masters (:func:`expect_flat`) but the engine gave it
    no layout (the expert-parallel ZeRO path keeps several masters per group)."""
    from ..zero.slots import ZERO_SLOT

    members = optimizer.__dict__
    masters = members.get("single_partition_of_fp32_groups")
    groups = members.get("bit16_groups")
    if masters is not None and groups is not None:
        for index, master in enumerate(masters):
            if master is tensor and groups[index]:
                partition = getattr(groups[index][0], ZERO_SLOT)[0]
                return FlatLayout(partition, index, list(groups[index]))
    stage = members.get(FLAT_STAGE)
    if stage is not None and tensor.dim() == 1:
        raise RuntimeError(f"{type(optimizer).__name__} updates whole parameters (a norm or a matrix per "
                           f"parameter), and at ZeRO-{stage} it steps flat partitions whose layout this engine path "
                           "does not give it (expert parallelism): use ZeRO stage 0 or 3, or an elementwise "
                           "optimizer (Adam, AdamW, Lion)")  # fmt: skip
    return None


def _dtensor_groups(t: torch.Tensor) -> tuple[Any, ...]:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Shard

    if not isinstance(t, DTensor):
        return ()
    mesh = t.device_mesh
    return tuple(mesh.get_group(i) for i, pl in enumerate(t.placements) if isinstance(pl, Shard) and mesh.size(i) > 1)


def local(t: torch.Tensor) -> torch.Tensor:
    """The elements of ``t`` on this rank (a DTensor's local shard, else ``t``)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def pieces_of(optimizer: torch.optim.Optimizer, param: torch.Tensor, value: torch.Tensor) -> list[Piece]:
    """The parameters inside ``param`` (a stepped tensor) as pieces of ``value`` (a tensor laid out like it: the
    parameter itself, an update, a state): one piece per parameter of a flat master, else one."""
    layout = flat_layout(optimizer, param)
    if layout is not None:
        return layout.pieces(local(value))
    return [Piece(local(value), _dtensor_groups(param), param.shape)]


def whole_sums(parts: list[torch.Tensor], groups: list[tuple[Any, ...]]) -> torch.Tensor:
    """``parts`` (0-d local partial sums, fp32) summed over the ranks in each one's ``groups``: one all-reduce per
    distinct group tuple, in first-seen order (the same order on every rank)."""
    if not parts:
        return torch.zeros(0)
    sums = torch.stack([p.float() for p in parts])
    by_groups: dict[tuple[int, ...], tuple[tuple[Any, ...], list[int]]] = {}
    for i, gs in enumerate(groups):
        if gs:
            by_groups.setdefault(tuple(id(g) for g in gs), (gs, []))[1].append(i)
    for gs, index in by_groups.values():
        picked = sums[index]
        for g in gs:
            dist.all_reduce(picked, group=g)
        sums[index] = picked
    return sums
