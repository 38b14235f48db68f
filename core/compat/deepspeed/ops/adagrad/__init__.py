"""``deepspeed.ops.adagrad``: ``DeepSpeedCPUAdagrad`` as ``torch.optim.Adagrad`` with DeepSpeed's arguments."""

from __future__ import annotations

import torch


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """``DeepSpeedCPUAdagrad(model_params, lr, eps, weight_decay, amsgrad, fp32_optimizer_states)``."""

    def __init__(self, model_params, lr=1e-2, eps=1e-10, weight_decay=0, amsgrad=False, fp32_optimizer_states=True):
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
