"""``deepspeed.ops.lamb.fused_lamb``: DeepSpeed's ``FusedLamb`` on torch ops (:mod:`torsh.engine.optimizers.lamb`,
which documents the update rule). DeepSpeed runs it on CUDA only; this runs wherever torch does."""

from __future__ import annotations

from torsh.engine.optimizers.lamb import Lamb


class FusedLamb(Lamb):
    """``FusedLamb(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, eps_inside_sqrt=False,
    weight_decay=0.0, max_grad_norm=0.0, max_coeff=10.0, min_coeff=0.01, amsgrad=False)``."""
