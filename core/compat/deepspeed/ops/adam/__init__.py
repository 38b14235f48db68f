"""``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam`` as ``torch.optim.Adam`` with DeepSpeed's
arguments: ``adam_w_mode`` / ``adamw_mode`` (default True) selects decoupled weight decay (AdamW), False is
Adam with L2 weight decay; both are DeepSpeed's update rule. Both classes always apply bias correction, so
``bias_correction=False`` is refused by each: ``FusedAdam`` is torch's Adam step, and ``DeepSpeedCPUAdam``
(:mod:`.cpu_adam`) steps through torch's Adam too, doing DeepSpeed's fp32 update itself only where torch's differs
(fp16/bf16 parameters)."""

from __future__ import annotations

import torch

from .cpu_adam import DeepSpeedCPUAdam  # noqa: F401  (DeepSpeed's home of the class)
from .cpu_adam import check_bias_correction


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's ``FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad,
    set_grad_none)`` on ``torch.optim.Adam`` (its fused/foreach kernels where torch has them)."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True):  # fmt: skip
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")  # DeepSpeed's own refusal
        check_bias_correction("FusedAdam", bias_correction)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=bool(adam_w_mode))  # fmt: skip
        # kept in defaults so that an engine rebuilding this optimizer (over sharded parameters) keeps the mode
        self.defaults.update(adam_w_mode=bool(adam_w_mode), bias_correction=True, set_grad_none=set_grad_none)


class DeepSpeedGPUAdam(FusedAdam):
    """DeepSpeed's alias of ``FusedAdam``."""
