"""``deepspeed.pipe``: :mod:`torsh.compat.deepspeed.runtime.pipe` (``PipelineModule``, ``LayerSpec``,
``TiedLayerSpec``, the topologies)."""

from ..runtime.pipe import (  # noqa: F401
    DualPipeVModule,
    LayerSpec,
    PipeDataParallelTopology,
    PipelineModule,
    PipeModelDataParallelTopology,
    ProcessTopology,
    TiedLayerSpec,
)
