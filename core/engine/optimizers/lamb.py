"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning") as DeepSpeed 0.19.8's ``FusedLamb``
steps it (its ``optimizer.type: "Lamb"``).

Per parameter tensor, with ``m``, ``v`` (states ``exp_avg``, ``exp_avg_sq``), gradient ``g`` and step ``t``::

    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    u = m / (sqrt(v) + eps) + weight_decay * p          (eps_inside_sqrt: m / sqrt(v + eps) + ...)
    r = clamp(|p| / |u|, min_coeff, max_coeff)         (1 when |p| or |u| is 0)
    p = p - step_size * r * u,   step_size = lr * sqrt(1 - b2^t) / (1 - b1^t)   (lr without bias_correction)

``|p|`` (before the update) and ``|u|`` are norms of the whole parameter, and the bias correction sits in the
step size, not in ``u``: the trust ratio is that of the uncorrected update, as DeepSpeed's kernel computes it.

The norms need the whole tensor. On FSDP2's shards (ZeRO-3) and ZeRO-1/2's flat partitions each rank sums the
squares of its own elements of each parameter and the sums are all-reduced (:mod:`.pieces`): the trust ratio is
the one stage 0 computes. (DeepSpeed itself refuses ``FusedLamb`` under ZeRO unless
``zero_allow_untested_optimizer`` is set, and then steps its flat partition as one tensor: one trust ratio per
partition. It also runs ``FusedLamb`` on CUDA only.)
"""

from __future__ import annotations

import torch

from .pieces import local, pieces_of, whole_sums


class Lamb(torch.optim.Optimizer):
    """DeepSpeed's ``FusedLamb(params, lr, bias_correction, betas, eps, eps_inside_sqrt, weight_decay,
    max_grad_norm, max_coeff, min_coeff, amsgrad)`` with its defaults. ``lamb_coeffs`` holds the last step's trust
    ratios (one per parameter), :meth:`get_lamb_coeffs` them as floats."""

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, amsgrad: bool = False):  # fmt: skip
        if amsgrad:
            raise RuntimeError("FusedLamb does not support the AMSGrad variant.")  # DeepSpeed's own refusal
        if max_grad_norm and max_grad_norm > 0:
            # FusedLamb clips by a per-group norm it must be handed at step(); the engine hands none (DeepSpeed's
            # step then fails on None / scale). Clipping belongs to the engine: gradient_clipping.
            raise ValueError("Lamb: max_grad_norm > 0 needs the gradient norm passed to step(); set max_grad_norm "
                             "to 0 and use the config's gradient_clipping")  # fmt: skip
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                                      eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay,
                                      max_grad_norm=max_grad_norm, max_coeff=max_coeff,
                                      min_coeff=min_coeff))  # fmt: skip
        self.lamb_coeffs: list[torch.Tensor] = []

    def get_lamb_coeffs(self) -> list[float]:
        return [float(c) for c in self.lamb_coeffs]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict) -> None:
        beta1, beta2 = group["betas"]
        eps, wd = group["eps"], group["weight_decay"]
        todo = []  # (pieces of p, pieces of its update, step size) for every parameter inside the group's tensors
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("FusedLamb does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            param, grad = local(p), local(p.grad).to(local(p).dtype)
            exp_avg, exp_avg_sq = local(state["exp_avg"]), local(state["exp_avg_sq"])
            exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (exp_avg_sq + eps).sqrt() if group["eps_inside_sqrt"] else exp_avg_sq.sqrt().add_(eps)
            update = exp_avg / denom
            if wd:
                update.add_(param, alpha=wd)
            t = state["step"]
            size = group["lr"] * ((1 - beta2**t) ** 0.5 / (1 - beta1**t) if group["bias_correction"] else 1.0)
            todo += [(pp, up, size) for pp, up in zip(pieces_of(self, p, p), pieces_of(self, p, update))]
        if not todo:
            return
        squares = [piece.local.float().pow(2).sum() for pp, up, _ in todo for piece in (pp, up)]
        sums = whole_sums(squares, [pp.groups for pp, _, _ in todo for _ in range(2)]).view(-1, 2).sqrt()
        w, u = sums[:, 0], sums[:, 1]
        ratio = torch.where((w != 0) & (u != 0), (w / u).clamp(group["min_coeff"], group["max_coeff"]),
                            torch.ones_like(w))  # fmt: skip
        for (pp, up, size), r in zip(todo, ratio):
            pp.local.sub_(up.local * (size * r).to(up.local.dtype))
            self.lamb_coeffs.append(r)
