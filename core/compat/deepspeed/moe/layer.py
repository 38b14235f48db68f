"""``deepspeed.moe.layer.MoE``: not run by torsh."""

from .._unsupported import unsupported_class

MoE = unsupported_class("moe.layer.MoE", "expert parallelism is not run by the torsh engine; use a dense layer, "
                        "or an MoE layer written in torch (it then trains data-parallel / sharded like any module)")
