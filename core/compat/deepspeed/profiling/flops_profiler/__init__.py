"""``deepspeed.profiling.flops_profiler``: DeepSpeed's FLOPs profiler is not provided by torsh."""

from ..._unsupported import unsupported_class, unsupported_function

_INSTEAD = "use torch.utils.flop_counter.FlopCounterMode or torch.profiler"
FlopsProfiler = unsupported_class("profiling.flops_profiler.FlopsProfiler", _INSTEAD)
get_model_profile = unsupported_function("profiling.flops_profiler.get_model_profile", _INSTEAD)
