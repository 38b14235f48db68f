"""``deepspeed.ops.lion``: Lion needs DeepSpeed's kernels; not run by torsh."""

from ..._unsupported import unsupported_class

_INSTEAD = "torch has no Lion; pass a Lion optimizer written in torch to deepspeed.initialize"
FusedLion = unsupported_class("ops.lion.FusedLion", _INSTEAD)
DeepSpeedCPULion = unsupported_class("ops.lion.DeepSpeedCPULion", _INSTEAD)
