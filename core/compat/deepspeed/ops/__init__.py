"""``deepspeed.ops``: the optimizers as torch optimizers with DeepSpeed's arguments (``adam``, ``adagrad``);
what needs DeepSpeed's compiled kernels (``lamb``, ``lion``, ``transformer``) imports and fails when used."""

from .._unsupported import unsupported_class
from . import adagrad, adam, lamb, lion  # noqa: F401

DeepSpeedTransformerLayer = unsupported_class("ops.DeepSpeedTransformerLayer", "use your model's own transformer "
                                              "layer (torch.nn.TransformerEncoderLayer or the model's block)")
DeepSpeedTransformerConfig = unsupported_class("ops.DeepSpeedTransformerConfig", "see DeepSpeedTransformerLayer")
