"""``deepspeed.zero`` (= ``deepspeed.runtime.zero``): see :mod:`.partition_parameters`."""

from __future__ import annotations

import contextlib

from .._unsupported_names import TiledLinear, TiledLinearReturnBias  # noqa: F401
from .partition_parameters import (  # noqa: F401
    GatheredParameters,
    Init,
    ZeroParamStatus,
    ZeroParamType,
    is_zero_param,
    register_external_parameter,
    unregister_external_parameter,
)


@contextlib.contextmanager
def unwrap_model_for_generation(model):
    """Yield the model for generation; FSDP2 gathers each unit's parameters in forward, so nothing is needed."""
    yield model
