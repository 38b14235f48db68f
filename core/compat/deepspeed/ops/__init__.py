"""``deepspeed.ops``: the optimizers as torch optimizers with DeepSpeed's arguments (``adam``, ``adagrad``);
what needs DeepSpeed's compiled kernels (``lamb``, ``lion``, ``transformer``) imports and fails when used.
``__compatible_ops__`` / ``__installed_ops__`` say which ops run here (see :mod:`.op_builder`)."""

from .._unsupported import unsupported_class
from . import adagrad, adam, lamb, lion, op_builder  # noqa: F401
from .op_builder import compatible_ops as __compatible_ops__  # noqa: F401
from .op_builder import installed_ops as __installed_ops__  # noqa: F401

DeepSpeedTransformerLayer = unsupported_class("ops.DeepSpeedTransformerLayer", "use your model's own transformer "
                                              "layer (torch.nn.TransformerEncoderLayer or the model's block)")
DeepSpeedTransformerConfig = unsupported_class("ops.DeepSpeedTransformerConfig", "see DeepSpeedTransformerLayer")
