"""``deepspeed.runtime.zero.offload_config``: the enums scripts pass to ``engine.offload_states``."""

from enum import Enum


class OffloadDeviceEnum(str, Enum):
    """Where offloaded state goes."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """Which engine state ``offload_states(include=...)`` moves."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"
