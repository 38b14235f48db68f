"""``deepspeed.utils.z3_leaf_module``: flagging ZeRO-3 leaf modules (Mixture-of-Experts blocks), which the torsh
engine reads when it plans its FSDP2 units (:mod:`torsh.engine.leaves`)."""

from torsh.engine.leaves import (  # noqa: F401
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)
