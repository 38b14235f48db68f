"""``deepspeed.runtime.activation_checkpointing``."""

from ..._lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__, {"checkpointing", "offload_activations"})
