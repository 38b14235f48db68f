"""``deepspeed.runtime.engine``: ``DeepSpeedEngine`` is the torsh :class:`~torsh.engine.engine.Engine`."""

from torsh.engine.engine import Engine as DeepSpeedEngine  # noqa: F401

DeepSpeedOptimizerCallable = object
DeepSpeedSchedulerCallable = object

# the parallel layout a checkpoint records (DeepSpeed's engine helper, which its checkpoint tests import from here)
from ..checkpoint.utils import checkpoint_parallel_metadata as _checkpoint_parallel_metadata  # noqa: E402, F401
