"""``deepspeed.runtime.utils``: the helpers training scripts call."""

from __future__ import annotations

import logging

import torch

from torsh.engine.pipeline.module import (  # noqa: F401  (the engine's: PipelineModule's partition and seeding)
    call_to_str,
    partition_balanced,
    partition_uniform,
    set_random_seed,
)

log = logging.getLogger("torsh.compat")


def see_memory_usage(message, force=False, ranks=None) -> None:
    """Log memory in use (DeepSpeed prints only with ``force=True``)."""
    if not force:
        return
    from ..accelerator import get_accelerator

    acc = get_accelerator()
    gib = 2**30
    log.info("%s | allocated %.2f GiB, max allocated %.2f GiB", message, acc.memory_allocated() / gib,
             acc.max_memory_allocated() / gib)  # fmt: skip


def clip_grad_norm_(parameters, max_norm, norm_type=2, mpu=None):
    """``torch.nn.utils.clip_grad_norm_`` (no model parallelism: the data-parallel norm is the norm)."""
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)


def get_global_norm(norm_list) -> float:
    """The 2-norm of per-group 2-norms."""
    return float(sum(n**2 for n in norm_list) ** 0.5)


def move_to_device(item, device, criterion_func=None):
    """Move every tensor in a (nested) list, tuple or dict to ``device``."""
    if torch.is_tensor(item):
        return item.to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(move_to_device(v, device) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device) for k, v in item.items()}
    return item


def noop_decorator(func):
    return func


def memory_status(msg, print_rank=-1, reset_max=False) -> None:
    """Log accelerator memory on ``print_rank`` (-1: every rank), as DeepSpeed's ``memory_status``."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if print_rank != -1 and rank != print_rank:
        return
    see_memory_usage(f"rank {rank}: {msg}", force=True)
    if reset_max:
        from ..accelerator import get_accelerator

        get_accelerator().reset_max_memory_allocated()
