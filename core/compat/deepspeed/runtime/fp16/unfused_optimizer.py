"""``deepspeed.runtime.fp16.unfused_optimizer``: the name of DeepSpeed's unfused fp16/bf16 optimizer wrapper, for
``isinstance`` checks and imports; nothing is an instance of it under torsh (``engine.optimizer`` is the torch
optimizer)."""

from ..._unsupported import unsupported_class

FP16_UnfusedOptimizer = unsupported_class("runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer", "the torsh "
                                          "engine scales the loss itself; engine.optimizer is the torch "
                                          "optimizer")  # fmt: skip
