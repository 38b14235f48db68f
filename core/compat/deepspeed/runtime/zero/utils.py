"""``deepspeed.runtime.zero.utils``: ``ZeRORuntimeException`` (what DeepSpeed raises for a ZeRO setup it refuses;
scripts catch it), ``is_zero_supported_optimizer`` and ``is_zero_param``."""

from __future__ import annotations


class ZeRORuntimeException(Exception):
    """A ZeRO configuration DeepSpeed refuses at run time."""


def is_zero_supported_optimizer(optimizer) -> bool:
    """Whether ``optimizer`` is one DeepSpeed's ZeRO has been tested with; the torsh engine shards any torch
    optimizer, so every ``torch.optim.Optimizer`` is."""
    import torch

    return isinstance(optimizer, torch.optim.Optimizer)


def is_zero_param(parameter) -> bool:
    """Whether ``parameter`` is partitioned (DeepSpeed: has ZeRO-3 attributes): by ``zero.Init``, or sharded by
    ``initialize`` (an FSDP2 DTensor)."""
    from torch.distributed.tensor import DTensor

    from torsh.engine.zero import construction

    return isinstance(parameter, DTensor) or construction.is_partitioned(parameter)
