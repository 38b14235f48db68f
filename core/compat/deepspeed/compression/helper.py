"""``deepspeed.compression.helper``: DeepSpeed-Chat's LoRA code imports ``recursive_getattr`` and
``recursive_setattr`` from here; deprecated in DeepSpeed 0.19.8 in favour of ``deepspeed.utils.module_utils``."""

import warnings

from ..utils.module_utils import recursive_getattr, recursive_setattr

warnings.warn("deepspeed.compression.helper is deprecated (as in DeepSpeed 0.19.8): import recursive_getattr and "
              "recursive_setattr from deepspeed.utils.module_utils", FutureWarning, stacklevel=2)

__all__ = ["recursive_getattr", "recursive_setattr"]
