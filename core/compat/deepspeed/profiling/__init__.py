"""``deepspeed.profiling``."""

from .._lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__, {"flops_profiler"})
