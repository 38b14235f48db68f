"""``deepspeed.runtime.fp16``: ``loss_scaler``, ``fused_optimizer`` and ``unfused_optimizer``'s names."""
