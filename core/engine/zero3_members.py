"""The members of DeepSpeed's ZeRO-3 optimizer (``DeepSpeedZeroOptimizer_Stage3``) on the torch optimizer the torsh
engine steps at ZeRO-3.

At ZeRO-3 ``engine.optimizer`` is a torch optimizer over the FSDP2-sharded fp32 parameters (each rank steps its
shard), which is what DeepSpeed's ZeRO-3 optimizer does with its fp32 partitions. Scripts and DeepSpeed's tests
test ``isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3)`` and then read a few of its members; the
optimizer is marked (:data:`MARK`, which ``deepspeed.runtime.zero.stage3``'s class recognises) and given those
members, each computed from the shards:

- ``fp32_partitioned_groups_flat``: per parameter group, this rank's fp32 elements, flat (read when accessed);
- ``_get_norm_groups()``: per parameter group, the 2-norm of the gradients of every rank (a collective);
- ``_global_grad_norm``: the gradient norm of the last step (before clipping), as the engine computed it;
- ``micro_step_id``: the backwards reduced into the gradients since the last step.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

MARK = "_torsh_deepspeed_zero3_optimizer"
"""The attribute marking an optimizer as standing for DeepSpeed's ZeRO-3 optimizer."""


def adopt(engine: Any, optimizer: Any) -> None:
    """Mark ``optimizer`` (the engine's, at ZeRO-3 under FSDP2) and give it the members above."""
    if engine.zero_optimization_stage() != 3 or engine._shard.kind != "fsdp":
        return
    setattr(optimizer, MARK, True)
    optimizer.fp32_partitioned_groups_flat = _FlatShards(optimizer)
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
    """After an optimizer step (and ``zero_grad``): no reduced backward in the gradients, the step's norm."""
    optimizer = engine.optimizer
    if optimizer is None or not getattr(optimizer, MARK, False):
        return
    optimizer.micro_step_id = 0
    optimizer._global_grad_norm = engine.__dict__.get("_global_grad_norm")


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


class _FlatShards(Sequence):
    """``fp32_partitioned_groups_flat``: item ``i`` is this rank's elements of parameter group ``i``, flat (a copy
    made when read, so it always shows the current values)."""

    def __init__(self, optimizer: Any) -> None:
        self._optimizer = weakref.ref(optimizer)

    def __len__(self) -> int:
        optimizer = self._optimizer()
        return 0 if optimizer is None else len(optimizer.param_groups)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        group = self._optimizer().param_groups[index]
        local = [(p.to_local() if hasattr(p, "to_local") else p).detach().reshape(-1) for p in group["params"]]
        return torch.cat(local) if local else torch.zeros(0)
