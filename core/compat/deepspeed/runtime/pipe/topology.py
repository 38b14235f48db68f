"""``deepspeed.runtime.pipe.topology``: the process grid of a pipeline job, the engine's
(:mod:`torsh.engine.pipeline.topology`), and ``_prime_factors``, which DeepSpeed's grid uses to lay out its
default topology and which its tests and some launch helpers import from here."""

from torsh.engine.pipeline.topology import (  # noqa: F401
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
    _prime_factors,
)
