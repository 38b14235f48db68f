"""Data parallelism and sharding: stage 0 DDP, stage 1 DDP (the optimizer steps a partition:
:mod:`.partition`), stage 3 FSDP2, HSDP; stage 2 is :mod:`.partition`.

Also the two things that must happen around it: every rank starts from rank 0's weights, and DDP reduces
gradients with DeepSpeed's operation (post-scale by default, ``gradient_predivide_factor``, sum or mean, the
communication dtype).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torsh.config import DdpConfig, GradientsConfig, OffloadConfig, ShardingConfig
from torsh.plan import EnginePlan
from torsh.sharding_plan import ShardingPlan

from . import construction, ds_layout, external_params, leaves, whole_params
from . import params as zero_params
from ..distributed import DistInfo
from ..precision import PrecisionPlan
from .units import plan_units

log = logging.getLogger("torsh.engine")


@dataclass
class ShardPlan:
    """The wrapped model and how to control its gradient synchronisation."""

    model: nn.Module
    """What forward is called on (DDP wrapper, or the FSDP2 root module)."""
    module: nn.Module
    """The user's module (``engine.module``), whose parameter names are the checkpoint keys."""
    kind: str
    """``"ddp"`` (stages 0 and 1), ``"zero"`` (ZeRO-2: whole parameters, partitioned gradients and optimizer) or
    ``"fsdp"``."""
    mesh: object | None = None
    """The FSDP2 device mesh."""
    partition: object | None = None
    """ZeRO-1/2: the :class:`.partition.ZeroPartition` holding this rank's partition of the fp32 masters and
    gradients (at stage 2 (kind ``"zero"``) reducing the gradients into it; at stage 1 (kind ``"ddp"``) taking its
    elements of DDP's all-reduced gradients) and gathering the parameters after the step."""
    keep_whole: bool = False
    """HSDP at stage 2: the units are gathered again after each optimizer step, so that between steps the parameters are
    whole on every rank, as DeepSpeed's stage 2 keeps them (:func:`.whole_params.make_whole`)."""
    sp: int = 1
    """Ulysses' sequence-parallel degree: a mean reduction divides the sum over its ranks by their number / ``sp``
    (the data-parallel replicas), as DeepSpeed does, instead of by their number."""


def sequence_degree(decided: EnginePlan) -> int:
    """The plan's Ulysses degree (1 without sequence parallelism)."""
    return decided.degrees.sp if decided.degrees is not None else 1


#: The most bytes one start-up broadcast carries (DDP's own parameter sync uses 250 MiB buckets).
SYNC_BUCKET_BYTES = 250 * 2**20


@torch.no_grad()
def sync_module_states(model: nn.Module, device: torch.device, sharding: ShardingConfig, skip: Any = None) -> None:
    """Move the model to ``device`` and, unless disabled, give every rank rank 0's parameters and buffers.

    The tensors travel flattened, one broadcast per bucket of one dtype, not one per tensor: a collective's
    latency, not its bytes, dominates for the many small tensors of a model.
    """
    model.to(device)
    if not sharding.sync_module_states or dist.get_world_size() == 1:
        return
    buckets: list[list[torch.Tensor]] = []
    filling: dict[torch.dtype, tuple[list[torch.Tensor], int]] = {}  # the open bucket of each dtype, its bytes
    for t in [*model.parameters(), *model.buffers()]:
        if skip is not None and skip.is_local(t):  # a rank's own experts: broadcast in their group below
            continue
        bucket, size = filling.get(t.dtype, ([], 0))
        if not bucket or size + t.nbytes > SYNC_BUCKET_BYTES:
            bucket, size = [], 0
            buckets.append(bucket)
        bucket.append(t.data)
        filling[t.dtype] = (bucket, size + t.nbytes)
    for bucket in buckets:
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.broadcast(flat, src=0)
        for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
            t.copy_(part.view_as(t))
    if skip is not None:
        skip.broadcast()


def apply_sharding(model: nn.Module, decided: EnginePlan, precision: PrecisionPlan, info: DistInfo, *,
                   gradients: GradientsConfig, offload: OffloadConfig, mesh: object | None = None,
                   process_group: Any = None) -> ShardPlan:  # fmt: skip
    """Wrap ``model`` as the plan says: DDP (stages 0/1; its own reduction unless a compression hook replaces it)
    or FSDP2 on the plan's mesh (or ``mesh``: the data-parallel sub-mesh tensor parallelism left), in the units
    the plan's sharding section gives (:func:`.units.plan_units`). ``process_group``: DDP's data-parallel group (an
    mpu's; None: every rank)."""
    if not decided.fsdp:
        return apply_ddp(model, decided, gradients, precision, info, process_group=process_group)
    return _apply_fsdp(model, decided, gradients, offload, precision, info, mesh)


def apply_ddp(model: nn.Module, decided: EnginePlan, gradients: GradientsConfig, precision: PrecisionPlan,
              info: DistInfo, process_group: Any = None) -> ShardPlan:  # fmt: skip
    """DDP with the plan's bucket over ``process_group`` (None: every rank); DeepSpeed's reduction as a comm hook
    unless a compression hook replaces it."""
    return _apply_ddp(model, decided.sharding.ddp, gradients, precision, info, decided.compression != "comm_hook",
                      process_group, sp=sequence_degree(decided))  # fmt: skip


def _apply_ddp(model, ddp: DdpConfig, gradients: GradientsConfig, precision: PrecisionPlan, info: DistInfo,
               reduce_hook: bool, process_group: Any = None, sp: int = 1) -> ShardPlan:  # fmt: skip
    from torch.nn.parallel import DistributedDataParallel

    wrapped = DistributedDataParallel(
        model,
        process_group=process_group,
        device_ids=[info.device.index] if info.device.type == "cuda" else None,
        init_sync=False,  # sync_module_states did it before the master weights were copied
        bucket_cap_mb=float(ddp.bucket_cap_mb),
        find_unused_parameters=ddp.find_unused_parameters,
        static_graph=ddp.static_graph,
        gradient_as_bucket_view=ddp.gradient_as_bucket_view,
        forward_sync_buffers=ddp.broadcast_buffers,
    )
    world = dist.get_world_size(process_group) if process_group is not None else info.world_size
    if reduce_hook and _needs_reduce_hook(gradients, precision, world, sp):
        state = _ReduceState(gradients.reduce_op, gradients.prescale, gradients.predivide_factor,
                             precision.reduce_dtype, world // sp, process_group)  # fmt: skip
        wrapped.register_comm_hook(state, _deepspeed_reduce)
    return ShardPlan(wrapped, model, "ddp", sp=sp)


def _needs_reduce_hook(gradients: GradientsConfig, precision: PrecisionPlan, world_size: int, sp: int = 1) -> bool:
    # DDP's built-in reduction divides by W before a sum; that equals DeepSpeed's post-scale bit for bit when
    # W is a power of two, so the (slower) Python hook is registered only when the math would differ. Under
    # Ulysses DeepSpeed divides by W / sp, which DDP's built-in mean never does.
    power_of_two = world_size & (world_size - 1) == 0
    return (gradients.reduce_op != "mean" or gradients.predivide_factor != 1.0
            or precision.reduce_dtype != precision.param_dtype
            or (not gradients.prescale and not power_of_two) or sp > 1)


@dataclass
class _ReduceState:
    op: str
    prescale: bool
    factor: float
    dtype: torch.dtype
    world_size: int
    """What a mean divides by: the reduction's ranks (Ulysses: their number / sp, the data-parallel replicas)."""
    group: Any = None


def _deepspeed_reduce(state: _ReduceState, bucket):
    """DDP comm hook reducing like DeepSpeed stage 0: in the communication dtype, pre-divided by
    ``predivide_factor`` and multiplied by ``factor / W`` afterwards (post-scale), or a plain sum."""
    buffer = bucket.buffer()
    work = _before_reduce(state, buffer)
    future = dist.all_reduce(work, group=state.group, async_op=True).get_future()

    def finish(fut):
        return _after_reduce(state, fut.value()[0], buffer)

    return future.then(finish)


def _before_reduce(state: _ReduceState, buffer: torch.Tensor) -> torch.Tensor:
    work = buffer.to(state.dtype) if buffer.dtype != state.dtype else buffer
    mean = state.op == "mean"
    if mean and state.prescale:
        work.div_(state.world_size)
    elif mean and state.factor != 1.0:
        work.div_(state.factor)
    return work


def _after_reduce(state: _ReduceState, reduced: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    if state.op == "mean" and not state.prescale:
        reduced.mul_(state.factor / state.world_size)
    if reduced is not buffer:
        buffer.copy_(reduced)
    return buffer


@torch.no_grad()
def allreduce_gradients(grads: list[torch.Tensor], gradients: GradientsConfig, precision: PrecisionPlan,
                        divisor: int, process_group: Any = None) -> None:  # fmt: skip
    """Reduce ``grads`` in place over every rank (or ``process_group``) outside DDP (the script bypassed its forward,
    or the first step checks for unused parameters), with the math of DDP's reduction above (a mean divides by
    ``divisor``: the ranks, or under Ulysses the data-parallel replicas): one flat collective per dtype."""
    if not grads or dist.get_world_size(process_group) == 1:
        return
    state = _ReduceState(gradients.reduce_op, gradients.prescale, gradients.predivide_factor,
                         precision.reduce_dtype, divisor)  # fmt: skip
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for group in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in group])
        work = _before_reduce(state, flat)
        dist.all_reduce(work, group=process_group)
        _after_reduce(state, work, flat)
        for g, part in zip(group, flat.split([g.numel() for g in group])):
            g.copy_(part.view_as(g))


def rebuild_ddp_for_unused(shard: ShardPlan, ddp: DdpConfig, gradients: GradientsConfig, precision: PrecisionPlan,
                           info: DistInfo, reduce_hook: bool) -> ShardPlan:  # fmt: skip
    """A new DDP wrapper with ``find_unused_parameters`` (the model has parameters its forward does not use);
    the old wrapper's hooks are removed so that each gradient is reduced once; a ZeRO-1 partition stays."""
    remove = getattr(shard.model, "_remove_autograd_hooks", None)
    if remove is not None:
        remove()
    rebuilt = _apply_ddp(shard.module, ddp.model_copy(update={"find_unused_parameters": True}), gradients,
                         precision, info, reduce_hook, process_group=shard.model.process_group,
                         sp=shard.sp)  # fmt: skip
    rebuilt.partition = shard.partition  # ZeRO-1: the same partition steps DDP's reduced gradients
    return rebuilt


def _apply_fsdp(model, decided: EnginePlan, gradients: GradientsConfig, offload: OffloadConfig,
                precision: PrecisionPlan, info: DistInfo, mesh: object | None) -> ShardPlan:  # fmt: skip
    from torch.distributed.fsdp import fully_shard

    layout = decided.sharding
    if offload.optimizer == "cpu" and offload.params == "none":
        log.info("offload.optimizer=cpu under FSDP2: CPUOffloadPolicy offloads parameters and gradients too "
                 "and steps the optimizer on the CPU")  # fmt: skip
    kwargs = _fsdp_kwargs(decided, offload, precision, info, mesh)
    # Units: sharding.wrap as written; with DeepSpeed's bucket sizes, consecutive blocks grouped to them.
    leaves.apply_config(model, layout.leaf_modules)  # before the units: they never split a leaf module
    # parameters zero.Init partitioned while the model was built are sharded without data (whole shapes on the meta
    # device, so the units are sized as the model), then each shard is written from the partitions
    before = ds_layout.before_sharding(model)  # the parameter objects FSDP2 is about to replace
    deferred = construction.defer_to_shards(model)
    targets = _shard_units(model, layout, kwargs, info)
    fully_shard(model, **kwargs)
    construction.fill_shards(model, deferred, torch.device("cpu") if decided.fsdp_cpu_offload else info.device)
    # a state dict read on one rank changes nothing, and is whole where it can be
    whole_params.install(model, mark_gathered=decided.reshard_after_forward is not False)
    for leaf in leaves.get_z3_leaf_modules(model):
        leaf.register_forward_hook(leaves.grads_for_every_parameter, prepend=True)  # before FSDP2 reshards it
    zero_params.mark_partitioned(model, precision.param_dtype)  # what DeepSpeed scripts test before gathering
    if decided.step.stage == 3:  # the objects a script still holds: DeepSpeed's partitioned parameters, tied to shards
        ds_layout.link_originals(model, before)
        external_params.install(model)  # another module's parameter read in the forward is gathered, as in DeepSpeed
    ds_layout.allow_allclose()
    if layout.forward_prefetch:
        # Each unit issues the next one's all-gather as soon as its own is copied out, so that the transfer
        # overlaps this unit's forward. Without it, a unit's all-gather starts only when its forward does: on
        # a GPU a separate stream still overlaps it, on the CPU nothing does. Units are in registration order,
        # which is the execution order of a stack of blocks.
        for current, following in zip(targets, targets[1:]):
            current.set_modules_to_forward_prefetch([following])
    sp = sequence_degree(decided)
    _fsdp_reduction(model, layout, gradients, kwargs["mesh"].size(), sp)
    return ShardPlan(model, model, "fsdp", kwargs["mesh"], keep_whole=decided.reshard_after_forward is False, sp=sp)


def _fsdp_kwargs(decided: EnginePlan, offload: OffloadConfig, precision: PrecisionPlan, info: DistInfo,
                 mesh: object | None) -> dict:  # fmt: skip
    """``fully_shard``'s arguments: the plan's mesh (or ``mesh``), resharding, mixed precision and CPU offload."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    if mesh is None:
        names = ("replicate", "shard") if len(decided.mesh) == 2 else ("shard",)
        mesh = init_device_mesh(info.device.type, decided.mesh, mesh_dim_names=names)
    pin = offload.pin_memory and torch.cuda.is_available()
    return dict(mesh=mesh, reshard_after_forward=decided.reshard_after_forward,
                mp_policy=precision.fsdp_policy or MixedPrecisionPolicy(),
                offload_policy=CPUOffloadPolicy(pin_memory=pin) if decided.fsdp_cpu_offload else OffloadPolicy())


def _shard_units(model: nn.Module, layout: ShardingPlan, kwargs: dict, info: DistInfo) -> list:
    """``fully_shard`` on each unit of the plan; the first module of each unit (a unit's modules share one FSDP2
    state), in order: the prefetch order."""
    from torch.distributed.fsdp import fully_shard

    plan = plan_units(model, layout)
    if info.rank == 0:
        for line in plan.describe():
            log.info("sharding: %s", line)
    named = dict(model.named_modules())
    targets = []
    for unit in plan.units:
        modules = [named[name] for name in unit.modules]
        own = kwargs if unit.reshard_after_forward is None else {**kwargs, "reshard_after_forward":
                                                                  unit.reshard_after_forward}  # fmt: skip
        fully_shard(modules if len(modules) > 1 else modules[0], **own)
        targets.append(modules[0])
    return targets


def _fsdp_reduction(model: nn.Module, layout: ShardingPlan, gradients: GradientsConfig, ranks: int,
                    sp: int) -> None:  # fmt: skip
    """FSDP2's reduction as configured (a plain sum for ``reduce_op: sum``; under Ulysses a mean over the ``ranks /
    sp`` data-parallel replicas, DeepSpeed's divisor, where FSDP2 divides by ``ranks``); what it ignores said once."""
    divisor = 1.0 if gradients.reduce_op == "sum" else float(ranks // sp)
    if gradients.reduce_op == "sum" or sp > 1:
        for unit in model.modules():
            if hasattr(unit, "set_gradient_divide_factor"):  # per unit: the setters do not recurse
                unit.set_gradient_divide_factor(divisor)
                # a plain SUM collective, divided after (gloo has no PREMUL_SUM, which a divide factor selects)
                unit.set_force_sum_reduction_for_comms(True)
    if gradients.predivide_factor != 1.0 or gradients.prescale:
        log.info("gradients.predivide_factor/prescale: FSDP2 divides once for the mean; the result is the same "
                 "mean (DeepSpeed requires predivide 1.0 with ZeRO-2/3 reduce-scatter)")  # fmt: skip
    if layout.backward_prefetch:
        log.info("sharding.backward_prefetch: FSDP2 prefetches the next unit in backward implicitly; the setting "
                 "has no effect")  # fmt: skip
