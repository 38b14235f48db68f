"""``deepspeed.moe``: mixture-of-experts layers are not run by torsh (imports work; using them raises)."""

from .._lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__, {"layer", "utils"})
