"""``deepspeed.moe.experts.Experts``: the experts an MoE layer holds on this rank."""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn


class Experts(nn.Module):
    """``num_local_experts`` independent copies of ``expert``. Their parameters carry DeepSpeed's marks:
    ``allreduce = False`` (an expert parameter: its gradient is not averaged over the whole data-parallel world)
    and ``group_name`` (the expert-parallel group, ``ep_size_<n>``, whose expert-data-parallel group averages it
    instead)."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: Optional[str] = None) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for local in self.deepspeed_experts:
            for param in local.parameters():
                param.allreduce = False
                param.group_name = expert_group_name

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """``inputs`` ``[ep_size, num_local_experts, C, M]``: local expert i runs on slice i of dim 1."""
        outputs = []
        for chunk, expert in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)  # (output, bias): the bias is dropped
        return torch.cat(outputs, dim=1)
