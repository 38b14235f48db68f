"""``deepspeed.runtime.pipe`` / ``deepspeed.pipe``: pipeline parallelism on ``torch.distributed.pipelining``.

``PipelineModule`` builds this rank's stage exactly as DeepSpeed 0.19.8 does; ``deepspeed.initialize`` returns the
pipeline engine (:class:`torsh.engine.pipeline.engine.PipelineEngine`) for it. ``DualPipeVModule`` is not run.
"""

from ..._unsupported import unsupported_class
from .module import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec  # noqa: F401
from .topology import (  # noqa: F401
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
)


def __getattr__(name: str):
    if name == "PipelineEngine":
        from torsh.engine.pipeline.engine import PipelineEngine

        return PipelineEngine
    raise AttributeError(f"module 'deepspeed.runtime.pipe' has no attribute {name!r}")


DualPipeVModule = unsupported_class("pipe.DualPipeVModule", "the DualPipeV schedule is not run by torsh; use "
                                    "PipelineModule (1F1B)")  # fmt: skip
