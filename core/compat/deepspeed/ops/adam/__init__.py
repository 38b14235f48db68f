"""``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam`` as ``torch.optim.Adam`` with DeepSpeed's
arguments: ``adam_w_mode`` / ``adamw_mode`` (default True) selects decoupled weight decay (AdamW), False is
Adam with L2 weight decay; both are DeepSpeed's update rule. torch's Adam always applies bias correction, so
``bias_correction=False`` is refused."""

from __future__ import annotations

import torch

from ..._unsupported import NotSupportedByTorsh, message


def _check(name: str, bias_correction: bool) -> None:
    if not bias_correction:
        raise NotSupportedByTorsh(message(f"ops.adam.{name}(bias_correction=False)", "torch.optim.Adam always "
                                          "corrects the moments' bias; remove bias_correction=False"))  # fmt: skip


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's ``FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad,
    set_grad_none)`` on ``torch.optim.Adam`` (its fused/foreach kernels where torch has them)."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True):  # fmt: skip
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")  # DeepSpeed's own refusal
        _check("FusedAdam", bias_correction)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=bool(adam_w_mode))  # fmt: skip
        # kept in defaults so that an engine rebuilding this optimizer (over sharded parameters) keeps the mode
        self.defaults.update(adam_w_mode=bool(adam_w_mode), bias_correction=True, set_grad_none=set_grad_none)


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed's ``DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
    adamw_mode, fp32_optimizer_states)`` on ``torch.optim.Adam`` (state in the parameters' dtype and device)."""

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):  # fmt: skip
        _check("DeepSpeedCPUAdam", bias_correction)
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         decoupled_weight_decay=bool(adamw_mode))  # fmt: skip
        self.defaults.update(adamw_mode=bool(adamw_mode), bias_correction=True,
                             fp32_optimizer_states=fp32_optimizer_states)  # fmt: skip


class DeepSpeedGPUAdam(FusedAdam):
    """DeepSpeed's alias of ``FusedAdam``."""
