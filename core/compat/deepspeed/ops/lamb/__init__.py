"""``deepspeed.ops.lamb``: ``FusedLamb``, DeepSpeed's LAMB, on torch ops (:mod:`.fused_lamb`)."""

from .fused_lamb import FusedLamb  # noqa: F401
