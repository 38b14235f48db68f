"""``deepspeed.runtime.zero.muon.original_muon``: the Muon step's pieces under DeepSpeed's names, on torsh's
implementation (:mod:`torsh.engine.optimizers.muon`, which documents the update rule)."""

from __future__ import annotations

import torch

from torsh.engine.optimizers.muon import NS_METHODS as _METHODS
from torsh.engine.optimizers.muon import MuonWithAuxAdam as _Muon
from torsh.engine.optimizers.muon import muon_update as _muon_update
from torsh.engine.optimizers.muon import ns_dtype, orthogonalise

NS_METHODS = set(_METHODS)


def ns_compute_dtype(ns_method: str = "gram") -> torch.dtype:
    """The dtype Newton-Schulz runs in for ``ns_method`` on this machine's accelerator (CUDA if present, else the
    CPU)."""
    return ns_dtype(ns_method, torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int) -> torch.Tensor:
    return orthogonalise(G, steps, "standard")


def zeropower_via_gram_newtonschulz(G: torch.Tensor, steps: int) -> torch.Tensor:
    return orthogonalise(G, steps, "gram")


def muon_update(grad, momentum, beta=0.95, ns_steps=5, nesterov=True, ns_method="gram", is_expert_group=False,
                num_heads=None):  # fmt: skip
    """DeepSpeed's ``muon_update``: the update of one matrix, its momentum advanced in place (Nesterov only;
    per-head orthogonalisation is not run by torsh)."""
    if not nesterov:
        raise NotImplementedError("muon_update(nesterov=False) is not run by torsh; DeepSpeed's Muon always uses "
                                  "Nesterov momentum")  # fmt: skip
    if num_heads is not None:
        raise NotImplementedError("per-head Muon (num_heads) is not run by torsh: pass num_heads=None")
    return _muon_update(grad, momentum, beta, ns_steps, method=ns_method, batched=is_expert_group)


def adam_update(grad, buf1, buf2, step, betas, eps):
    """Adam's bias-corrected direction (the moments ``buf1``, ``buf2`` advanced in place)."""
    buf1.lerp_(grad, 1 - betas[0])
    buf2.lerp_(grad.square(), 1 - betas[1])
    return (buf1 / (1 - betas[0] ** step)) / ((buf2 / (1 - betas[1] ** step)).sqrt() + eps)


class MuonWithAuxAdam(_Muon):
    """DeepSpeed's ``MuonWithAuxAdam(param_groups)``: groups with ``use_muon``, decoupled weight decay."""

    def __init__(self, param_groups):
        super().__init__(param_groups)


class SingleDeviceMuonWithAuxAdam(MuonWithAuxAdam):
    """DeepSpeed's non-distributed variant: the same update."""
