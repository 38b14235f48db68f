"""``deepspeed.utils.z3_leaf_module``: flagging ZeRO-3 leaf modules (Mixture-of-Experts blocks), which the torsh
engine reads when it plans its FSDP2 units (:mod:`torsh.engine.zero.leaves`)."""

from torsh.engine.zero.leaves import *  # noqa: F401,F403 (DeepSpeed's functions, listed in its __all__)
