"""``deepspeed.runtime.pipe.topology``: the process grid of a pipeline job, the engine's
(:mod:`torsh.engine.pipeline.topology`)."""

from torsh.engine.pipeline.topology import (  # noqa: F401
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
)
