"""What every section of the config model shares: the ``Section`` base (unknown keys are errors, every field is
documented, every float is finite), the dtype and "auto" annotations, and the bounds of counts and sizes."""

# No ``from __future__ import annotations`` in this module: with it, pydantic compiles and evaluates the field
# annotations from strings when the classes are built (~4 ms of every torsh-migrate call); as real objects they
# come from the module's cached bytecode. Annotations naming their own class are quoted.

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from . import _config_docs
from .deferred import Deferred

_DOCSTRING_READER = _config_docs.install(__name__, __file__)

# --------------------------------------------------------------------------------------------------
# Shared types


def _normalise_dtype(value: Any) -> Any:
    from .concepts.dtypes import normalise

    return normalise(value)


DType = Annotated[Literal["fp32", "bf16", "fp16"], BeforeValidator(_normalise_dtype)]
"""A floating-point dtype; accepts the spellings fp32/float32/torch.float32, bf16/bfloat16, fp16/float16/half."""

MaybeAuto = Deferred  # readability in annotations: ``int | MaybeAuto``


# Bounds of counts and sizes: beyond them a value is a typo or hostile input (10**8 processes, a 2**2000 loss scale),
# and downstream arithmetic (timedelta, fp32 scales, per-process lists) would overflow or exhaust memory.
MAX_PROCESSES = 1 << 20
"""Most processes (world size, nodes, a shard group) a job may have."""
MAX_PROCESSES_PER_NODE = 4096
"""Most processes on one node (nproc_per_node, hostfile slots)."""
MAX_LOSS_SCALE = float(2**64)
"""Largest loss scale (DeepSpeed ``initial_scale_power`` 64); fp32 overflows at 2**128 and a gradient scaled by more
than 2**64 is inf for any loss above 2**64."""
MAX_TIMEOUT_S = 1e9
"""Longest timeout in seconds (about 31 years; ``datetime.timedelta`` overflows near 8.6e13)."""
MAX_BYTES_SIZE = 1 << 40
"""Largest buffer or bucket size in bytes (1 TiB)."""

Probability = Annotated[float, Field(ge=0.0, lt=1.0)]
"""A coefficient in [0, 1): Adam betas, momentum cycled into beta1."""


class Section(BaseModel):
    """Base of every section: unknown keys are errors, every field is documented, every float is finite."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
        validate_default=True,
        allow_inf_nan=False,
    )


_config_docs.restore(_DOCSTRING_READER)
