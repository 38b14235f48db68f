"""``deepspeed.moe.experts.Experts``: the experts an MoE layer holds on this rank."""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn


def _as_expert_parameters(module: nn.Module, group_name: Optional[str]) -> nn.Module:
    """Flag ``module``'s parameters as expert parameters the way DeepSpeed's optimizer helpers look for them:
    ``allreduce = False`` (not averaged over the whole data-parallel world) and ``group_name`` (the
    ``ep_size_<n>`` group whose expert-data-parallel ranks average them instead)."""
    for weight in module.parameters():
        weight.allreduce, weight.group_name = False, group_name
    return module


class Experts(nn.Module):
    """``num_local_experts`` independent replicas of ``expert`` (deep copies, in ``deepspeed_experts``, the
    attribute name checkpoints use)."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: Optional[str] = None) -> None:
        super().__init__()
        self.num_local_experts = num_local_experts
        replicas = (_as_expert_parameters(copy.deepcopy(expert), expert_group_name) for _ in range(num_local_experts))
        self.deepspeed_experts = nn.ModuleList(replicas)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """``inputs`` ``[ep_size, num_local_experts, C, M]``: replica i handles index i of dim 1. An expert
        returning ``(output, bias)`` contributes its output only."""
        results = []
        for index, replica in enumerate(self.deepspeed_experts):
            produced = replica(inputs.narrow(1, index, 1))
            results.append(produced[0] if isinstance(produced, tuple) else produced)
        return torch.cat(results, dim=1)
