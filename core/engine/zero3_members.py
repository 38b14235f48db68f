"""The members of DeepSpeed's ZeRO-3 optimizer (``DeepSpeedZeroOptimizer_Stage3``) on the torch optimizer the torsh
engine steps at ZeRO-3.

At ZeRO-3 ``engine.optimizer`` is a torch optimizer over the FSDP2-sharded fp32 parameters (each rank steps its
shard), which is what DeepSpeed's ZeRO-3 optimizer does with its fp32 partitions. Scripts and DeepSpeed's tests
test ``isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3)`` and then read its members; the optimizer is
marked (:data:`MARK`, which ``deepspeed.runtime.zero.stage3``'s class recognises) and given, besides the gradient
views :func:`torsh.engine.zero.ds_layout.attach_views` gives it (``fp16_groups``,
``fp32_partitioned_groups_flat``, ``averaged_gradients``, ``_global_grad_norm``, ...), these members:

- ``_get_norm_groups()``: per parameter group, the 2-norm of the gradients of every rank (a collective);
- ``micro_step_id``: the backwards reduced into the gradients since the last step.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

MARK = "_torsh_deepspeed_zero3_optimizer"
"""The attribute marking an optimizer as standing for DeepSpeed's ZeRO-3 optimizer."""


def adopt(engine: Any, optimizer: Any) -> None:
    """Mark ``optimizer`` (the engine's, at ZeRO-3 under FSDP2) and give it the members above."""
    if engine.zero_optimization_stage() != 3 or engine._shard.kind != "fsdp":
        return
    setattr(optimizer, MARK, True)
    owner = weakref.ref(engine)

    def _get_norm_groups() -> list[torch.Tensor]:
        """Per parameter group, the 2-norm of the (unscaled) gradients of every rank."""
        engine = owner()
        inv_scale = 1.0 / engine.loss_scale() if engine is not None else 1.0
        return [_norm([p.grad for p in group["params"] if p.grad is not None]) * inv_scale
                for group in optimizer.param_groups]  # fmt: skip

    optimizer._get_norm_groups = _get_norm_groups
    after_step(engine)


def after_step(engine: Any) -> None:
    """After an optimizer step (and ``zero_grad``): no reduced backward in the gradients."""
    optimizer = engine.optimizer
    if optimizer is not None and getattr(optimizer, MARK, False):
        optimizer.micro_step_id = 0


def count_micro_step(engine: Any) -> None:
    """A backward was reduced into the sharded gradients."""
    optimizer = engine.optimizer
    if optimizer is not None and getattr(optimizer, MARK, False):
        optimizer.micro_step_id = getattr(optimizer, "micro_step_id", 0) + 1


def _norm(grads: list[torch.Tensor]) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    return total.full_tensor() if hasattr(total, "full_tensor") else total

