"""``deepspeed.runtime.zero.utils``: ``ZeRORuntimeException`` (what DeepSpeed raises for a ZeRO setup it refuses;
scripts catch it) and ``is_zero_supported_optimizer``."""

from __future__ import annotations


class ZeRORuntimeException(Exception):
    """A ZeRO configuration DeepSpeed refuses at run time."""


def is_zero_supported_optimizer(optimizer) -> bool:
    """Whether ``optimizer`` is one DeepSpeed's ZeRO has been tested with; the torsh engine shards any torch
    optimizer, so every ``torch.optim.Optimizer`` is."""
    import torch

    return isinstance(optimizer, torch.optim.Optimizer)
