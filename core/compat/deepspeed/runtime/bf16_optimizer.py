"""``deepspeed.runtime.bf16_optimizer``: the name of DeepSpeed's bf16 optimizer wrapper, for ``isinstance``
checks and imports. The torsh engine steps a torch optimizer over fp32 master weights itself, so nothing is an
instance of it (``engine.optimizer`` is the torch optimizer; ``engine.bfloat16_enabled()`` says bf16 is on)."""

from .._unsupported import unsupported_class

BF16_Optimizer = unsupported_class("runtime.bf16_optimizer.BF16_Optimizer", "the torsh engine keeps the fp32 "
                                   "master weights itself; engine.optimizer is the torch optimizer")  # fmt: skip
