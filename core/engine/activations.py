"""Activation checkpointing: recompute each block's activations in backward (non-reentrant)."""

from __future__ import annotations

from torch import nn

from torsh.config import ActivationCheckpointingConfig, WrapPolicy
from torsh.errors import ConfigError, Problem

from .sharding import wrap_targets


def apply_activation_checkpointing(model: nn.Module, ac: ActivationCheckpointingConfig, wrap: WrapPolicy) -> int:
    """Checkpoint the modules named in ``ac.modules``, else the sharding units; returns how many.

    Uses the composable ``checkpoint``, which keeps parameter names (checkpoint keys) unchanged and
    composes with ``fully_shard`` applied afterwards.
    """
    if not ac.enabled:
        return 0
    from torch.distributed._composable import checkpoint

    if ac.modules:
        known = {type(m).__name__ for m in model.modules()}
        missing = [c for c in ac.modules if c not in known]
        if missing:
            raise ConfigError([Problem("activation_checkpointing.modules", missing, "no module of these classes "
                                       f"in the model; its classes are {sorted(known)}")])  # fmt: skip
        targets = [m for m in model.modules() if type(m).__name__ in ac.modules]
    else:
        targets = wrap_targets(model, wrap)
    for module in targets:
        checkpoint(module)
    return len(targets)
