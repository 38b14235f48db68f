"""``deepspeed.ops.lamb``: LAMB needs DeepSpeed's CUDA kernel; not run by torsh."""

from ..._unsupported import unsupported_class

FusedLamb = unsupported_class("ops.lamb.FusedLamb", "LAMB is DeepSpeed's CUDA kernel; use torch.optim.AdamW "
                              "(or a LAMB implementation written in torch) and pass it to deepspeed.initialize")
