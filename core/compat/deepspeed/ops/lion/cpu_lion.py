"""``deepspeed.ops.lion.cpu_lion``: DeepSpeed's ``DeepSpeedCPULion`` (the Lion its optimizer offload runs) on torch
ops (:mod:`torsh.engine.optimizers.lion`, which follows this kernel's sign of zero)."""

from __future__ import annotations

from torsh.engine.optimizers.lion import Lion


class DeepSpeedCPULion(Lion):
    """``DeepSpeedCPULion(model_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0, fp32_optimizer_states=True)``:
    the state is kept in fp32 either way."""

    def __init__(self, model_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0, fp32_optimizer_states=True):
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.fp32_optimizer_states = fp32_optimizer_states
