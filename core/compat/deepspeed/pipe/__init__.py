"""``deepspeed.pipe``: see :mod:`torsh.compat.deepspeed.runtime.pipe` (not run by torsh)."""

from ..runtime.pipe import (  # noqa: F401
    DualPipeVModule,
    LayerSpec,
    PipeDataParallelTopology,
    PipelineModule,
    PipeModelDataParallelTopology,
    ProcessTopology,
    TiedLayerSpec,
)
