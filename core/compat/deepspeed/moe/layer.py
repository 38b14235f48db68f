"""``deepspeed.moe.layer.MoE``: DeepSpeed's mixture-of-experts layer, on native PyTorch.

``num_experts`` copies of ``expert`` behind a top-k router; with ``ep_size`` > 1 they are spread over the ranks
of an expert-parallel group (``num_experts / ep_size`` on each) and tokens reach them by all-to-all. The
engine makes the groups when it is built (``set_deepspeed_parallelism``, as DeepSpeed's engine calls it) and
averages the expert gradients over the expert-data-parallel group (``torsh.engine.parallel.moe``).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from ..utils import groups
from .experts import Experts
from .sharded_moe import MOELayer, TopKGate

log = logging.getLogger("torsh.engine")

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


class MoE(nn.Module):
    """A mixture-of-experts layer; ``forward(hidden_states, used_token=None)`` returns ``(output, l_aux,
    exp_counts)``: the combined expert outputs (same shape as the input), the load-balancing loss to add to the
    model's loss, and the tokens routed to each expert.

    ``k``: experts per token (top-1, top-2 or top-k gating); ``capacity_factor`` / ``eval_capacity_factor`` and
    ``min_capacity``: the slots per expert in training / eval; ``drop_tokens=False``: as many slots as the most
    loaded expert needs; ``use_rts``: random token selection when an expert is over-full; ``noisy_gate_policy``:
    'Jitter' (noise on the router's input) or 'RSample' (Gumbel noise on its logits), in training only;
    ``use_residual``: a Residual MoE (a dense copy of ``expert`` beside the experts, mixed by a learned
    coefficient); ``top2_2nd_expert_sampling``: sample top-2's second expert with Gumbel noise.
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:  # fmt: skip
        super().__init__()
        if not isinstance(expert, nn.Module):
            raise TypeError(f"MoE(expert=...) takes the torch module each expert copies (e.g. an MLP); got "
                            f"{type(expert).__name__}")  # fmt: skip
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        assert num_experts % ep_size == 0, (f"Number of experts ({num_experts}) should be divisible by expert "
                                            f"parallel size ({ep_size})")  # fmt: skip
        assert noisy_gate_policy in NOISY_GATE_POLICIES, f"Unsupported noisy_gate_policy: {noisy_gate_policy}"
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        log.debug("MoE layer: %d experts, %d local, expert-parallel size %d", num_experts, self.num_local_experts,
                  ep_size)  # fmt: skip
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling)  # fmt: skip
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts,
                                      use_tutel=use_tutel)  # fmt: skip
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)  # the weights of the experts' and the mlp's outputs

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Make this layer's expert-parallel and expert-data-parallel groups (collective: every rank calls it;
        once per ``ep_size``) and give the layer its expert-parallel group."""
        self._create_process_groups(use_data_before_expert_parallel_=use_data_before_expert_parallel_)

    def _create_process_groups(self, use_data_before_expert_parallel_: bool = False) -> None:
        if self.expert_group_name not in groups._get_expert_parallel_group_dict():
            if groups.mpu is not None and self.enable_expert_tensor_parallelism:
                groups._create_expert_data_and_model_parallel(
                    self.ep_size, mpu=groups.mpu, use_data_before_expert_parallel_=use_data_before_expert_parallel_)
            else:
                groups._create_expert_and_data_parallel(
                    self.ep_size, use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        if self.deepspeed_moe.ep_group is None:  # a second engine over the same model keeps the layer's group
            self.deepspeed_moe._set_ep_group(groups._get_expert_parallel_group(self.expert_group_name))

    def forward(self, hidden_states: torch.Tensor, used_token: Optional[torch.Tensor] = None) -> tuple:
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]  # (output, bias): the bias is dropped
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
