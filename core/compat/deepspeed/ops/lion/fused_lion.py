"""``deepspeed.ops.lion.fused_lion``: DeepSpeed's ``FusedLion`` on torch ops (:mod:`torsh.engine.optimizers.lion`,
which documents the update rule). DeepSpeed runs it on CUDA only; this runs wherever torch does."""

from __future__ import annotations


from torsh.engine.optimizers.lion import Lion


class FusedLion(Lion):
    """``FusedLion(params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, set_grad_none=True)``; ``zero_grad()``
    sets the gradients to None unless ``set_grad_none`` is false, as DeepSpeed's."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, set_grad_none=True):
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=self.set_grad_none)
