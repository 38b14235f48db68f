"""``deepspeed.moe.utils``: parameter-group helpers of MoE training (MoE is not run by torsh)."""

from .._unsupported import unsupported_function

_INSTEAD = "MoE is not run by the torsh engine; pass the model's parameters (or your own groups) to the optimizer"
split_params_into_different_moe_groups_for_optimizer = unsupported_function(
    "moe.utils.split_params_into_different_moe_groups_for_optimizer", _INSTEAD)
is_moe_param = unsupported_function("moe.utils.is_moe_param", _INSTEAD)
