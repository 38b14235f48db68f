"""``deepspeed.moe``: DeepSpeed's mixture-of-experts layer (``layer.MoE``), its gating and dispatch
(``sharded_moe``), experts, tensor-parallel token mappings and optimizer parameter-group helpers (``utils``)."""

from .._lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__, {"layer", "utils", "sharded_moe", "experts", "mappings"})
