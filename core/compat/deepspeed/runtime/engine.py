"""``deepspeed.runtime.engine``: ``DeepSpeedEngine`` is the torsh :class:`~torsh.engine.engine.Engine`."""

from torsh.engine.engine import Engine as DeepSpeedEngine  # noqa: F401

DeepSpeedOptimizerCallable = object
DeepSpeedSchedulerCallable = object
