"""Where one parameter's fp32 weights, gradient and optimizer state live in a torsh engine, read and written per
parameter: the layouts behind DeepSpeed's tensor-fragment API (``deepspeed.utils.safe_get_full_fp32_param``,
``safe_set_local_optimizer_state`` ...).

A parameter's values are kept in one of three layouts, each with the same four operations (the whole value on
every rank, this rank's part, and writing either):

- :class:`FlatPart` (ZeRO-1/2, :mod:`.partition`): the fp32 master, the reduced gradient and every elementwise
  optimizer state of a parameter group are one flat tensor per rank, this rank's chunk of each bucket; a parameter
  is a range of its bucket. Its whole value is one all-gather of that bucket's chunks.
- :class:`Shard` (ZeRO-3, FSDP2): the parameter, its gradient and its optimizer state are DTensors cut along the
  first dimension. This rank's part is shown in DeepSpeed's layout: the flattened value cut into
  ``ceil(numel / W)`` elements per rank, the last one padded with zeros (what ``param.ds_tensor`` holds). When the
  first dimension splits evenly the two layouts are the same elements, so the part is the local shard itself and
  nothing is communicated; otherwise reading or writing the part is a collective over the shard group.
- :class:`Whole` (stage 0): every rank holds the whole tensor (the fp32 master under fp16/bf16, else the
  parameter).

:func:`locate` tells which layout holds a parameter and which tensor the optimizer steps for it (the key of its
optimizer state); :func:`optimizer_state` finds that state among the live engines' optimizers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..precision import MASTER
from . import whole_params
from .construction import all_gather_into, comm_device, is_partitioned, keep_own, partition_numel
from .ds_layout import LINK, shard_cut
from .params import write_whole
from .partition import ZERO_SLOT


def check_numel(what: str, value: torch.Tensor, numel: int, hint: str) -> None:
    if value.numel() != numel:
        raise ValueError(f"{what}: the value has {value.numel()} elements, {numel} expected ({hint})")


@dataclass
class FlatPart:
    """A parameter of a ZeRO-1/2 partition: its elements in flat per-rank tensors of its parameter group."""

    param: nn.Parameter

    @property
    def slot(self) -> tuple[Any, Any, int]:
        return getattr(self.param, ZERO_SLOT)

    @torch.no_grad()
    def full(self, flat: torch.Tensor) -> torch.Tensor:
        """The whole value of the parameter in ``flat`` (one rank's group partition: its masters, gradients or an
        optimizer state), shaped like the parameter; collective over the partition's group."""
        part, b, off = self.slot
        own = flat[b.master_offset:b.master_offset + b.chunk].to(part.device).contiguous()
        rows = torch.empty(b.chunk * part.world, dtype=flat.dtype, device=part.device)
        all_gather_into(rows, own, group=part.group)
        return rows[off:off + self.param.numel()].view(self.param.shape).clone()

    def local(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's elements of the parameter in ``flat`` (1-D, possibly empty; a copy)."""
        part = self.slot[0]
        return part.local_view(self.param, flat).clone()

    def part_of(self, value: torch.Tensor) -> torch.Tensor:
        """This rank's elements of a whole value of the parameter (no communication)."""
        start, end = self.slot[0].local_range(self.param)
        return value.detach().reshape(-1)[start:end].clone()

    @torch.no_grad()
    def write_full(self, flat: torch.Tensor, value: torch.Tensor, what: str) -> None:
        """The elements this rank owns of ``value`` (the whole parameter, the same on every rank) into ``flat``."""
        part = self.slot[0]
        check_numel(what, value, self.param.numel(), f"the whole parameter, shape {tuple(self.param.shape)}")
        start, end = part.local_range(self.param)
        part.local_view(self.param, flat).copy_(value.detach().reshape(-1)[start:end])

    @torch.no_grad()
    def write_local(self, flat: torch.Tensor, value: torch.Tensor, what: str) -> None:
        view = self.slot[0].local_view(self.param, flat)
        check_numel(what, value, view.numel(), "this rank's part, as the matching safe_get_local_* gives it")
        view.copy_(value.detach().reshape(-1))


@dataclass
class Shard:
    """A parameter sharded by FSDP2: DTensors shaped like it, this rank's part shown in DeepSpeed's layout."""

    param: torch.Tensor

    def _even(self, t: torch.Tensor) -> bool:
        """Whether this rank's shard of ``t`` is exactly its partition in DeepSpeed's layout: cut along the first
        dimension, which splits evenly over the shard group."""
        from torch.distributed.tensor import Replicate, Shard as ShardAlong

        *outer, last = t.placements
        return (last == ShardAlong(0) and all(p == Replicate() for p in outer) and t.dim() > 0
                and t.shape[0] % t.device_mesh.size(t.device_mesh.ndim - 1) == 0)  # fmt: skip

    @torch.no_grad()
    def full(self, t: torch.Tensor) -> torch.Tensor:
        """The whole value (collective)."""
        return t.full_tensor().detach().clone()

    @torch.no_grad()
    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's partition in DeepSpeed's layout (1-D, ``ceil(numel / W)`` elements; a copy). Collective
        unless the first dimension splits evenly."""
        if self._even(t):
            return t.to_local().detach().reshape(-1).clone()
        return self.part_of(t.full_tensor())

    def part_of(self, value: torch.Tensor) -> torch.Tensor:
        """This rank's partition in DeepSpeed's layout of a whole value of the parameter (no communication)."""
        cut = shard_cut(self.param)
        out = torch.zeros(partition_numel(value.numel(), cut.world), dtype=value.dtype, device=value.device)
        keep_own(out, value.detach(), cut)
        return out

    @torch.no_grad()
    def write_full(self, t: torch.Tensor, value: torch.Tensor, what: str) -> None:
        """This rank's shard of ``value`` (the whole tensor, the same on every rank) into ``t``; not collective."""
        check_numel(what, value, t.numel(), f"the whole parameter, shape {tuple(t.shape)}")
        write_whole(t, value)

    @torch.no_grad()
    def write_local(self, t: torch.Tensor, value: torch.Tensor, what: str) -> None:
        """``value`` (this rank's partition in DeepSpeed's layout) into ``t``. Collective unless the first dimension
        splits evenly: the ranks' partitions are gathered and each keeps its shard."""
        cut = shard_cut(t)
        check_numel(what, value, partition_numel(t.numel(), cut.world),
                     "this rank's part, as the matching safe_get_local_* gives it")  # fmt: skip
        if self._even(t):
            local = t.to_local()
            local.copy_(value.detach().reshape(local.shape).to(local.dtype))
            whole_params.stale(t)
            return
        device = comm_device(cut.group)
        own = value.detach().reshape(-1).to(device=device, dtype=t.dtype).contiguous()
        everyone = torch.empty(own.numel() * cut.world, dtype=own.dtype, device=device)
        all_gather_into(everyone, own, group=cut.group)
        write_whole(t, everyone[:t.numel()])


@dataclass
class Whole:
    """A parameter every rank holds whole (stage 0): its part is the whole tensor."""

    param: torch.Tensor

    def full(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone()

    local = part_of = full

    @torch.no_grad()
    def write_full(self, t: torch.Tensor, value: torch.Tensor, what: str) -> None:
        check_numel(what, value, t.numel(), f"the whole parameter, shape {tuple(t.shape)}")
        t.copy_(value.detach().reshape(t.shape))

    write_local = write_full


Layout = FlatPart | Shard | Whole


def original(param: torch.Tensor) -> torch.Tensor:
    """The parameter the engine holds for ``param``: the FSDP2 shard that replaced a parameter object the script
    kept from before ``initialize``, else ``param`` itself."""
    link = param.__dict__.get(LINK)
    return link.shard if link is not None else param


def locate(param: torch.Tensor) -> tuple[Layout, torch.Tensor]:
    """The layout holding ``param``'s training values, and the tensor the optimizer steps for it (the key of its
    optimizer state): a ZeRO-1/2 group's flat fp32 master, the FSDP2 shard, the fp32 master of stage 0 under
    fp16/bf16, or the parameter."""
    if is_partitioned(param):
        raise ValueError("the parameter is partitioned by deepspeed.zero.Init and no engine holds it yet: its fp32 "
                         "weights, gradient and optimizer state exist from deepspeed.initialize() on; call the "
                         "safe_get/set_* functions afterwards, on the engine's parameters")  # fmt: skip
    if hasattr(param, ZERO_SLOT):
        part, b, _ = getattr(param, ZERO_SLOT)
        return FlatPart(param), part.masters[b.group]
    if hasattr(param, "device_mesh"):
        return Shard(param), param
    return Whole(param), getattr(param, MASTER, param)


def ds_tensor(param: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's ``param.ds_tensor`` for an FSDP2 parameter: this rank's partition in DeepSpeed's layout (what
    ``safe_get_local_fp32_param`` reads). Where the first dimension splits evenly it is a view of the local shard
    (writes reach the shard, steps show in it); otherwise a copy, read collectively."""
    layout, local = Shard(param), param.to_local().detach()
    return local.view(-1) if layout._even(param) and local.is_contiguous() else layout.local(param)


def _live_optimizers() -> list[torch.optim.Optimizer]:
    """The torch optimizers of the engines alive in this process (each engine registers its ``destroy`` for the
    shutdown at exit, weakly: that registry is the list of live engines)."""
    from ..distributed import _teardowns

    found = []
    for ref in list(_teardowns):
        owner = getattr(ref(), "__self__", None)
        optimizer = owner.__dict__.get("optimizer") if owner is not None else None
        for candidate in (optimizer, getattr(optimizer, "optim", None), getattr(optimizer, "optimizer", None)):
            if isinstance(candidate, torch.optim.Optimizer) and candidate not in found:
                found.append(candidate)
    return found


def optimizer_state(stepped: torch.Tensor) -> dict | None:
    """The optimizer state of ``stepped`` (the tensor an engine's optimizer steps); None when no live engine's
    optimizer has state for it (torch optimizers create it at their first step). Under NVMe offload the per-element
    entries are in files between steps: read them inside :func:`state_resident`."""
    for optimizer in _live_optimizers():
        state = optimizer.state.get(stepped) if stepped in optimizer.state else None
        if state:
            return state
    return None


@contextlib.contextmanager
def state_resident(stepped: torch.Tensor) -> Iterator[None]:
    """The optimizer state of ``stepped`` in host memory for the block (NVMe offload keeps the per-element
    entries in files between steps; what the block writes into them is written back out after)."""
    from .nvme import resident

    owner = next((o for o in _live_optimizers() if stepped in o.state), None)
    if owner is None:
        yield
        return
    with resident(owner, [stepped]):  # this parameter's files only
        yield


def is_elementwise(value: Any, stepped: torch.Tensor) -> bool:
    """An optimizer state entry with one element per element of ``stepped`` (Adam's moments; not ``step``)."""
    return torch.is_tensor(value) and value.shape == stepped.shape and value.numel() > 0
