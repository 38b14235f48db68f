"""``deepspeed.runtime``: the submodules training scripts import (``utils``, ``zero``, ``engine``,
``lr_schedules``, ``dataloader``, ``activation_checkpointing``, ``pipe``, ``config``, ``fp16``)."""

from .._lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__, {"utils", "zero", "engine", "lr_schedules", "dataloader",
                                           "activation_checkpointing", "pipe", "config", "fp16"})  # fmt: skip
