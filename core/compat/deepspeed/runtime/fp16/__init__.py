"""``deepspeed.runtime.fp16``: only ``loss_scaler``'s names (see :mod:`.loss_scaler`)."""
