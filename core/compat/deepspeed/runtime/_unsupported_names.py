"""DeepSpeed runtime names torsh does not run (importable; using them raises NotSupportedByTorsh)."""

from .._unsupported import unsupported_class

TiledLinear = unsupported_class("zero.TiledLinear", "use torch.nn.Linear; FSDP2 shards it at stage 3")
TiledLinearReturnBias = unsupported_class("zero.TiledLinearReturnBias", "use torch.nn.Linear")
