"""``deepspeed.compression``: only its ``helper`` module, which DeepSpeed-Chat imports (DeepSpeed 0.19.8 keeps it
as a deprecated alias of ``deepspeed.utils.module_utils``)."""
