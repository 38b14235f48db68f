"""``deepspeed.runtime``: the submodules training scripts import (``utils``, ``zero``, ``engine``,
``lr_schedules``, ``dataloader``, ``activation_checkpointing``, ``pipe``, ``config``, ``config_utils``,
``constants``, ``precision_config``, ``fp16``, ``bf16_optimizer``)."""

from .._lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__, {"utils", "zero", "engine", "lr_schedules", "dataloader",
                                           "activation_checkpointing", "pipe", "config", "config_utils", "constants",
                                           "precision_config", "fp16", "bf16_optimizer", "base_optimizer"})  # fmt: skip
