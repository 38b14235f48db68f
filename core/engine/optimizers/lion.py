"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") as DeepSpeed 0.19.8 steps it.

Per element, with momentum ``m`` (state ``exp_avg``, zero at first), gradient ``g``, ``lr``, ``betas = (b1, b2)``
and ``weight_decay`` ``wd``::

    c = b1 * m + (1 - b1) * g
    p = p * (1 - lr * wd) - lr * sign(c)
    m = b2 * m + (1 - b2) * g

DeepSpeed's kernels never step by zero: its CPU Lion (``DeepSpeedCPULion``, the one that runs under optimizer
offload and the one compared in the suite) puts the sign *bit* of ``c`` on ``lr`` (``c = +0`` steps by ``-lr``,
``c = -0`` by ``+lr``); its CUDA ``FusedLion`` steps by ``-lr`` when ``c > 0`` and ``+lr`` otherwise. The two
differ only at ``c == 0``; this follows the CPU kernel. The update of an element reads only that element, so it is
exact on ZeRO-1/2's flat partitions and FSDP2's shards as it is.
"""

from __future__ import annotations

import torch

from .pieces import local


class Lion(torch.optim.Optimizer):
    """``Lion(params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)``: DeepSpeed's ``FusedLion`` /
    ``DeepSpeedCPULion`` arguments and defaults (its ``optimizer.type: "Lion"``)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0):  # fmt: skip
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Invalid beta parameters: {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                param, grad, exp_avg = local(p), local(p.grad), local(state["exp_avg"])
                grad = grad.to(param.dtype)
                c = exp_avg * beta1 + grad * (1 - beta1)
                step = torch.where(torch.signbit(c), lr, -lr).to(param.dtype)
                if wd > 0:
                    param.mul_(1 - lr * wd)
                param.add_(step)
                exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)
        return loss
