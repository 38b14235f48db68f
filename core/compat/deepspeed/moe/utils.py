"""``deepspeed.moe.utils``: which parameters are expert parameters, and the optimizer parameter groups that keep
them apart (each expert group gets its own parameter group, marked ``moe: True`` and named after its
expert-parallel group, so that the optimizer and ZeRO treat it over the expert-data-parallel group)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

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


def _as_group_list(param_groups: Any) -> list:
    if isinstance(param_groups, tuple):
        return list(param_groups)
    if isinstance(param_groups, dict):
        return [param_groups]
    if not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    return param_groups


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size=178956971) -> list:
    """The optimizer's parameter groups with the expert parameters moved out: each group keeps its shared
    parameters, and for each expert-parallel group name it contains parameters of, a copy of the group's options
    follows (``name`` the expert group's, ``moe: True``) holding those expert parameters, cut into groups of at
    most ``max_group_size`` elements (None: not cut). The list is changed in place and returned, as DeepSpeed's."""
    param_groups = _as_group_list(param_groups)
    expert_names: list[str] = []
    for group in param_groups:
        for p in group["params"]:
            if is_moe_param(p) and p.group_name not in expert_names:
                expert_names.append(p.group_name)
    # one expert group per (source group name, expert group name); source groups sharing a name share them
    expert_groups: dict[Any, dict[str, dict]] = defaultdict(dict)
    for group in param_groups:
        for name in expert_names:
            expert_groups[group["name"]][name] = {**group, "name": name, "moe": True, "params": []}
    for group in param_groups:
        shared = []
        for p in group["params"]:
            if is_moe_param(p):
                expert_groups[group["name"]][p.group_name]["params"].append(p)
            else:
                shared.append(p)
        group["params"] = shared
    for by_name in expert_groups.values():
        for group in by_name.values():
            if max_group_size is None:
                param_groups.append(group)
                continue
            for chunk in _cut(group["params"], max_group_size):
                param_groups.append({**group, "params": chunk})
    return param_groups


def _cut(params: list, max_size) -> list[list]:
    """``params`` in order, in runs of at most ``max_size`` elements (a larger parameter alone)."""
    runs: list[list] = []
    current: list = []
    size = 0
    for p in params:
        numel = p.ds_numel if hasattr(p, "ds_numel") else p.numel()
        if size + numel <= max_size:
            current.append(p)
            size += numel
        else:
            runs.append(current)
            current, size = [p], numel
    if current:
        runs.append(current)
    return runs


def configure_moe_param_groups(model_parameters: list) -> list:
    """The groups for ``deepspeed.initialize(model_parameters=...)`` of a model with MoE layers: a list of
    parameters becomes one group ``dense-params`` and is split; a list of groups is split unless it already
    holds ``moe`` groups."""
    assert isinstance(model_parameters, list), "model_parameters must be a list"
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError("param argument that would be given to the optimizer should be an iterable of Tensors "
                            f"or dicts, but got {type(p)}")  # fmt: skip
    first = model_parameters[0]
    if isinstance(first, torch.nn.Parameter):
        return split_params_into_different_moe_groups_for_optimizer({"params": model_parameters,
                                                                     "name": "dense-params"})  # fmt: skip
    if isinstance(first, dict) and not any("moe" in group for group in model_parameters):
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return model_parameters
