"""``deepspeed.runtime.utils``: the helpers training scripts call."""

from __future__ import annotations

import logging
import random

import torch

log = logging.getLogger("torsh.compat")


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, numpy (when installed; seed modulo 2**32 as numpy needs) and torch."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed % (2**32))
    torch.manual_seed(seed)


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


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries (``num_parts + 1`` indices) splitting ``num_items`` items into parts whose sizes differ by at
    most one, the larger parts first."""
    base, extra = divmod(num_items, num_parts)
    bounds = [0]
    for part in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if part < extra else 0))
    return bounds


def partition_balanced(weights, num_parts: int) -> list[int]:
    """Boundaries (``num_parts + 1`` indices into ``weights``) of DeepSpeed 0.19.8's split into contiguous parts
    (``PipelineModule``'s "parameters" and "type:" partitions): the largest and smallest sums differ least; among
    equal spreads the later cut wins. Fewer items than parts: a uniform split."""
    n = len(weights)
    if n <= num_parts:
        return partition_uniform(n, num_parts)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # for i items in j parts: (spread, largest, smallest) of the chosen split, and where its last part starts
    table: dict[tuple[int, int], tuple[float, float, float, int]] = {(0, 0): (0.0, 0.0, inf, 0)}
    for i in range(1, n + 1):
        for j in range(1, min(i, num_parts) + 1):
            chosen = None
            for k in range(j - 1, i):
                before = table.get((k, j - 1))
                if before is None:
                    continue
                part = prefix[i] - prefix[k]
                largest, smallest = max(before[1], part), min(before[2], part)
                spread = largest - smallest
                if chosen is None or spread <= chosen[0]:
                    chosen = (spread, largest, smallest, k)
            if chosen is not None:
                table[(i, j)] = chosen
    bounds = [n]
    for j in range(num_parts, 0, -1):
        bounds.append(table[(bounds[-1], j)][3])
    return bounds[::-1]


def call_to_str(base: str, *args, **kwargs) -> str:
    """``base(arg, ..., key=value, ...)`` with the arguments' reprs, as DeepSpeed prints calls in its logs."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{base}({', '.join(parts)})"
