"""DeepSpeed's ZeRO attributes on the parameters torsh shards (FSDP2 DTensors, stages 2/3).

Scripts written for DeepSpeed ask ``hasattr(p, "ds_id")`` to decide whether a parameter must be gathered before
its value is read: LLaVA's and FastChat's ``maybe_zero_3``, DeepSpeed-Chat's ``save_zero_three_model`` (which also
keeps only the parameters whose ``ds_status`` is ``NOT_AVAILABLE``), OpenRLHF's weight broadcast (``ds_shape``).
Without the attributes they take their other branch and copy this rank's shard. So every sharded parameter
carries them: at stage 3 as in DeepSpeed, and at stage 2 too, because torsh shards parameters there as well
(DeepSpeed does not), and the gathering branch is the one that reads the whole value.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from . import whole_params
from .whole_params import COMPUTE_DTYPE, ZeroParamStatus  # noqa: F401  (DeepSpeed's names, used from here)

PENDING_FP32 = "_torsh_pending_fp32"
"""A whole value ``deepspeed.utils.safe_set_full_fp32_param`` wrote for a parameter the optimizer steps directly:
held until the next optimizer step updates from it, as DeepSpeed writes its fp32 partition, which the forward
does not read until that step copies it into the weights."""


def mark_partitioned(model: nn.Module, compute_dtype: torch.dtype) -> None:
    """Give each sharded parameter of ``model`` DeepSpeed's ``ds_id``, ``ds_status``, ``ds_shape`` and
    ``ds_numel`` (whole shape and size)."""
    from torch.distributed.tensor import DTensor

    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]  # a tied weight once
    for ds_id, p in enumerate(sharded):
        p.ds_id, p.ds_status, p.ds_shape, p.ds_numel = ds_id, ZeroParamStatus.NOT_AVAILABLE, p.shape, p.numel()
        p.ds_persist = False  # FSDP2 shards every parameter (DeepSpeed keeps those below its threshold whole)
        # the shard is never what a module computes with (FSDP2 registers a gathered parameter in its place), so no
        # module has it in use; a read outside its module's forward marks it external (.external_params)
        p.ds_active_sub_modules, p.is_external_param = set(), False
        p.ds_summary = types.MethodType(ds_summary, p)
        setattr(p, COMPUTE_DTYPE, compute_dtype)


def ds_summary(p: torch.Tensor) -> dict:
    """DeepSpeed's ``param.ds_summary()``: what its assertion messages print about a ZeRO-3 parameter."""
    return {"id": p.ds_id, "status": p.ds_status.name, "numel": p.numel(), "ds_numel": p.ds_numel,
            "shape": tuple(p.shape), "ds_shape": tuple(p.ds_shape), "requires_grad": p.requires_grad,
            "persist": p.ds_persist}  # fmt: skip


@torch.no_grad()
def write_whole(param: torch.Tensor, value: torch.Tensor) -> None:
    """Write the whole ``value`` into ``param``: under FSDP2 this rank's shard of it (every rank holds the same
    value, so nothing is communicated)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        local = param.to_local()
        whole = value.detach().reshape(param.shape).to(device=local.device, dtype=local.dtype)
        local.copy_(distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local())
        whole_params.stale(param)  # a gathered copy of the old value is not used again
    else:
        param.copy_(value.detach().reshape(param.shape))


@torch.no_grad()
def write_shown(param: torch.Tensor, value: torch.Tensor) -> None:
    """Write the whole ``value``, in the dtype the parameter was shown in (its compute dtype, DeepSpeed's
    parameter dtype: ``GatheredParameters``), into ``param``'s master: every element that differs from the value
    shown (the master rounded to that dtype) takes the written value, widened exactly; the others keep the
    master's value, so that showing a parameter and writing back what was not changed loses no precision. The
    same value on every rank gives the same shard everywhere (nothing is communicated)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor) or value.dtype == param.dtype:
        write_whole(param, value)
        return
    local = param.to_local()
    whole = value.detach().reshape(param.shape).to(device=local.device)
    written = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local()
    changed = written != local.to(written.dtype)
    local.copy_(torch.where(changed, written.to(local.dtype), local))
    whole_params.stale(param)


def write_pending(params: list[torch.Tensor]) -> None:
    """Before an optimizer step: the values :data:`PENDING_FP32` holds, written into the weights it updates."""
    for p in params:
        value = p.__dict__.pop(PENDING_FP32, None)
        if value is not None:
            write_whole(p, value)
