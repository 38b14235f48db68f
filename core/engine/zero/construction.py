"""ZeRO-3 parameters partitioned while the model is built (``deepspeed.zero.Init``), as DeepSpeed partitions them.

When a module's constructor returns inside ``zero.Init``, each of its parameters is broadcast from the partition
group's first rank and this rank keeps only its partition, in DeepSpeed's layout: the flattened parameter cut into
``ceil(numel / W)`` elements per rank, the last partition padded with zeros, held as ``param.ds_tensor``;
``param.data`` becomes an empty tensor, as DeepSpeed leaves it. No rank ever holds the whole model: at most its
partitions plus the module being built.

``GatheredParameters`` shows such a parameter whole and partitions it again (:func:`show_whole`,
:func:`repartition`). ``initialize`` turns the partitions into FSDP2's shards one parameter at a time
(:func:`defer_to_shards` before ``fully_shard``, :func:`fill_shards` after it), or, where the engine keeps whole
parameters (stages 0-2, tensor or pipeline parallelism), gathers each whole (:func:`materialize`): the peak is this
rank's shards plus the largest parameter.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .whole_params import ZeroParamStatus

PARTITIONED = "_torsh_partitioned"
"""Set on a parameter partitioned at construction (a :class:`Partitioned`), until ``initialize`` takes it."""

_ids = itertools.count()  # DeepSpeed numbers the parameters it partitions in construction order (``ds_id``)
#: torch 2.13 renames all_gather_into_tensor (the older name is deprecated there); earlier releases have only it.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Partitioned:
    """Where a parameter's partitions are: the process group over which it is cut, its size and this rank's place."""

    group: Any
    world: int
    rank: int
    source: int
    """The global rank whose value every rank starts from (the group's first)."""


def is_partitioned(param: Any) -> bool:
    """Whether ``param`` is partitioned at construction and not yet taken by ``initialize``."""
    return isinstance(param, torch.Tensor) and PARTITIONED in param.__dict__


def partition_numel(numel: int, world: int) -> int:
    """Elements of one rank's partition: DeepSpeed's ``ceil(numel / W)``."""
    return -(-numel // world)


def comm_device(group: Any) -> torch.device:
    """The device a collective of ``group`` runs on: the current accelerator under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _place(group: Any) -> Partitioned:
    if not (dist.is_available() and dist.is_initialized()):
        return Partitioned(group, 1, 0, 0)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    source = dist.get_global_rank(group, 0) if group is not None else 0
    return Partitioned(group, world, rank, source)


@torch.no_grad()
def partition(param: nn.Parameter, *, group: Any = None, remote_device: torch.device | None = None,
              pin_memory: bool = False) -> None:  # fmt: skip
    """Partition the whole ``param`` now: every rank takes the group's first rank's value (DeepSpeed broadcasts
    it), keeps its own partition as ``param.ds_tensor`` (on ``remote_device`` when given, pinned with
    ``pin_memory`` on a CUDA machine) and frees the rest; DeepSpeed's attributes describe the whole parameter."""
    if is_partitioned(param):
        return
    where = _place(group)
    data = param.data
    if where.world > 1:
        on_device = data.detach().to(comm_device(group)).contiguous()
        dist.broadcast(on_device, src=where.source, group=group)
        data = on_device
    size = partition_numel(data.numel(), where.world)
    local = torch.zeros(size, dtype=data.dtype, device=remote_device if remote_device is not None else param.device)
    keep_own(local, data, where)
    if pin_memory and local.device.type == "cpu" and torch.cuda.is_available():
        local = local.pin_memory()
    param.ds_tensor = local
    param.ds_shape, param.ds_numel = data.shape, data.numel()
    param.ds_id = next(_ids)
    param.ds_persist = False
    param.ds_process_group = group
    param.__dict__[PARTITIONED] = where
    param.data = torch.empty(0, dtype=data.dtype, device=param.device)
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE
    _attach_methods(param)


def _attach_methods(param: nn.Parameter) -> None:
    """DeepSpeed's methods of a partitioned parameter (``param.all_gather()``, ``param.partition()``, ...)."""

    def all_gather(param_list=None, async_op=False, hierarchy=0):
        for p in param_list or [param]:
            if is_partitioned(p) and p.ds_status is ZeroParamStatus.NOT_AVAILABLE:
                show_whole(p)

    def partition(param_list=None, hierarchy=0, has_been_updated=False, free_data=True):
        for p in param_list or [param]:
            if is_partitioned(p):
                repartition(p, keep_written=has_been_updated)

    def all_gather_coalesced(params, safe_mode=False, quantize=False):
        all_gather(list(params))
        return GatherDone()

    param.all_gather = all_gather
    param.all_gather_coalesced = all_gather_coalesced
    param.partition = partition
    param.partition_numel = lambda: param.ds_tensor.numel()
    param.padding_size = lambda: param.ds_tensor.numel() * param.__dict__[PARTITIONED].world - param.ds_numel
    param.ds_summary = lambda: {"id": param.ds_id, "status": param.ds_status.name, "numel": param.ds_numel,
                                "ds_numel": param.ds_numel, "shape": tuple(param.ds_shape),
                                "ds_shape": tuple(param.ds_shape), "requires_grad": param.requires_grad,
                                "persist": param.ds_persist}  # fmt: skip


class GatherDone:
    """The handle of a gather that completed before it was returned (DeepSpeed's ``param.all_gather_coalesced``
    hands out one to wait on; torsh gathers synchronously, so ``wait`` has nothing left to do)."""

    def wait(self, handle_dependency: bool = True) -> None:  # noqa: ARG002  (DeepSpeed's signature)
        return None


def keep_own(local: torch.Tensor, whole: torch.Tensor, where: Any) -> None:
    """Write this rank's partition of ``whole`` into ``local`` (its elements, zeros past the end); ``where`` has
    this rank's place in the group (``rank``)."""
    size = local.numel()
    start = where.rank * size
    take = max(0, min(size, whole.numel() - start))
    local.zero_()
    if take:
        local[:take].copy_(whole.reshape(-1)[start:start + take])


@torch.no_grad()
def gather(param: nn.Parameter) -> torch.Tensor:
    """The whole value of a parameter partitioned at construction (a new tensor of ``ds_shape``, on the device of
    the partition group's collectives)."""
    where: Partitioned = param.__dict__[PARTITIONED]
    local = param.ds_tensor.detach().to(comm_device(where.group)).contiguous()
    if where.world == 1:
        whole = local.clone()
    else:
        whole = torch.empty(local.numel() * where.world, dtype=local.dtype, device=local.device)
        all_gather_into(whole, local, group=where.group)
    return whole[:param.ds_numel].view(param.ds_shape)


@torch.no_grad()
def show_whole(param: nn.Parameter) -> None:
    """``param.data`` becomes its whole value (DeepSpeed's ``all_gather``); ``ds_status`` AVAILABLE."""
    param.data = gather(param).to(param.device)
    param.ds_status = ZeroParamStatus.AVAILABLE


@torch.no_grad()
def repartition(param: nn.Parameter, *, written_by: int | None = None, keep_written: bool = False) -> None:
    """Free ``param``'s whole value again. ``written_by`` (a global rank): that rank's whole value is broadcast and
    becomes every rank's partition (``GatheredParameters(..., modifier_rank=r)``); ``keep_written``: this rank's
    own whole value becomes its partition (DeepSpeed's ``partition(has_been_updated=True)``); otherwise what was
    written to the whole value is dropped, as DeepSpeed drops it."""
    where: Partitioned = param.__dict__[PARTITIONED]
    whole = param.numel() == param.ds_numel and param.ds_numel > 0
    if whole and (written_by is not None or keep_written):
        data = param.data.detach().to(comm_device(where.group)).contiguous()
        if written_by is not None and where.world > 1:
            dist.broadcast(data, src=written_by, group=where.group)
        keep_own(param.ds_tensor, data, where)
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE


def _forget(param: nn.Parameter) -> None:
    """``param`` is no longer partitioned at construction (``initialize`` took it): its partition, DeepSpeed's
    attributes and methods go (a parameter the engine shards gets the attributes of its layout)."""
    for key in [k for k in param.__dict__ if k.startswith("ds_")] + [
            PARTITIONED, "all_gather", "all_gather_coalesced", "partition", "partition_numel", "padding_size"]:  # fmt: skip
        param.__dict__.pop(key, None)


def partitioned_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``model`` partitioned at construction, each once."""
    return [p for p in model.parameters() if is_partitioned(p)]


@torch.no_grad()
def materialize(model: nn.Module) -> int:
    """Every parameter of ``model`` partitioned at construction made whole again, one at a time (for an engine
    that keeps whole parameters); returns how many."""
    params = partitioned_parameters(model)
    for p in params:
        p.data = gather(p).to(p.device)
        _forget(p)
    return len(params)


def defer_to_shards(model: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Before ``fully_shard``: each parameter partitioned at construction is replaced on its modules by a meta
    parameter of its whole shape (FSDP2 shards it without data); returns where each was, with the partitioned one,
    for :func:`fill_shards`."""
    deferred, meta = [], {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and is_partitioned(p):
                if id(p) not in meta:  # a tied parameter: one stand-in for every module holding it
                    meta[id(p)] = nn.Parameter(torch.empty(p.ds_shape, dtype=p.dtype, device="meta"),
                                               requires_grad=p.requires_grad)  # fmt: skip
                module._parameters[name] = meta[id(p)]
                deferred.append((module, name, p))
    return deferred


@torch.no_grad()
def fill_shards(model: nn.Module, deferred: list[tuple[nn.Module, str, nn.Parameter]], device: torch.device) -> None:
    """After ``fully_shard``: this rank's FSDP2 shard of each deferred parameter, allocated on ``device`` and
    written from the whole value gathered from the construction partitions (one parameter at a time)."""
    if not deferred:
        return
    from torch.distributed.tensor import DTensor, distribute_tensor

    # FSDP2's own deferred initialisation: the meta shards get storage (its _apply re-registers them); every other
    # tensor is handed back unchanged
    model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    done: set[int] = set()
    for module, name, old in deferred:
        new = module._parameters[name]
        if id(new) in done:  # a tied parameter: one shard
            continue
        done.add(id(new))
        whole = gather(old)
        if isinstance(new, DTensor):
            local = new.to_local()
            piece = distribute_tensor(whole.to(dtype=local.dtype), new.device_mesh, new.placements,
                                      src_data_rank=None).to_local()  # fmt: skip
            local.copy_(piece.to(local.device))
        else:  # not sharded by FSDP2 (ignored by it): whole again
            new.data = whole.to(device=device, dtype=new.dtype)
        _forget(old)
