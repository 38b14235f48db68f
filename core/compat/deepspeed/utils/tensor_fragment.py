"""``deepspeed.utils.tensor_fragment``: DeepSpeed's per-parameter access to what ZeRO partitions - the fp32
weights the optimizer steps, the gradient the next step uses, and the optimizer state - at every stage.

``safe_get_full_*`` gives the whole value on every rank (a collective wherever the value is partitioned: call it on
every rank); ``safe_set_full_*`` takes the whole value, the same on every rank, and each rank keeps its part (not
collective). ``safe_get_local_*`` / ``safe_set_local_*`` read and write this rank's part: at ZeRO-3 its partition in
DeepSpeed's layout (1-D, ``ceil(numel / W)`` elements, what ``param.ds_tensor`` holds: FSDP2 cuts by rows, so
where the first dimension does not split evenly over the ranks reading or writing it is a collective, as the whole
values are), at ZeRO-1/2 this rank's elements of the parameter's flat partition, at stage 0 the whole tensor. A parameter that does not train has no
fp32 weights, gradient or state of the optimizer's: the getters give None and the setters leave it, as DeepSpeed's.

Where the values are, per stage, is :mod:`torsh.engine.zero.fragments`. Optimizer state exists from the
optimizer's first step on (torch optimizers create it then; DeepSpeed's ZeRO optimizers create it at
construction): the getters give None before, the setters raise.
"""

from __future__ import annotations

import contextlib

from collections.abc import Callable

import torch

from torsh.engine.zero import fragments
from torsh.engine.zero.fragments import FlatPart, Whole, is_elementwise, locate, original
from torsh.engine.zero.params import PENDING_FP32, write_whole

__all__ = ["safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_grad", "safe_set_full_grad",
           "safe_get_full_optimizer_state", "safe_set_full_optimizer_state", "safe_get_local_fp32_param",
           "safe_set_local_fp32_param", "safe_get_local_grad", "safe_set_local_grad",
           "safe_get_local_optimizer_state", "safe_set_local_optimizer_state",
           "safe_update_full_grad_vectorized"]  # fmt: skip


# --- fp32 weights ---------------------------------------------------------------------------------------------


def _fp32_holder(param: torch.Tensor) -> tuple[fragments.Layout, torch.Tensor]:
    layout, stepped = locate(param)
    return layout, stepped.data if isinstance(layout, FlatPart) else stepped


def safe_get_full_fp32_param(param) -> torch.Tensor | None:
    """The whole fp32 weights the optimizer steps for ``param`` (its master under fp16/bf16; what
    :func:`safe_set_full_fp32_param` wrote); None for a parameter that does not train. Collective under ZeRO."""
    param = original(param)
    if not param.requires_grad:
        return None
    pending = getattr(param, PENDING_FP32, None)
    if pending is not None:
        return pending.float().clone()
    layout, held = _fp32_holder(param)
    return layout.full(held).float()


def safe_set_full_fp32_param(param, value) -> None:
    """Write ``value`` (the whole parameter, the same on every rank) into the fp32 weights the optimizer steps: the
    master under fp16/bf16 and at ZeRO-1/2, whose next step copies it into the weights; a parameter the optimizer
    steps directly (fp32 at stage 0, FSDP2's shards) takes it at the next optimizer step, before the update, so
    until then the forward uses the old weights, as DeepSpeed's. A parameter that does not train is left alone."""
    param = original(param)
    if not param.requires_grad:
        return
    layout, held = _fp32_holder(param)
    if held is param:
        fragments.check_numel("safe_set_full_fp32_param", value, param.numel(),
                               f"the whole parameter, shape {tuple(param.shape)}")  # fmt: skip
        setattr(param, PENDING_FP32, value.detach().reshape(param.shape).clone())
    else:
        layout.write_full(held, value, "safe_set_full_fp32_param")


def safe_get_local_fp32_param(param) -> torch.Tensor | None:
    """This rank's part of the fp32 weights the optimizer steps for ``param`` (see the module docstring); None
    for a parameter that does not train."""
    param = original(param)
    if not param.requires_grad:
        return None
    layout, held = _fp32_holder(param)
    pending = getattr(param, PENDING_FP32, None)
    if pending is not None:  # written whole, not stepped yet: the same value on every rank
        return layout.part_of(pending).float()
    return layout.local(held).float()


def safe_set_local_fp32_param(param, value) -> None:
    """Write ``value`` (shaped or sized as :func:`safe_get_local_fp32_param` gives it) as this rank's part of the
    fp32 weights the optimizer steps. Where the optimizer steps the parameter itself (FSDP2's shards, fp32 at stage
    0) the forward uses it at once; DeepSpeed's from its next step."""
    param = original(param)
    if not param.requires_grad:
        return
    layout, held = _fp32_holder(param)
    _flush_pending(param)
    layout.write_local(held, value, "safe_set_local_fp32_param")


def _flush_pending(param: torch.Tensor) -> None:
    """A whole value :func:`safe_set_full_fp32_param` left for the next step, written into the weights now (a
    part is about to be read or written: both must see it). Every rank holds the same value: not collective."""
    pending = param.__dict__.pop(PENDING_FP32, None)
    if pending is not None:
        write_whole(param, pending)


# --- gradients -------------------------------------------------------------------------------------------------


def _grad_holder(param: torch.Tensor) -> tuple[fragments.Layout | None, torch.Tensor | None]:
    """The layout and tensor holding ``param``'s gradient for the next step: a ZeRO-1/2 group's partition gradient
    once a reduced backward wrote it (before: the whole gradient backward left on the parameter), the fp32
    master's gradient, else the parameter's (a DTensor under FSDP2); (None, None) before backward."""
    layout, stepped = locate(param)
    if isinstance(layout, FlatPart):
        part, bucket, _ = layout.slot
        if bucket.index in part._written:
            return layout, part.grads[bucket.group]
        return (Whole(param), param.grad) if param.grad is not None else (None, None)
    grad = stepped.grad if stepped.grad is not None else param.grad
    return (layout, grad) if grad is not None else (None, None)


def _grad_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype DeepSpeed gives gradients in: that of the weights the optimizer steps (fp32 under fp16/bf16)."""
    return locate(param)[1].dtype


def safe_get_full_grad(param) -> torch.Tensor | None:
    """The whole gradient of ``param`` the next step uses, in the dtype of the weights the optimizer steps (fp32
    under fp16/bf16, as DeepSpeed's ZeRO optimizers give it); None before backward and for a parameter that does
    not train. Collective under ZeRO-1/2 after the reduction and under FSDP2."""
    param = original(param)
    if not param.requires_grad:
        return None
    layout, grad = _grad_holder(param)
    return None if grad is None else layout.full(grad).to(_grad_dtype(param))


def safe_set_full_grad(param, value) -> None:
    """Write ``value`` (the whole gradient of ``param``, the same on every rank) as the gradient the next optimizer
    step uses, between ``backward`` and ``step`` (custom clipping, gradient surgery, injected overflow). Each rank
    keeps its part where the gradient is partitioned; before backward it becomes the parameter's gradient. Not
    collective."""
    param = original(param)
    if not param.requires_grad:
        return
    layout, grad = _grad_holder(param)
    if grad is not None:
        layout.write_full(grad, value, "safe_set_full_grad")
        return
    fragments.check_numel("safe_set_full_grad", value, param.numel(),
                           f"the whole gradient, shape {tuple(param.shape)}")  # fmt: skip
    param.grad = _like(param, value)


def _like(target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` as ``target`` holds it: its dtype and device, sharded as ``target`` when it is a DTensor (each rank
    takes its shard of the whole value it holds; no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    local = target.to_local() if isinstance(target, DTensor) else target
    value = value.detach().reshape(target.shape).to(dtype=local.dtype, device=local.device, copy=True)
    if isinstance(target, DTensor):
        return distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
    return value


def safe_get_local_grad(param) -> torch.Tensor | None:
    """This rank's part of ``param``'s gradient (see the module docstring), in the dtype of the weights the optimizer
    steps; None before backward and for a parameter that does not train."""
    param = original(param)
    if not param.requires_grad:
        return None
    layout, grad = _grad_holder(param)
    return None if grad is None else layout.local(grad).to(_grad_dtype(param))


def safe_set_local_grad(param, value) -> None:
    """Write ``value`` (sized as :func:`safe_get_local_grad` gives it) as this rank's part of ``param``'s gradient,
    the one the next optimizer step uses (custom clipping between backward and step)."""
    param = original(param)
    if not param.requires_grad:
        return
    layout, grad = _grad_holder(param)
    if grad is None:
        layout, _ = locate(param)
        if not isinstance(layout, Whole):
            raise ValueError("safe_set_local_grad: the parameter has no gradient yet and it is partitioned: write "
                             "a local part after engine.backward(), or the whole gradient with safe_set_full_grad")
        param.grad = torch.zeros_like(param)
        layout, grad = Whole(param), param.grad
    layout.write_local(grad, value, "safe_set_local_grad")


def safe_update_full_grad_vectorized(param_list: list, update_func: Callable) -> None:
    """For each parameter of ``param_list`` that trains and has a gradient: ``update_func(full_gradient, param)``
    (the whole gradient as :func:`safe_get_full_grad` gives it) becomes its gradient, as
    :func:`safe_set_full_grad` writes it. Collective under ZeRO: call on every rank with the same list."""
    for param in param_list:
        old = safe_get_full_grad(param)
        if old is not None:
            safe_set_full_grad(param, update_func(old, param))


# --- optimizer state -------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _optimizer_state(param: torch.Tensor, key: str, what: str, *, required: bool):
    """The block in which ``(layout, state)``: the layout of ``param`` and its per-element optimizer state ``key``,
    held in host memory (NVMe offload reads it in, and writes back what the block changed). ``(None, None)`` for a
    parameter that does not train, and before the optimizer's first step (an error then when ``required``)."""
    param = original(param)
    if not param.requires_grad:
        yield None, None
        return
    layout, stepped = locate(param)
    with fragments.state_resident(stepped):
        state = fragments.optimizer_state(stepped)
        if state is None:
            if required:
                raise ValueError(f"{what}: the optimizer has no state for this parameter yet (torch optimizers "
                                 "create it at their first step): call it after engine.step()")  # fmt: skip
            yield None, None
            return
        if key not in state:
            raise ValueError(f"{what}: the optimizer state has no {key!r}; it holds {sorted(state)}")
        value = state[key]
        if not is_elementwise(value, stepped):
            raise ValueError(f"{what}: optimizer state {key!r} is not one value per element of the parameter (it "
                             f"is {type(value).__name__}{tuple(value.shape) if torch.is_tensor(value) else ''}); "
                             "only per-element state such as Adam's exp_avg is read or written per parameter")
        yield layout, value


def safe_get_full_optimizer_state(param, optim_state_key) -> torch.Tensor | None:
    """The whole optimizer state ``optim_state_key`` (Adam: ``exp_avg``, ``exp_avg_sq``) of ``param``; None for a
    parameter that does not train and before the optimizer's first step. Collective under ZeRO."""
    with _optimizer_state(param, optim_state_key, "safe_get_full_optimizer_state", required=False) as (layout, value):
        return None if value is None else layout.full(value)


def safe_set_full_optimizer_state(param, value, optim_state_key) -> None:
    """Write ``value`` (the whole state, the same on every rank) as optimizer state ``optim_state_key`` of
    ``param``; each rank keeps its part. Not collective. After the optimizer's first step (before it, it has
    none)."""
    with _optimizer_state(param, optim_state_key, "safe_set_full_optimizer_state", required=True) as (layout, held):
        if held is not None:
            layout.write_full(held, value, "safe_set_full_optimizer_state")


def safe_get_local_optimizer_state(param, optim_state_key) -> torch.Tensor | None:
    """This rank's part of optimizer state ``optim_state_key`` of ``param`` (see the module docstring); None for a
    parameter that does not train and before the optimizer's first step."""
    with _optimizer_state(param, optim_state_key, "safe_get_local_optimizer_state", required=False) as (layout,
                                                                                                         value):
        return None if value is None else layout.local(value)


def safe_set_local_optimizer_state(param, value, optim_state_key) -> None:
    """Write ``value`` (sized as :func:`safe_get_local_optimizer_state` gives it) as this rank's part of optimizer
    state ``optim_state_key`` of ``param``. After the optimizer's first step."""
    with _optimizer_state(param, optim_state_key, "safe_set_local_optimizer_state", required=True) as (layout, held):
        if held is not None:
            layout.write_local(held, value, "safe_set_local_optimizer_state")

