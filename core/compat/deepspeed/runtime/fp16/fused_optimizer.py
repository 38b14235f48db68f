"""``deepspeed.runtime.fp16.fused_optimizer``: the name of DeepSpeed's fp16 optimizer wrapper, for ``isinstance``
checks and imports; the torsh engine scales the loss and keeps fp32 master weights itself, so nothing is an
instance of it (``engine.optimizer`` is the torch optimizer)."""

from ..._unsupported import unsupported_class

FP16_Optimizer = unsupported_class("runtime.fp16.fused_optimizer.FP16_Optimizer", "the torsh engine scales the "
                                   "loss itself; engine.optimizer is the torch optimizer")  # fmt: skip
