"""``deepspeed.pipe`` / ``deepspeed.runtime.pipe``: pipeline parallelism is not run by torsh."""

from ..._unsupported import unsupported_class

_INSTEAD = ("the torsh engine runs data parallelism and sharding only; build the model as one nn.Module "
            "(nn.Sequential of the layers) and pass it to deepspeed.initialize, or use torch.distributed.pipelining")
PipelineModule = unsupported_class("pipe.PipelineModule", _INSTEAD)
LayerSpec = unsupported_class("pipe.LayerSpec", _INSTEAD)
TiedLayerSpec = unsupported_class("pipe.TiedLayerSpec", _INSTEAD)
PipelineEngine = unsupported_class("runtime.pipe.engine.PipelineEngine", _INSTEAD)
DualPipeVModule = unsupported_class("pipe.DualPipeVModule", _INSTEAD)
ProcessTopology = unsupported_class("pipe.ProcessTopology", _INSTEAD)
PipeDataParallelTopology = unsupported_class("pipe.PipeDataParallelTopology", _INSTEAD)
PipeModelDataParallelTopology = unsupported_class("pipe.PipeModelDataParallelTopology", _INSTEAD)
