"""``deepspeed.ops.adam.fused_adam``: where DeepSpeed defines ``FusedAdam`` (see :mod:`deepspeed.ops.adam`)."""

from . import FusedAdam  # noqa: F401
