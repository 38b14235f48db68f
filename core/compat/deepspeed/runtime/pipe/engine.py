"""``deepspeed.runtime.pipe.engine``: the pipeline engine is :class:`torsh.engine.pipeline.engine.PipelineEngine`."""

from torsh.engine.pipeline.engine import PipelineEngine, PipelineError  # noqa: F401
