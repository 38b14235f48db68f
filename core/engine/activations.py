"""Activation checkpointing: recompute each block's activations in backward (non-reentrant)."""

from __future__ import annotations

from torch import nn

from torsh.config import ActivationCheckpointingConfig, WrapPolicy

from .zero.wrap import modules_of_classes, wrap_targets


def apply_activation_checkpointing(model: nn.Module, ac: ActivationCheckpointingConfig, wrap: WrapPolicy) -> int:
    """Checkpoint the modules named in ``ac.modules``, else the sharding units; returns how many.

    Uses the composable ``checkpoint``, which keeps parameter names (checkpoint keys) unchanged and
    composes with ``fully_shard`` applied afterwards.
    """
    if not ac.enabled:
        return 0
    from torch.distributed._composable import checkpoint

    if ac.modules:
        targets = modules_of_classes(model, ac.modules, "activation_checkpointing.modules")
    else:
        targets = wrap_targets(model, wrap)
    for module in targets:
        checkpoint(module)
    return len(targets)
