"""``deepspeed.runtime.fp16.loss_scaler``: DeepSpeed's loss-scaler classes, importable so that scripts can pass
them to ``torch.serialization.add_safe_globals`` (DeepSpeed's checkpoints pickle them). The torsh engine scales
the loss itself (``engine.loss_scale()``, ``fp16`` in the config); constructing these raises."""

from ..._unsupported import unsupported_class, unsupported_function

_INSTEAD = "the torsh engine scales the loss itself: set fp16.loss_scale / initial_scale_power in the config"

LossScalerBase = unsupported_class("runtime.fp16.loss_scaler.LossScalerBase", _INSTEAD)
LossScaler = unsupported_class("runtime.fp16.loss_scaler.LossScaler", _INSTEAD)
DynamicLossScaler = unsupported_class("runtime.fp16.loss_scaler.DynamicLossScaler", _INSTEAD)
CreateLossScaler = unsupported_function("runtime.fp16.loss_scaler.CreateLossScaler", _INSTEAD)
