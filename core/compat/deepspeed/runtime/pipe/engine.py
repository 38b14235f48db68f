"""``deepspeed.runtime.pipe.engine``: the pipeline engine is :class:`torsh.engine.pipeline.PipelineEngine`."""

from torsh.engine.pipeline import PipelineEngine, PipelineError  # noqa: F401
