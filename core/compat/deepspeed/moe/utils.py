"""``deepspeed.moe.utils``: which parameters are expert parameters, and the optimizer parameter groups that keep
them apart (each expert group gets its own parameter group, marked ``moe: True`` and named after its
expert-parallel group, so that the optimizer and ZeRO treat it over the expert-data-parallel group)."""

from __future__ import annotations

from typing import Any

from torch import nn

from torsh.engine.parallel.moe import expert_param_groups, split_expert_groups

from .layer import MoE


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """(whether ``m`` holds an MoE layer, the expert count of the first one; 0 without)."""
    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def is_moe_param(param) -> bool:
    """DeepSpeed's mark of an expert parameter: ``param.allreduce`` set to False by its MoE layer."""
    return hasattr(param, "allreduce") and not param.allreduce


def is_moe_param_group(param_group: dict) -> bool:
    return param_group.get("moe", False)


def split_params_into_shared_and_expert_params(params) -> tuple[list, list]:
    """(shared parameters, expert parameters)."""
    params = list(params)
    return [p for p in params if not is_moe_param(p)], [p for p in params if is_moe_param(p)]


def split_params_grads_into_shared_and_expert_params(group) -> tuple[list, list]:
    """(gradients of the shared parameters, gradients of the expert parameters), each in its parameter's dtype;
    parameters without a gradient are left out."""
    shared, expert = [], []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size=178956971) -> list:
    """The optimizer's parameter groups with the expert parameters moved out: each group keeps its shared
    parameters, and for each expert-parallel group name it contains parameters of, a copy of the group's options
    follows (``name`` the expert group's, ``moe: True``) holding those expert parameters, cut into groups of at
    most ``max_group_size`` elements (None: not cut). The list is changed in place and returned, as DeepSpeed's."""
    return split_expert_groups(param_groups, max_group_size)


def configure_moe_param_groups(model_parameters: list) -> list:
    """The groups for ``deepspeed.initialize(model_parameters=...)`` of a model with MoE layers: a list of
    parameters becomes one group ``dense-params`` and is split; a list of groups is split unless it already
    holds ``moe`` groups."""
    return expert_param_groups(model_parameters)
