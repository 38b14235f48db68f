"""``deepspeed.ops.lion``: ``FusedLion`` and ``DeepSpeedCPULion``, DeepSpeed's Lion, on torch ops."""

from .cpu_lion import DeepSpeedCPULion  # noqa: F401
from .fused_lion import FusedLion  # noqa: F401
