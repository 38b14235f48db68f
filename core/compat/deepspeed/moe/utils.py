"""``deepspeed.moe.utils``: parameter-group helpers of MoE training. torsh runs no expert parallelism (DeepSpeed's
``MoE`` layer is not provided), so a model has no MoE parameters and the groups pass through unchanged, as
DeepSpeed passes them for a model without MoE layers."""

from __future__ import annotations

from typing import Any

from .._unsupported import NotSupportedByTorsh, message


def is_moe_param(param) -> bool:
    """DeepSpeed's mark of an expert parameter: ``param.allreduce`` set to False by its MoE layer."""
    return hasattr(param, "allreduce") and not param.allreduce


def is_moe_param_group(param_group: dict) -> bool:
    return bool(param_group.get("moe", False))


def split_params_into_shared_and_expert_params(params) -> tuple[list, list]:
    """(shared parameters, expert parameters)."""
    params = list(params)
    return [p for p in params if not is_moe_param(p)], [p for p in params if is_moe_param(p)]


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size=178956971) -> list:
    """The optimizer's parameter groups with DeepSpeed's MoE groups split out. Without expert parameters (always,
    under torsh) the groups come back as a list, each group's ``params`` a list, as DeepSpeed returns them."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    for group in param_groups:
        group["params"] = list(group["params"])
        if any(is_moe_param(p) for p in group["params"]):
            raise NotSupportedByTorsh(message(
                "moe.utils.split_params_into_different_moe_groups_for_optimizer", "the group holds expert parameters "
                "(allreduce=False), and expert parallelism is not run by the torsh engine"))  # fmt: skip
    return param_groups


def configure_moe_param_groups(model_parameters: list) -> list:
    """The groups for ``deepspeed.initialize(model_parameters=...)``: a list of parameters becomes one group,
    then :func:`split_params_into_different_moe_groups_for_optimizer`."""
    assert isinstance(model_parameters, list), "model_parameters must be a list"
    if model_parameters and isinstance(model_parameters[0], dict):
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return split_params_into_different_moe_groups_for_optimizer({"params": model_parameters, "name": "dense-params"})
