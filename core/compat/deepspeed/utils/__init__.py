"""``deepspeed.utils``: logging helpers, ``RepeatingLoader``, and the ZeRO parameter accessors scripts call."""

from __future__ import annotations

import logging as _logging  # not ``logging``: that name is DeepSpeed's submodule deepspeed.utils.logging

import torch as _torch  # not ``torch``: that name is the submodule deepspeed.utils.torch once imported

from torsh.engine.precision import MASTER
from torsh.engine.zero.params import PENDING_FP32, write_whole
from torsh.engine.zero.partition import ZERO_SLOT

from ..runtime.dataloader import RepeatingLoader  # noqa: F401
from .._unsupported import unsupported_function
from .z3_leaf_module import *  # noqa: F401,F403 (as in DeepSpeed, the function shadows its module's name)

logger = _logging.getLogger("DeepSpeed")
if not logger.handlers:
    _handler = _logging.StreamHandler()
    _handler.setFormatter(_logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(_logging.INFO)
    logger.propagate = False


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else -1


def log_dist(message, ranks=None, level=_logging.INFO) -> None:
    """Log ``message`` on the listed ranks (all ranks when ``ranks`` holds -1; every process before the process
    group exists)."""
    rank = _rank()
    if rank == -1 or ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


_logged_once: set = set()


def log_dist_once(message, ranks=None, level=_logging.INFO) -> None:
    if message not in _logged_once:
        _logged_once.add(message)
        log_dist(message, ranks=ranks, level=level)


def set_log_level_from_string(log_level_str, custom_logger=None) -> None:
    (custom_logger or logger).setLevel(getattr(_logging, str(log_level_str).upper()))


def _full(param) -> _torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.full_tensor() if isinstance(param, DTensor) else param.detach()


def _fp32(param):
    """The fp32 tensor the optimizer steps for ``param``: its master copy (stages 0/1 in fp16/bf16, DeepSpeed's
    hp param), else the parameter itself (under FSDP2 the shards are the fp32 masters)."""
    return getattr(param, MASTER, param)


def safe_get_full_fp32_param(param) -> _torch.Tensor:
    """The full fp32 value of ``param`` (gathered when sharded; what :func:`safe_set_full_fp32_param` wrote);
    collective under sharding: call on every rank."""
    pending = getattr(param, PENDING_FP32, None)
    if pending is None and hasattr(param, ZERO_SLOT):  # ZeRO-2: the master is partitioned
        return getattr(param, ZERO_SLOT)[0].full_master(param)
    return pending.float().clone() if pending is not None else _full(_fp32(param)).float().clone()


def safe_get_full_grad(param) -> _torch.Tensor | None:
    """The full gradient of ``param`` in the dtype of the weights the optimizer steps (fp32 under fp16/bf16, as
    DeepSpeed's ZeRO optimizers give it), gathered when sharded; None before backward. Collective under sharding."""
    if hasattr(param, ZERO_SLOT):
        return getattr(param, ZERO_SLOT)[0].full_grad(param)
    source = _fp32(param)
    grad = source.grad if source.grad is not None else param.grad
    return None if grad is None else _full(grad).to(source.dtype, copy=True)


def safe_set_full_grad(param, value) -> None:
    """Write ``value`` (the whole gradient of ``param``, the same on every rank) as the gradient the next optimizer
    step uses, as DeepSpeed's: between ``backward`` and ``step`` (custom clipping, gradient surgery, injected
    overflow). Each rank keeps its own part where the gradient is partitioned (ZeRO-2's reduced buckets, FSDP2's
    shards); the fp32 master's gradient under fp16/bf16 at stages 0/1. Not collective."""
    if value.numel() != param.numel():
        raise ValueError(f"safe_set_full_grad: the value has {value.numel()} elements, the parameter "
                         f"{param.numel()} (pass the whole gradient, shape {tuple(param.shape)})")  # fmt: skip
    with _torch.no_grad():
        if hasattr(param, ZERO_SLOT):
            part, bucket, _ = getattr(param, ZERO_SLOT)
            if bucket.index in part._written:  # reduced into this rank's flat partition: write its elements there
                start, end = part.local_range(param)
                part.local_view(param, part.grads[bucket.group]).copy_(value.reshape(-1)[start:end])
                return
        source = _fp32(param)
        holder = source if source.grad is not None else param
        if holder.grad is None:
            holder.grad = _like(holder, value)
        else:
            _local(holder.grad).copy_(_local(_like(holder.grad, value)))


def _like(target, value):
    """``value`` as ``target`` holds it: its dtype and device, sharded as ``target`` when it is a DTensor (each
    rank takes its shard of the whole value it holds; no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    value = value.detach().reshape(target.shape).to(dtype=target.dtype, device=_local(target).device, copy=True)
    if isinstance(target, DTensor):
        return distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
    return value


def safe_set_full_fp32_param(param, value) -> None:
    """Write ``value`` (the whole parameter, the same on every rank) into the fp32 weights the optimizer steps, as
    DeepSpeed's: the master copy at stages 0/1 under fp16/bf16; a parameter the optimizer steps directly (fp32,
    FSDP2 shards) takes it at the next optimizer step, before the update, so until then the forward uses the old
    weights, as DeepSpeed's. A parameter that does not train is left alone, as DeepSpeed leaves it."""
    if not param.requires_grad:
        return
    if hasattr(param, ZERO_SLOT):  # ZeRO-2: this rank's part of the fp32 master; the step copies it into the weights
        if value.numel() != param.numel():
            raise ValueError(f"safe_set_full_fp32_param: the value has {value.numel()} elements, the parameter "
                             f"{param.numel()} (pass the whole parameter, shape {tuple(param.shape)})")  # fmt: skip
        getattr(param, ZERO_SLOT)[0].set_full_master(param, value)
        return
    target = _fp32(param)
    if value.numel() != target.numel():
        raise ValueError(f"safe_set_full_fp32_param: the value has {value.numel()} elements, the parameter "
                         f"{target.numel()} (pass the whole parameter, shape {tuple(target.shape)})")  # fmt: skip
    if target is param:
        setattr(param, PENDING_FP32, value.detach().clone())
    else:
        write_whole(target, value)


def safe_get_local_fp32_param(param) -> _torch.Tensor:
    """This rank's part of ``param`` in fp32 (its shard when sharded)."""
    from torch.distributed.tensor import DTensor

    if hasattr(param, ZERO_SLOT):  # ZeRO-2: this rank's elements of the flattened parameter (maybe none)
        part, bucket, _ = getattr(param, ZERO_SLOT)
        return part.local_view(param, part.masters[bucket.group].data).float().clone()
    source = _fp32(param)
    return (source.to_local() if isinstance(source, DTensor) else source.detach()).float()


def _local(tensor):
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def safe_get_local_grad(param) -> _torch.Tensor | None:
    """This rank's part of ``param``'s gradient (its shard under ZeRO-3 / FSDP2, the whole gradient otherwise), in
    the dtype of the weights the optimizer steps (fp32 under fp16/bf16), as DeepSpeed gives it; None before
    backward. Not collective."""
    if hasattr(param, ZERO_SLOT):  # ZeRO-2: this rank's elements of the flattened gradient (maybe none)
        part, bucket, _ = getattr(param, ZERO_SLOT)
        if bucket.index not in part._written:
            return None
        return part.local_view(param, part.grads[bucket.group]).float().clone()
    source = _fp32(param)
    grad = source.grad if source.grad is not None else param.grad
    return None if grad is None else _local(grad).to(_local(source).dtype, copy=True)


def safe_set_local_grad(param, value) -> None:
    """Write ``value`` (shaped as :func:`safe_get_local_grad` gives it) as this rank's part of ``param``'s
    gradient, the one the next optimizer step uses (custom clipping between backward and step)."""
    if hasattr(param, ZERO_SLOT):
        part, bucket, _ = getattr(param, ZERO_SLOT)
        local = part.local_view(param, part.grads[bucket.group])
        if value.numel() != local.numel():
            raise ValueError(f"safe_set_local_grad: the value has {value.numel()} elements, this rank's part of the "
                             f"gradient {local.numel()} (pass what safe_get_local_grad gave)")  # fmt: skip
        with _torch.no_grad():
            local.copy_(value.reshape(-1))
        return
    source = _fp32(param)
    grad = source.grad if source.grad is not None else param.grad
    if grad is not None:
        local = _local(grad)
        if value.shape != local.shape:
            raise ValueError(f"safe_set_local_grad: the value has shape {tuple(value.shape)}, this rank's part of "
                             f"the gradient {tuple(local.shape)} (pass what safe_get_local_grad gave)")  # fmt: skip
        with _torch.no_grad():
            local.copy_(value)
        return
    from torch.distributed.tensor import DTensor

    value = value.detach().to(_local(source).dtype, copy=True)
    if isinstance(source, DTensor):
        value = DTensor.from_local(value, source.device_mesh, source.placements, run_check=False)
    source.grad = value


class OnDevice:
    """Build a model on ``device`` with ``dtype`` as the default (``device="meta"``: without memory)."""

    def __init__(self, dtype, device="meta", enabled=True):
        self.dtype, self.device, self.enabled = dtype, device, enabled
        self._ctx = None
        self._dtype = None

    def __enter__(self):
        if self.enabled:
            self._dtype = _torch.get_default_dtype()
            if self.dtype is not None and self.dtype.is_floating_point:
                _torch.set_default_dtype(self.dtype)
            self._ctx = _torch.device(self.device)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self._ctx.__exit__(*exc)
            _torch.set_default_dtype(self._dtype)
        return False


safe_get_full_optimizer_state = unsupported_function(
    "utils.safe_get_full_optimizer_state", "read engine.optimizer.state[param] (a DTensor under stages 2/3)")


def __getattr__(name: str):
    if name in ("zero_to_fp32", "logging", "groups", "torch", "module_utils", "z3_leaf_module", "numa"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'deepspeed.utils' (torsh's DeepSpeed compatibility package) has no attribute "
                         f"{name!r}")  # fmt: skip
