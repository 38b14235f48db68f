"""``deepspeed.ops.adam.cpu_adam``: where DeepSpeed defines ``DeepSpeedCPUAdam`` (see :mod:`deepspeed.ops.adam`)."""

from . import DeepSpeedCPUAdam  # noqa: F401
