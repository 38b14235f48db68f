"""``deepspeed.runtime.zero.config``: ``ZeroStageEnum``. Training scripts import it (with
``runtime.fp16.loss_scaler.LossScaler``) to pass to ``torch.serialization.add_safe_globals``, so that a DeepSpeed
checkpoint loads under torch's ``weights_only`` default; torsh's own checkpoints pickle no DeepSpeed class."""

from enum import Enum


class ZeroStageEnum(int, Enum):
    """DeepSpeed's ZeRO stages (``zero_stage`` in its checkpoints)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3
